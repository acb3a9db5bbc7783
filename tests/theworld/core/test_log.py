"""theworld/core/log.py: what commands tell the user goes through one logger; --quiet, --verbose and THEWORLD_LOG_LEVEL
choose how much, and the lines look as they did when they were prints."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from theworld.core import log
from theworld.core.errors import UserError, cli_entry

ROOT = Path(__file__).resolve().parents[3]


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != log.ENV}
    full.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, env=full, timeout=99)


def make_items(tmp_path: Path, *flags: str, **env: str) -> subprocess.CompletedProcess:
    data = tmp_path / f"items{len(list(tmp_path.iterdir()))}.jsonl"
    return run(["theworld.evaluate", *flags, "--make-synthetic", "3", "--data", str(data)], **env)


def test_info_lines_shown_by_default_and_hidden_by_quiet_or_the_variable(tmp_path):
    shown = make_items(tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr.startswith("wrote 3 items to ")  # as the print wrote it: no level, no logger name
    for quiet in (make_items(tmp_path, "--quiet"), make_items(tmp_path, **{log.ENV: "WARNING"})):
        assert quiet.returncode == 0, quiet.stderr
        assert quiet.stderr == ""
    assert make_items(tmp_path, "--verbose").stderr.startswith("wrote 3 items")


def test_errors_survive_quiet_and_keep_their_one_line_form(tmp_path):
    r = run(["theworld.evaluate", "--quiet", "--model", str(tmp_path / "none"), "--data", str(tmp_path / "x.jsonl")])
    assert r.returncode == 2
    assert r.stderr == f"error: {tmp_path / 'x.jsonl'}: no such file\n"
    r = run(["theworld.evaluate", "--model", str(tmp_path / "none"), "--data", "x"], **{log.ENV: "error"})
    assert r.returncode == 2 and r.stderr.startswith("error: ")


def test_a_bad_level_in_the_variable_is_named_and_the_run_goes_on(tmp_path):
    r = make_items(tmp_path, **{log.ENV: "loud"})
    assert r.returncode == 0
    lines = r.stderr.splitlines()
    assert lines[0] == f"warning: {log.ENV}='loud' is not one of debug, info, warning, error; using info"
    assert lines[1].startswith("wrote 3 items")


def test_quiet_and_verbose_together_are_a_usage_error(tmp_path):
    r = make_items(tmp_path, "--quiet", "--verbose")
    assert r.returncode == 2
    assert r.stderr.startswith("error: theworld.evaluate: argument --verbose: not allowed with argument --quiet")


def test_levels_and_prefixes_in_process(capsys, monkeypatch):
    monkeypatch.delenv(log.ENV, raising=False)

    @cli_entry
    def command(argv):
        lg = log.get("train.something")
        lg.debug("hidden at info")
        lg.info("plain line")
        lg.warning("watch out")
        raise UserError("bad value\nover two lines")

    assert command([]) == 2
    assert capsys.readouterr().err == "plain line\nwarning: watch out\nerror: bad value / over two lines\n"
    monkeypatch.setenv(log.ENV, "debug")
    assert command([]) == 2
    assert capsys.readouterr().err.startswith("hidden at info\nplain line\n")


@pytest.mark.parametrize("name", ["train.loop", "precompute.inspect", "theworld.model", "theworld"])
def test_every_package_logs_under_one_tree(name):
    logger = log.get(name)
    assert logger.name.split(".")[0] == log.ROOT
    log.configure(logging.ERROR)
    try:
        assert not logger.isEnabledFor(logging.WARNING)
    finally:
        log.configure(logging.INFO)
