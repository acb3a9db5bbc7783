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


@pytest.fixture
def evaluate(monkeypatch, capsys):
    """`python -m theworld.evaluate ARGS` in process (its main(argv)) with THEWORLD_LOG_LEVEL as given (else unset):
    (exit code, stderr). The logger's level is put back after each: --quiet would outlive the command."""
    from theworld.evaluate import main

    def call(args: list[str], **env: str) -> tuple[int, str]:
        capsys.readouterr()
        with monkeypatch.context() as m:
            m.delenv(log.ENV, raising=False)
            for k, v in env.items():
                m.setenv(k, v)
            try:
                code = main(args)
            finally:
                log.configure(logging.INFO)
        return code, capsys.readouterr().err

    return call


def items_argv(tmp_path: Path, *flags: str) -> list[str]:
    data = tmp_path / f"items{len(list(tmp_path.iterdir()))}.jsonl"
    return [*flags, "--make-synthetic", "3", "--data", str(data)]


def test_info_lines_shown_by_default_and_hidden_by_quiet_or_the_variable(tmp_path, evaluate):
    code, err = evaluate(items_argv(tmp_path))
    assert code == 0, err
    assert err.startswith("wrote 3 items to ")  # as the print wrote it: no level, no logger name
    # a whole process, in a subprocess: nothing on stderr from its imports either
    quiet = run(["theworld.evaluate", *items_argv(tmp_path, "--quiet")])
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert evaluate(items_argv(tmp_path), **{log.ENV: "WARNING"}) == (0, "")
    assert evaluate(items_argv(tmp_path, "--verbose"))[1].startswith("wrote 3 items")


def test_errors_survive_quiet_and_keep_their_one_line_form(tmp_path, evaluate):
    code, err = evaluate(["--quiet", "--model", str(tmp_path / "none"), "--data", str(tmp_path / "x.jsonl")])
    assert code == 2
    assert err == f"error: {tmp_path / 'x.jsonl'}: no such file\n"
    code, err = evaluate(["--model", str(tmp_path / "none"), "--data", "x"], **{log.ENV: "error"})
    assert code == 2 and err.startswith("error: ")


def test_a_bad_level_in_the_variable_is_named_and_the_run_goes_on(tmp_path, evaluate):
    code, err = evaluate(items_argv(tmp_path), **{log.ENV: "loud"})
    assert code == 0
    lines = err.splitlines()
    assert lines[0] == f"warning: {log.ENV}='loud' is not one of debug, info, warning, error; using info"
    assert lines[1].startswith("wrote 3 items")


def test_quiet_and_verbose_together_are_a_usage_error(tmp_path, evaluate):
    code, err = evaluate(items_argv(tmp_path, "--quiet", "--verbose"))
    assert code == 2
    assert err.startswith("error: theworld.evaluate: argument --verbose: not allowed with argument --quiet")


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
