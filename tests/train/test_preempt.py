"""train.preempt: a stop signal to the whole process group (SLURM signals every process of a job step; Ctrl-C
reaches the terminal's group) saves and exits 143 like one to the main process alone: the loader's workers do not
die of it, and their own shutdown still ends them."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import ENV, ROOT, base_args, wait_for_step
from train import preempt


def _worker(ready) -> None:
    preempt.ignore_in_workers()
    ready.set()
    while True:
        time.sleep(0.05)


def _dies_within(proc, seconds: float) -> bool:
    proc.join(timeout=seconds)
    return not proc.is_alive()


def test_a_worker_outlives_a_signal_from_outside_and_ends_on_its_parents():
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_worker, args=(ready,), daemon=True)
    proc.start()
    try:
        assert ready.wait(30)
        # from another process (a scheduler, a shell's kill): the main process got it too and decides
        outsider = subprocess.run(["kill", "-TERM", str(proc.pid)], check=False)
        assert outsider.returncode == 0
        subprocess.run(["kill", "-INT", str(proc.pid)], check=False)
        assert not _dies_within(proc, 1.0)
        proc.terminate()  # the parent's SIGTERM: the DataLoader's own shutdown, as torch's handler has it
        assert _dies_within(proc, 10.0) and proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def _group_stop(command: list[str], args: list[str], out) -> tuple[int, str, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", *command, *args],
        cwd=ROOT,
        env={**ENV, "ACCELERATE_USE_CPU": "true"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job step's
    )
    try:
        wait_for_step(out, proc, 2)
        workers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGTERM)  # every process of the group at once: launcher, trainer, workers
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err, workers


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [["train.loop"], ["train.launch", "--num_processes", "1", "-m", "train.loop"]], ids=["loop", "launch"]
)
def test_sigterm_to_the_whole_process_group_with_loader_workers_saves_and_exits_143(cache, tmp_path, command):
    out = tmp_path / "run"
    args = base_args(cache, out, steps=60, **{"train.loader.num_workers": 2, "train.checkpoint.every": 100})
    code, err, workers = _group_stop(command, args, out)
    assert len(workers) >= 2, workers  # the loader's workers were in the group that got the signal
    assert code == 143 and "killed by signal" not in err and "Traceback" not in err, err[-3000:]
    assert "stopped by SIGTERM after step" in err
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and (ckpts[0] / "state.json").is_file() and not (out / "final").exists()
    time.sleep(0.5)
    assert not [pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
