"""theworld.core.run_lock: one run per output folder; the lock ends with the process that took it, kill -9 included, and
never passes to a forked child (a DataLoader worker outliving a killed run must not block its rerun)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ENV, base_args, one_error_line, train_inproc
from theworld.core import run_lock
from theworld.core.errors import UserError

HOLD = (
    "import sys, time\nfrom theworld.core import run_lock\nrun_lock.acquire(sys.argv[1])\nprint('held', flush=True)\n"
    "time.sleep(120)"
)
TRY = (
    "import sys\nfrom theworld.core import run_lock\nfrom theworld.core.errors import UserError\ntry:\n"
    "    run_lock.acquire(sys.argv[1])\nexcept UserError as e:\n    print(e)\n    sys.exit(2)"
)


def _try(folder) -> subprocess.CompletedProcess:
    """Another process trying to take the folder: exit 0 if it got it, 2 with the refusal on stdout if not."""
    return subprocess.run([sys.executable, "-c", TRY, str(folder)], env=ENV, capture_output=True, text=True, timeout=60)


def test_a_held_folder_is_refused_naming_its_holder_and_is_free_once_the_holder_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = _try(tmp_path)
        assert refused.returncode == 2, refused.stderr
        assert "'output_dir'" in refused.stdout and "in use by another run" in refused.stdout
        assert f"pid {holder.pid} on " in refused.stdout
    finally:
        holder.kill()  # SIGKILL: no clean-up code runs
        holder.wait()
    assert _try(tmp_path).returncode == 0


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    fd = run_lock.acquire(tmp_path)
    child = os.fork()
    if child == 0:  # stands for a loader worker: it has the lock file open, inherited
        time.sleep(60)
        os._exit(0)
    try:
        assert _try(tmp_path).returncode == 2
        os.close(fd)
        assert _try(tmp_path).returncode == 0  # while the child is alive and still has the file open
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_folder_that_is_a_file_or_cannot_be_made_is_a_one_line_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="'output_dir'.*afile is a file, not a folder"):
        run_lock.acquire(tmp_path / "afile")
    with pytest.raises(UserError, match="'output_dir': cannot write .*afile/below"):
        run_lock.acquire(tmp_path / "afile" / "below")


def test_hold_releases_the_folder_when_its_block_ends_or_raises(tmp_path):
    class OneProcess:  # what hold() reads of an Accelerator or PartialState
        is_main_process, num_processes = True, 1

    with run_lock.hold(tmp_path, OneProcess()):
        assert _try(tmp_path).returncode == 2
    assert _try(tmp_path).returncode == 0
    with pytest.raises(RuntimeError, match="boom"):
        with run_lock.hold(tmp_path, OneProcess()):
            raise RuntimeError("boom")
    assert _try(tmp_path).returncode == 0


def test_the_other_processes_repeat_the_main_processs_verdict(tmp_path):
    (tmp_path / run_lock.LOCK_FILE).write_text("pid 5 on node-3, since 2026-11-22 02:00:00\n")
    in_use = run_lock._verdict_elsewhere(tmp_path, 1, "output_dir")
    assert isinstance(in_use, run_lock.InUse) and "in use by another run (pid 5 on node-3, since" in str(in_use)
    assert "holder unknown" in str(run_lock._verdict_elsewhere(tmp_path / "gone", 1, "output_dir"))
    # refused for another reason (a file, not a folder; no permission): no holder is claimed from an old lock file
    other = run_lock._verdict_elsewhere(tmp_path, 2, "output_dir")
    assert not isinstance(other, run_lock.InUse) and "cannot be used" in str(other) and "pid" not in str(other)


class _OneProcess:  # what run_lock.hold reads of an Accelerator or PartialState
    is_main_process, num_processes = True, 1


def test_a_failed_run_leaves_no_folder_holding_only_its_lock(tmp_path):
    from theworld.core import run_lock

    out = tmp_path / "new" / "run"
    with pytest.raises(RuntimeError, match="refused"):
        with run_lock.hold(out, _OneProcess()):
            (out / "sub").mkdir()
            raise RuntimeError("refused")
    assert not (tmp_path / "new").exists()  # the folders the run created go with their lock
    with pytest.raises(RuntimeError, match="crashed"):
        with run_lock.hold(out, _OneProcess()):
            (out / "sub").mkdir()
            (out / "sub" / "written").write_text("work")
            raise RuntimeError("crashed")
    assert (out / "sub" / "written").read_text() == "work"  # what a run wrote is never deleted
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(RuntimeError):
        with run_lock.hold(kept, _OneProcess()):
            raise RuntimeError("refused")
    assert kept.is_dir() and not any(kept.iterdir())  # a folder that was there stays, without the lock file


def test_run_lock_and_output_paths_of_the_wrong_kind_are_named(trained_run, tmp_path, capsys):
    for kind in ("fifo", "directory"):
        out = tmp_path / kind
        out.mkdir()
        os.mkfifo(out / ".run.lock") if kind == "fifo" else (out / ".run.lock").mkdir()
        assert train_inproc(base_args(trained_run["cache"], out, steps=1)) == 2
        line = one_error_line(capsys, ".run.lock", "run lock", "a FIFO" if kind == "fifo" else "a directory")
        assert "is a file, not a folder" not in line
    out = tmp_path / "wandb-file"
    out.mkdir()
    (out / "wandb").write_text("not a folder")
    args = base_args(trained_run["cache"], out, steps=1) + ["--set", "trackers=[wandb]"]
    pytest.importorskip("wandb")
    assert train_inproc(args) == 2
    one_error_line(capsys, str(out / "wandb"), "a regular file", "W&B")
