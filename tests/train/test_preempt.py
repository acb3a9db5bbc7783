"""train.preempt: a stop signal to the whole process group (SLURM signals every process of a job step; Ctrl-C
reaches the terminal's group) saves and exits 143 like one to the main process alone: the loader's workers do not
die of it, and their own shutdown still ends them."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    ENV,
    ROOT,
    base_args,
    final_bytes,
    fork2,
    last_logged_step,
    launch2,
    metrics,
    one_error_line,
    still_running,
    train_inproc,
    wait_for_step,
)
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


def _group_stop(args: list[str], out) -> tuple[int, str, list[int]]:
    """train.loop in a new interpreter, as a job step's (its exit ends the loader's workers through its own shutdown,
    which a process forked by multiprocessing skips)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.loop", *args],
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
        # every process of the group at once: the trainer and its workers
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err, workers


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_with_loader_workers_saves_and_exits_143(cache, tmp_path):
    """train.loop alone; the same under train.launch (the launcher, the trainer and its workers in the group) is
    tests/train/test_launch.py's one-process case of test_sigterm_to_every_process_of_the_run_saves_and_the_launcher_
    exits_143, one launch for both checks."""
    out = tmp_path / "run"
    args = base_args(cache, out, steps=60, **{"train.loader.num_workers": 2, "train.checkpoint.every": 100})
    code, err, workers = _group_stop(args, out)
    assert len(workers) >= 2, workers  # the loader's workers ran, in the group that got the signal
    assert code == 143 and "killed by signal" not in err and "Traceback" not in err, err[-3000:]
    assert "stopped by SIGTERM after step" in err
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and (ckpts[0] / "state.json").is_file() and not (out / "final").exists()
    assert not still_running(workers, within=0.5)


def _interrupt(args: list[str], out: Path, at_step: int, sig: int, capsys) -> tuple[int, str]:
    """The run in this process, sent `sig` by a watching thread once it has logged step `at_step` (a signal from
    outside: train.preempt's handler runs between two bytecodes of the training loop, as in a process of its own).
    A no-op handler stands around the run, so a signal that came after it ended would be harmless."""
    import threading

    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if last_logged_step(out) >= at_step:
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.02)

    capsys.readouterr()
    previous = signal.signal(sig, lambda *_: None)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code = train_inproc(args)
    finally:
        done.set()
        watcher.join()
        signal.signal(sig, previous)
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_and_sigint_save_and_the_resumed_run_is_bitwise_equal(cache, tmp_path, capsys):
    """The uninterrupted reference, the two stopped runs and the last resume run in this process (one thread)."""
    extra = {
        "train.checkpoint.every": 100,
        "world.latent": "sample",
        "train.optimizer.ema": 0.9,
        "train.loader.num_workers": 1,
        "train.hardware.cpu_threads": 1,
    }
    steps = 10  # room for two stops: each lands within a step of the step it waits for
    assert train_inproc(base_args(cache, tmp_path / "ref", steps, **extra)) == 0
    out = tmp_path / "run"
    args = base_args(cache, out, steps, **extra)
    code, err = _interrupt(args, out, 2, signal.SIGTERM, capsys)
    assert code == 143, err[-3000:]
    first = sorted(out.glob("checkpoint-*"))
    assert len(first) == 1 and 2 <= int(first[0].name.split("-")[1]) < steps, first
    assert f"checkpoint {out}/{first[0].name}" in err and "rerun the same command" in err
    assert "Traceback" not in err and not (out / "final").exists()
    code, err = _interrupt(args, out, int(first[0].name.split("-")[1]) + 2, signal.SIGINT, capsys)
    assert code == 130, err[-3000:]
    assert "resumed from" in err and "SIGINT" in err and "Traceback" not in err
    second = sorted(out.glob("checkpoint-*"))[-1]
    assert int(second.name.split("-")[1]) < steps and not (out / "final").exists(), second
    capsys.readouterr()
    assert train_inproc(args) == 0
    assert f"resumed from {second}" in capsys.readouterr().err
    assert final_bytes(out) == final_bytes(tmp_path / "ref")
    assert (out / "final" / "ema.safetensors").read_bytes() == (
        tmp_path / "ref" / "final" / "ema.safetensors"
    ).read_bytes()
    assert [m["loss"] for m in metrics(out) if "loss" in m] == [
        m["loss"] for m in metrics(tmp_path / "ref") if "loss" in m
    ]


@pytest.mark.slow
def test_a_signal_to_one_of_two_processes_stops_both_after_the_same_step_with_a_checkpoint(cache, tmp_path, capsys):
    """The two ranks forked as a launch starts them (the ranks' agreement is the point, not the launcher)."""
    out = tmp_path / "run"
    args = base_args(cache, out, steps=40, **{"train.checkpoint.every": 100})
    job = fork2(args, tmp_path / "logs")
    try:
        wait_for_step(out, job, 2)
        os.kill(job.procs[1].pid, signal.SIGTERM)  # one rank only: the other learns it from the all-reduce
        code = job.wait(timeout=240)  # no hang
    finally:
        if job.poll() is None:
            job.kill()
    err = "".join(Path(e).read_text() for _, e in job.files)
    assert code != 0 and "stopped by SIGTERM after step" in err, err[-3000:]
    assert all(p.exitcode == 143 for p in job.procs), [p.exitcode for p in job.procs]
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and not (out / "final").exists()
    assert (
        train_inproc(
            base_args(cache, out, steps=int(ckpts[0].name.split("-")[1]) + 1, **{"train.checkpoint.every": 100})
        )
        == 0
    )
    assert "resumed from" in capsys.readouterr().err


def _slow_eval_with_signal(monkeypatch, at_step: int, sig=signal.SIGTERM, per_batch: float = 0.5) -> dict:
    """The eval at step `at_step` takes `per_batch` s a batch, and `sig` arrives 0.3 s into it. Returns its batches
    run, when the signal was sent and when the eval gave up (seconds since the epoch)."""
    import threading

    from train import trainer as loop
    from train.eval import heldout

    seen = {}
    real = heldout.evaluate

    def slow(components, loader):
        if loop_state["state"].step != at_step:
            return real(components, loader)

        def batches():
            for b in loader:
                seen["batches"] = seen.get("batches", 0) + 1
                time.sleep(per_batch)
                yield b

        class Slow:
            def __iter__(self):
                return batches()

            def __len__(self):
                return len(loader)

        threading.Timer(0.3, lambda: (seen.setdefault("sent", time.time()), os.kill(os.getpid(), sig))).start()
        try:
            return real(components, Slow())
        finally:
            seen["left"] = time.time()

    loop_state = {}
    real_restore = loop.checkpoint.restore

    def restore(*a, **k):
        loop_state["state"] = real_restore(*a, **k)
        return loop_state["state"]

    monkeypatch.setattr(loop.checkpoint, "restore", restore)
    monkeypatch.setattr(heldout, "evaluate", slow)
    return seen


def test_a_stop_during_a_long_eval_cuts_it_and_saves_at_once(cache, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    extra = {"train.eval.every": 2, "train.checkpoint.every": 100, "train.eval.samples": 32, "train.eval.batch_size": 2}
    seen = _slow_eval_with_signal(monkeypatch, at_step=2)  # 16 batches: 8 s of eval
    assert train_inproc(base_args(cache, out, steps=6, **extra)) == 143
    err = capsys.readouterr().err
    assert seen["left"] - seen["sent"] < 2 and seen["batches"] < 6, seen
    assert "SIGTERM during the eval at step 2: eval cut short and not logged" in err and "Traceback" not in err
    assert "stopped by SIGTERM after step 2" in err
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"] and not (out / "final").exists()
    assert not [m for m in metrics(out) if "eval_loss" in m and m["step"] == 2]
    # a stop in the eval before the first step: nothing to save, nothing lost
    seen = _slow_eval_with_signal(monkeypatch, at_step=0, sig=signal.SIGINT)
    assert train_inproc(base_args(cache, tmp_path / "fresh", steps=6, **extra)) == 130
    assert "stopped by SIGINT before the first step: nothing to save" in capsys.readouterr().err
    assert not list((tmp_path / "fresh").glob("checkpoint-*"))


def test_the_last_eval_comes_after_the_checkpoint_and_final_so_neither_a_stop_nor_a_failure_loses_them(
    cache, tmp_path, capsys, monkeypatch
):
    from theworld.core.errors import UserError
    from train.eval import heldout

    real = heldout.evaluate  # before _slow_eval_with_signal wraps it

    out = tmp_path / "run"
    extra = {"train.checkpoint.every": 100, "train.eval.samples": 32, "train.eval.batch_size": 2}
    _slow_eval_with_signal(monkeypatch, at_step=4)
    assert train_inproc(base_args(cache, out, steps=4, **extra)) == 143
    assert "eval at step 4: eval cut short" in capsys.readouterr().err
    assert (out / "checkpoint-4").is_dir() and (out / "final" / "trainable.safetensors").is_file()
    weights = final_bytes(out)
    assert "final eval loss n/a" in (out / "final" / "README.md").read_text()
    # the last eval fails (a benchmark that cannot be scored): one line, exit 2, both saves kept
    ref = tmp_path / "ref"
    monkeypatch.setattr(heldout, "evaluate", lambda *a: (_ for _ in ()).throw(UserError("no memory for item 7")))
    assert train_inproc(base_args(cache, ref, steps=4, **extra)) == 2
    one_error_line(
        capsys, "the eval after the last step failed", "no memory for item 7", "checkpoint-4 and final/ are saved"
    )
    assert (ref / "checkpoint-4").is_dir() and final_bytes(ref) == weights
    # the rerun repeats only the eval, and the checkpoint and the card record it
    monkeypatch.setattr(heldout, "evaluate", real)
    assert train_inproc(base_args(cache, out, steps=4, **extra)) == 0
    assert final_bytes(out) == weights
    last = [m for m in metrics(out) if "eval_loss" in m]
    assert [m["step"] for m in last] == [4]
    assert json.loads((out / "checkpoint-4" / "state.json").read_text())["last_eval"]["step"] == 4
    assert f"final eval loss {last[0]['eval_loss']:.4f}" in (out / "final" / "README.md").read_text()
    from theworld.model.stage_layout import verify

    verify(out / "final"), verify(out / "checkpoint-4")  # the records follow the rewritten files
    capsys.readouterr()
    assert train_inproc(base_args(cache, out, steps=4, **extra)) == 0  # resumable as it is: the seal holds
    assert [m["step"] for m in metrics(out) if "eval_loss" in m] == [4]


@pytest.mark.slow
def test_sigterm_to_a_two_process_launch_during_a_long_last_eval_ends_well_within_the_grace_period(cache, tmp_path):
    from theworld.infer import benchmark_items

    data = tmp_path / "bench" / "big.jsonl"
    data.parent.mkdir()
    # ~12 s of scoring on each process (~30 ms an item on the 2-core VM, unloaded), against a signal 1 s into it
    benchmark_items.make_synthetic(data, 800, seed=1)
    out = tmp_path / "run"
    args = base_args(cache, out, steps=2, **{"train.checkpoint.every": 100, "train.eval.benchmarks": f"[{data}]"})
    launcher = launch2(args, via="train.launch", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (out / "final" / "sha256.json").is_file() and launcher.poll() is None and time.time() < deadline:
            time.sleep(0.1)  # final/ is written before the last eval starts
        assert (out / "final" / "sha256.json").is_file(), launcher.poll()
        time.sleep(1)  # into the benchmark
        t0 = time.time()
        launcher.send_signal(signal.SIGTERM)  # torch elastic forwards it, and SIGKILLs what is left 30 s later
        _, err = launcher.communicate(timeout=120)
        took = time.time() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert took < 20, (took, err[-3000:])
    assert launcher.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert err.rstrip().endswith("launch: the launcher stopped by SIGTERM; rerun the same command to resume")
    assert "SIGTERM during the eval at step 2: eval cut short" in err, err[-3000:]
    assert (out / "checkpoint-2").is_dir() and (out / "final" / "trainable.safetensors").is_file()
    assert not [m for m in metrics(out) if "bench/big/accuracy" in m]
