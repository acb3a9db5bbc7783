"""train.launch: accelerate launch whose exit status says how the run ended (143 / 130 after a stop, a process's own
code after its failure), and train.preempt taking a launcher's repeat of a signal as the same request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import (
    ENV,
    ROOT,
    base_args,
    free_port,
    launch2,
    slurm_job,
    still_running,
    wait_for_step,
)
from train import launch, preempt, slurm


class _Accelerator:
    device = "cpu"
    num_processes = 1


def test_a_repeat_of_the_signal_close_to_the_first_is_the_same_request(monkeypatch, capsys):
    stop = preempt.Preemption(_Accelerator()).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a launcher passing on what the process group already had
        assert stop.requested() and stop.exit_code == 143
        assert capsys.readouterr().err.count("SIGTERM received") == 1
        monkeypatch.setattr(preempt, "REPEAT_S", 0.0)  # asked again later: stop at once
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stop.restore()


def _ending(monkeypatch, capsys, error: BaseException | None) -> tuple[int, str]:
    def fake_launch(args):
        if error is not None:
            raise error

    import accelerate.commands.launch as accelerate_launch

    monkeypatch.setattr(accelerate_launch, "launch_command", fake_launch)
    handlers = {s: signal.getsignal(s) for s in launch.FORWARDED}
    try:
        code = launch.main(["-m", "train.loop", "--config", "x.yaml"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return code, capsys.readouterr().err


def _child_failed(exitcode: int):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    return ChildFailedError("train.loop", {1: ProcessFailure(local_rank=1, pid=4321, exitcode=exitcode, error_file="")})


def test_the_exit_status_says_how_the_run_ended(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    cases = [
        (None, 0, ""),
        (SignalException("got SIGTERM", signal.SIGTERM), 143, "the launcher stopped by SIGTERM; rerun the same"),
        (SignalException("got SIGINT", signal.SIGINT), 130, "the launcher stopped by SIGINT; rerun the same"),
        (_child_failed(2), 2, "process 1 exited with code 2 (its own lines above say why)"),
        (_child_failed(143), 143, "process 1 stopped by SIGTERM"),
        (_child_failed(-9), 137, "process 1 exited with code 137"),
        (subprocess.CalledProcessError(2, ["python"]), 2, "the process exited with code 2"),
        (subprocess.CalledProcessError(143, ["python"]), 143, "the process stopped by SIGTERM"),
    ]
    for error, code, words in cases:
        got, err = _ending(monkeypatch, capsys, error)
        assert got == code and words in err and err.count("\n") == (1 if words else 0), (error, got, err)


def _one_process(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "train.launch", "--num_processes", "1", "-m", "train.loop", *args],
        cwd=ROOT,
        env={**ENV, "ACCELERATE_USE_CPU": "true"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_a_user_error_under_the_launcher_is_the_processes_line_and_exit_2(cache, tmp_path):
    bad = base_args(cache, tmp_path / "run", **{"train.nonsense": 1})
    # both launches at once: each spends its time importing before it refuses
    procs = [_one_process(bad), launch2(bad, via="train.launch", stdout=subprocess.PIPE, stderr=subprocess.PIPE)]
    try:
        errs = [proc.communicate(timeout=300)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, err in zip(procs, errs):
        err = err if isinstance(err, str) else err.decode()
        assert proc.returncode == 2 and "Traceback" not in err and "train.nonsense" in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_to_every_process_of_the_run_saves_and_the_launcher_exits_143(cache, tmp_path, processes):
    """What a scheduler does at a time limit (Slurm signals every process of the job step; a Ctrl-C reaches the
    launcher's process group): the processes have the signal twice, once from the launcher passing it on, and still
    save first. On one process accelerate itself would not pass it on at all; there the run has loader workers and
    the signal goes to the whole process group (the launcher, the trainer, its workers): the workers do not die of it
    and the run's own shutdown ends them (train.preempt; tests/train/test_preempt.py sends train.loop alone the
    same). Torch's launcher starts each of two processes in a session of its own: each is signalled."""
    out = tmp_path / "run"
    workers = {"train.loader.num_workers": 2} if processes == 1 else {}
    args = base_args(cache, out, steps=40, **{"train.checkpoint.every": 100, **workers})
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "start_new_session": True}
    proc = _one_process(args) if processes == 1 else launch2(args, via="train.launch", **kw)
    try:
        wait_for_step(out, proc, 2)
        t0 = time.time()
        family = psutil.Process(proc.pid).children(recursive=True)
        if processes == 1:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            for p in [psutil.Process(proc.pid), *family]:
                p.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert "stopped by SIGTERM after step" in err and time.time() - t0 < 60
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and (ckpts[0] / "state.json").is_file()
    if processes == 1:
        assert len(family) >= 2, family  # the trainer and the loader's workers ran, in the group that got the signal
        assert "killed by signal" not in err and not (out / "final").exists(), err[-3000:]
        assert not still_running([p.pid for p in family], within=0.5)


def test_a_usage_mistake_is_one_line_and_exit_2(capsys):
    assert launch.main(["--num_processes", "two", "-m", "train.loop"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--num_processes" in err and "'two'" in err, err


_REFUSE_AFTER_A_GATHER = """
import atexit, sys
import torch.distributed as dist
from theworld.core.errors import UserError, cli_entry
from theworld.core.process_group import gather_ints, process_group

@cli_entry
def main(argv=None):
    state = process_group()
    seen = gather_ints(state, 1)
    atexit.register(lambda: print(f"group alive at exit: {dist.is_initialized()}", flush=True))
    raise UserError(f"process {state.process_index} refuses after a gather of {seen}")

sys.exit(main())
"""


def test_a_refusal_on_every_process_after_a_collective_ends_the_group_and_exits_2(tmp_path):
    """Two gloo processes on 127.0.0.1 (started by hand, not by a launcher, whose agent would stop the second after
    the first exits and report one code): a UserError after a collective is each one's line and exit 2, with the
    group destroyed before interpreter exit (cli_entry): a gloo group alive there aborted a node with 134 now and
    then, a race a test cannot force, so the test checks the group is gone."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _REFUSE_AFTER_A_GATHER],
            cwd=tmp_path,
            env={
                **ENV,
                "ACCELERATE_USE_CPU": "true",
                **{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
                **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        done = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (out, err) in enumerate(done):
        code = procs[r].returncode
        errors = [ln for ln in err.splitlines() if ln.startswith("error")]
        assert code == 2 and errors == [f"error: process {r} refuses after a gather of [1, 1]"], (code, err[-3000:])
        assert out.strip() == "group alive at exit: False", out


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        (["--main_process_port", "0"], None, "--main_process_port 0 is not a fixed port"),
        (["--num_machines", "2", "--machine_rank", "0", "--main_process_port", "0"], None, "rendezvous waits"),
        ([], "0", "MASTER_PORT=0 is not a fixed port"),
        ([], "41000x", "MASTER_PORT='41000x' is not a port"),
        ([], "4e4", "MASTER_PORT='4e4' is not a port"),
        ([], "65536", "MASTER_PORT=65536 is not a port"),
    ],
)
def test_a_port_the_nodes_cannot_meet_on_is_one_line_and_exit_2_before_anything_starts(
    monkeypatch, capsys, argv, env, words
):
    import accelerate.commands.launch as accelerate_launch

    started = []
    monkeypatch.setattr(accelerate_launch, "launch_command", started.append)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    if env is not None:
        monkeypatch.setenv("MASTER_PORT", env)
    assert launch.main([*argv, "-m", "train.loop"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err and not started, err


def _launched(monkeypatch, argv: list[str], env: dict) -> tuple[int, object]:
    """train.launch's exit code and the arguments it handed to accelerate's launcher (which is not run)."""
    import accelerate.commands.launch as accelerate_launch

    for k in [k for k in os.environ if k.startswith(("SLURM_", "MASTER_"))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = {}
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: seen.setdefault("args", args))
    handlers = {s: signal.getsignal(s) for s in launch.FORWARDED}
    try:
        return launch.main([*argv, "-m", "train.loop"]), seen.get("args")
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def test_train_launch_gives_each_node_its_place_from_slurm(monkeypatch, capsys):
    code, args = _launched(monkeypatch, [], slurm_job(SLURM_GPUS_ON_NODE="8"))
    assert code == 0 and (args.num_machines, args.machine_rank, args.num_processes) == (4, 2, 32)
    assert (args.main_process_ip, args.main_process_port, args.multi_gpu) == ("gpu07", slurm.PORT_BASE + 77, True)
    err = capsys.readouterr().err
    assert "launch: SLURM job 77: node 2 of 4, 8 process(es) per node, main process on gpu07:" in err
    # the command line wins over SLURM: one process per node asked for, FSDP instead of DDP
    code, args = _launched(monkeypatch, ["--num_processes", "4", "--use_fsdp"], slurm_job(SLURM_GPUS_ON_NODE="8"))
    assert code == 0 and args.num_processes == 4 and args.use_fsdp and not args.multi_gpu
    code, args = _launched(monkeypatch, [], {})  # not under SLURM: nothing added
    assert code == 0 and args.num_machines is None and args.machine_rank is None


def test_a_node_rank_outside_the_job_is_one_line_and_exit_2(monkeypatch, capsys):
    cases = [
        (["--num_machines", "2", "--machine_rank", "2"], {}, "--machine_rank 2 is outside the job's 2 node(s)"),
        (["--num_machines", "2", "--machine_rank", "-1"], {}, "--machine_rank -1 is outside"),
        (["--num_machines", "0", "--machine_rank", "0"], {}, "--num_machines 0: a run needs at least one node"),
        (["--num_machines", "2", "--num_processes", "3"], {}, "--num_processes 3 (the total over all nodes)"),
        ([], slurm_job(SLURM_NODEID="7"), "SLURM_NODEID 7 is outside the job's 4 node(s)"),
        (["--machine_rank", "5"], slurm_job(), "--machine_rank 5 is outside the job's 4 node(s)"),
    ]
    for argv, env, words in cases:
        code, args = _launched(monkeypatch, argv, env)
        err = capsys.readouterr().err
        assert code == 2 and args is None and err.count("\n") == 1 and words in err, (argv, err)
