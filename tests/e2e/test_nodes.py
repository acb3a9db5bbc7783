"""Runs across nodes, two "nodes" on this machine (two launchers, 1 process each, gloo): training and precompute
equal one process; global rank 0 alone writes (node 1 gets its own output folder and working directory, which stay
empty); a node that does not see process 0's folder is refused (each node's process forked with the environment of a
two-node launch: the refusal is the command's); train.launch refuses a node rank outside the job and
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

STEPS = 4  # the sbatch test stops the run after step 1: it saves after step 2 (or 3), before the end


def run_args(cache, out, steps: int = STEPS) -> list[str]:
    """conftest's small run; its final eval samples no caption (weights, losses and files are what is compared)."""
    return base_args(cache, out, steps=steps, **{"train.eval.captions": 0})


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in metrics(run_dir) if "loss" in m]


@pytest.fixture(scope="module")
def one_process(cache, tmp_path_factory):
    """The reference: the same run on one process."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert train_inproc(run_args(cache, out)) == 0
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


def fork_nodes(module: str, args_of, cwds) -> list[subprocess.CompletedProcess]:
    """Both nodes' one process each, forked with the environment a two-node launch gives it (tools/ranks.py), each
    from its own working directory: for a refusal that is the command's, not the launcher's."""
    from tools import ranks

    return ranks.run_nodes(module, args_of, {**ENV, "ACCELERATE_USE_CPU": "true"}, cwds, free_port())


def workdirs(tmp_path) -> list:
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for d in cwds:
        d.mkdir()
    return cwds


@pytest.mark.slow
def test_two_nodes_by_torchrun_train_as_one_process_and_only_global_rank_0_writes(cache, tmp_path, one_process):
    cwds = workdirs(tmp_path)
    outs = [tmp_path / "out0", tmp_path / "out1"]  # node 1's own folder: local rank 0 of a node must not write it
    runs = run_nodes(torchrun_node, "train.loop", lambda r: run_args(cache, outs[r]), cwds)
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert_like_one_process(outs[0], one_process)
    assert (outs[0] / f"checkpoint-{STEPS}").is_dir() and json.loads(
        (outs[0] / f"checkpoint-{STEPS}" / "state.json").read_text()
    )["num_processes"] == 2
    assert not outs[1].exists() and not any(any(d.iterdir()) for d in cwds)
    # resumed, node 1 would see no checkpoint in its folder and start afresh beside node 0's resumed run
    more = lambda r: run_args(cache, outs[r], steps=STEPS + 2)
    again = fork_nodes("train.loop", more, cwds)
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
    runs = fork_nodes("precompute.cosmos_latents", lambda r: args(apart[r]), cwds)
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
    cmd = ["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), *run_args(cache, out)]
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
