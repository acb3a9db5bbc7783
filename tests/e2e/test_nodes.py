"""Runs across nodes, two "nodes" on this machine (two launchers, 1 process each, gloo): training and precompute
equal one process; global rank 0 alone writes (node 1 gets its own output folder and working directory, which stay
empty); a node that does not see process 0's folder is refused; train.launch refuses a node rank outside the job and
fills a node's arguments from SLURM's environment; the sbatch example (scripts/slurm/train.sbatch) runs on two local
"nodes" through a stand-in srun, requeues a run stopped by SIGTERM to one node's launcher, and the requeued job ends
with the weights of one process."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import psutil
import pytest
import torch

from tests.conftest import ENV, ROOT, base_args, free_port, metrics, train_inproc, wait_for_step, weights
from theworld.core.errors import UserError
from train import launch, slurm

STEPS = 8


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in metrics(run_dir) if "loss" in m]


@pytest.fixture(scope="module")
def one_process(cache, tmp_path_factory):
    """The reference: the same run on one process."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert train_inproc(base_args(cache, out, steps=STEPS)) == 0
    return out


def assert_like_one_process(run_dir, one) -> None:
    w1, w2 = weights(one), weights(run_dir)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-5)
    assert losses(run_dir) == pytest.approx(losses(one), rel=1e-5)


def torchrun_node(rank: int, port: int, module: str, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-m",
        module,
        *args,
    ]


def accelerate_node(rank: int, port: int, module: str, args: list[str]) -> list[str]:
    """`accelerate launch` arguments for node `rank` of two, run through train.launch (CPU processes need
    --multi_gpu with ACCELERATE_USE_CPU=true)."""
    return [
        sys.executable,
        "-m",
        "train.launch",
        "--multi_gpu",
        "--num_machines",
        "2",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        module,
        *args,
    ]


def run_nodes(node_command, module: str, args_of, cwds) -> list[subprocess.CompletedProcess]:
    """Both nodes' launchers, each from its own working directory, to the end."""
    port = free_port()
    procs = [
        subprocess.Popen(
            node_command(r, port, module, args_of(r)),
            cwd=cwds[r],
            env={**ENV, "ACCELERATE_USE_CPU": "true"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def workdirs(tmp_path) -> list:
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for d in cwds:
        d.mkdir()
    return cwds


@pytest.mark.slow
def test_two_nodes_by_torchrun_train_as_one_process_and_only_global_rank_0_writes(cache, tmp_path, one_process):
    cwds = workdirs(tmp_path)
    outs = [tmp_path / "out0", tmp_path / "out1"]  # node 1's own folder: local rank 0 of a node must not write it
    runs = run_nodes(torchrun_node, "train.loop", lambda r: base_args(cache, outs[r], steps=STEPS), cwds)
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert_like_one_process(outs[0], one_process)
    assert (outs[0] / f"checkpoint-{STEPS}").is_dir() and json.loads(
        (outs[0] / f"checkpoint-{STEPS}" / "state.json").read_text()
    )["num_processes"] == 2
    assert not outs[1].exists() and not any(any(d.iterdir()) for d in cwds)
    # resumed, node 1 would see no checkpoint in its folder and start afresh beside node 0's resumed run
    more = lambda r: base_args(cache, outs[r], steps=STEPS + 2)
    again = run_nodes(torchrun_node, "train.loop", more, cwds)
    line = f"process 0 sees checkpoint-{STEPS} there but process 1 sees no checkpoint: every node must see the same"
    for r in again:
        assert r.returncode != 0 and line in r.stderr and "Traceback" not in r.stderr.split(line)[0][-300:], r.stderr
    assert len(losses(outs[0])) == STEPS and not outs[1].exists()


@pytest.mark.slow
def test_two_nodes_precompute_the_cache_of_one_process(cache, tmp_path):
    """Through accelerate launch (train.launch); every process writes its shards into output_dir, so a node with a
    folder of its own is refused before any model loads, and a shared one gets the 1-process cache's bytes."""
    cwds = workdirs(tmp_path)
    sets = ["source.num_samples=96", "shard_size=32", "batch_size=32", "num_workers=0", "cache.flip=true"]
    sets.append("cache.siglip=false")  # the `cache` fixture's settings

    def args(out):
        return ["--config", str(ROOT / "configs" / "precompute.yaml"), "--set", f"output_dir={out}"] + [
            a for s in sets for a in ("--set", s)
        ]

    apart = [tmp_path / "c0", tmp_path / "c1"]
    runs = run_nodes(accelerate_node, "precompute.cosmos_latents", lambda r: args(apart[r]), cwds)
    line = "process 1 does not see what process 0 wrote in"
    for r in runs:
        assert r.returncode == 2 and line in r.stderr and "every node must use the same output_dir" in r.stderr, (
            r.stderr[-3000:]
        )
    assert not apart[1].exists() and not apart[0].exists()  # the folder process 0 created for the run goes with it
    shared = tmp_path / "shared"
    runs = run_nodes(accelerate_node, "precompute.cosmos_latents", lambda r: args(shared), cwds)
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert "on 2 process(es)" in runs[0].stdout + runs[0].stderr
    m1 = json.loads((cache / "manifest.json").read_text())
    m2 = json.loads((shared / "manifest.json").read_text())
    assert m2["num_samples"] == 96 and m2["shard_index"] == m1["shard_index"]
    assert not any(any(d.iterdir()) for d in cwds)


# ----------------------------------------------------------------------------------------------------------------------
# SLURM


def _stand_ins(tmp_path) -> tuple[dict, os.PathLike]:
    """srun (tests/_fake_srun.py) and an scontrol that records its arguments, first on PATH; the job's variables
    for two nodes on this machine (the node list's first host expands to 127.0.0.1)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    scripts = {
        "srun": f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "tests" / "_fake_srun.py"}" "$@"\n',
        "scontrol": f'#!/bin/sh\necho "$@" >> "{log}"\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {
        **ENV,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "ACCELERATE_USE_CPU": "true",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "MASTER_PORT": str(free_port()),
    }
    return env, log


def _launcher_of_node(proc: subprocess.Popen, node: str) -> psutil.Process:
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "train.launch" in p.cmdline() and p.environ().get("SLURM_NODEID") == node:
                return p
        except psutil.NoSuchProcess:
            pass
    raise AssertionError(f"no launcher of node {node}")


@pytest.mark.slow
def test_the_sbatch_example_requeues_a_run_stopped_on_one_node_and_the_requeued_job_ends_as_one_process(
    cache, tmp_path, one_process
):
    env, log = _stand_ins(tmp_path)
    out = tmp_path / "run"
    cmd = ["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), *base_args(cache, out, steps=STEPS)]
    kw = {"env": env, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    job = subprocess.Popen(cmd, start_new_session=True, **kw)
    try:
        wait_for_step(out, job, 1)
        _launcher_of_node(job, "0").send_signal(signal.SIGTERM)  # node 0's launcher only
        _, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 143, err[-3000:]
    assert "launch: SLURM job 4242: node 0 of 2, 1 process(es) per node, main process on 127.0.0.1:" in err
    assert "srun: task 0 exited with code 143" in err and "srun: task 1 exited with code 143" in err
    assert "launch: the launcher stopped by SIGTERM" in err and "launch: process 1 stopped by SIGTERM" in err
    assert log.read_text() == "requeue 4242\n"
    ckpts = list(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and int(ckpts[0].name.split("-")[1]) < STEPS and not (out / "final").exists()
    requeued = subprocess.run(cmd, timeout=300, **kw)
    assert requeued.returncode == 0 and f"resumed from {ckpts[0]}" in requeued.stderr, requeued.stderr[-3000:]
    assert log.read_text() == "requeue 4242\n"
    assert_like_one_process(out, one_process)


def test_slurm_node_lists_expand_as_slurm_writes_them():
    expand = lambda s: list(slurm.expand_nodelist(s))
    assert expand("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand("a[1-2]-ib[0-1],login,x[9-11]") == [
        *("a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1", "login", "x9", "x10", "x11")
    ]
    assert slurm.first_host("gpu[0001-9999999999999]") == "gpu0001"  # never the whole list
    for bad, words in [
        ("n[1-", "unbalanced"),
        ("n]1[", "unbalanced"),
        ("n[a]", "'a' is not a number"),
        ("n[3-1]", "runs backwards"),
        (",", "names no host"),
    ]:
        with pytest.raises(UserError, match=words):
            slurm.first_host(bad)


def _job(**extra) -> dict:
    return {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[07-10]"} | extra


def test_a_nodes_place_in_the_slurm_job_comes_from_its_environment():
    assert slurm.from_env({"PATH": "/bin"}) is None  # not under SLURM
    node = slurm.from_env(_job(SLURM_GPUS_ON_NODE="8"))
    assert (node.nodes, node.node, node.host, node.per_node) == (4, 2, "gpu07", 8)
    assert node.port == slurm.PORT_BASE + 77  # two jobs on one node listen on different ports
    node = slurm.from_env(_job(SLURM_NNODES="", SLURM_JOB_NUM_NODES="4", MASTER_ADDR="10.0.0.1", MASTER_PORT="1234"))
    assert (node.nodes, node.host, node.port) == (4, "10.0.0.1", 1234)
    with pytest.raises(UserError, match="SLURM_NODEID 4 is outside the job's 4 node"):
        slurm.from_env(_job(SLURM_NODEID="4"))
    with pytest.raises(UserError, match="SLURM runs 2 tasks on this node"):
        slurm.from_env(_job(SLURM_STEP_TASKS_PER_NODE="2(x4)"))
    with pytest.raises(UserError, match="run one per node"):
        slurm.from_env(_job(SLURM_LOCALID="1"))
    with pytest.raises(UserError, match="SLURM_NODEID 0 is outside the job's 0 node"):
        slurm.from_env(_job(SLURM_NNODES="0", SLURM_NODEID="0"))
    with pytest.raises(UserError, match="SLURM_NNODES='two' is not a number"):
        slurm.from_env(_job(SLURM_NNODES="two"))
    with pytest.raises(UserError, match="MASTER_PORT=70000 is not a port"):
        slurm.from_env(_job(MASTER_PORT="70000"))


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
    code, args = _launched(monkeypatch, [], _job(SLURM_GPUS_ON_NODE="8"))
    assert code == 0 and (args.num_machines, args.machine_rank, args.num_processes) == (4, 2, 32)
    assert (args.main_process_ip, args.main_process_port, args.multi_gpu) == ("gpu07", slurm.PORT_BASE + 77, True)
    err = capsys.readouterr().err
    assert "launch: SLURM job 77: node 2 of 4, 8 process(es) per node, main process on gpu07:" in err
    # the command line wins over SLURM: one process per node asked for, FSDP instead of DDP
    code, args = _launched(monkeypatch, ["--num_processes", "4", "--use_fsdp"], _job(SLURM_GPUS_ON_NODE="8"))
    assert code == 0 and args.num_processes == 4 and args.use_fsdp and not args.multi_gpu
    code, args = _launched(monkeypatch, [], {})  # not under SLURM: nothing added
    assert code == 0 and args.num_machines is None and args.machine_rank is None


def test_a_node_rank_outside_the_job_is_one_line_and_exit_2(monkeypatch, capsys):
    cases = [
        (["--num_machines", "2", "--machine_rank", "2"], {}, "--machine_rank 2 is outside the job's 2 node(s)"),
        (["--num_machines", "2", "--machine_rank", "-1"], {}, "--machine_rank -1 is outside"),
        (["--num_machines", "0", "--machine_rank", "0"], {}, "--num_machines 0: a run needs at least one node"),
        (["--num_machines", "2", "--num_processes", "3"], {}, "--num_processes 3 (the total over all nodes)"),
        ([], _job(SLURM_NODEID="7"), "SLURM_NODEID 7 is outside the job's 4 node(s)"),
        (["--machine_rank", "5"], _job(), "--machine_rank 5 is outside the job's 4 node(s)"),
    ]
    for argv, env, words in cases:
        code, args = _launched(monkeypatch, argv, env)
        err = capsys.readouterr().err
        assert code == 2 and args is None and err.count("\n") == 1 and words in err, (argv, err)
