"""tools/ranks.py: two forked ranks form one gloo group with the launcher's environment, keep their own output in
rank order, and report the first failing exit status, a peer left waiting being cut after the grace period."""

from __future__ import annotations

import time

import psutil

from tests.conftest import ENV, free_port
from tools import ranks


def test_two_ranks_join_one_group_with_the_launchers_environment(tmp_path):
    done = ranks.run("tests._rank_probe", ["a", "b"], {**ENV, "PROBE_NOTE": "given"}, tmp_path, free_port())
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"rank {r} of 2 sum 1 note given cwd {tmp_path}" for r in (0, 1)]
    assert done.stderr.splitlines() == [f"rank {r} threads 1 argv ['a', 'b']" for r in (0, 1)]


def test_a_failing_rank_is_the_exit_status_and_its_waiting_peer_is_cut_after_the_grace(tmp_path):
    t0 = time.time()
    done = ranks.run("tests._rank_probe", ["fail-1", "hang-0"], dict(ENV), tmp_path, free_port(), grace=1)
    assert done.returncode == 3 and "error: rank 1 refuses" in done.stderr
    assert time.time() - t0 < 60  # not the 600 s the hanging rank sleeps


def test_launcher_env_is_what_accelerates_launch_sets_per_rank():
    env = ranks.launcher_env(1, 1234)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "1", "2", "1234")
    assert env["ACCELERATE_MIXED_PRECISION"] == "no" and env["OMP_NUM_THREADS"] == "1"
    node = ranks.launcher_env(1, 1234, nodes=2)  # torchrun --nnodes 2 --nproc-per-node 1: node 1's one process
    assert [node[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")] == [
        "1",
        "0",
        "1",
        "1",
        "2",
    ]


def test_a_launched_job_is_polled_and_killed_as_one_with_the_processes_its_ranks_started(tmp_path):
    job = ranks.launch("tests._rank_probe", ["hang-0", "child"], dict(ENV), tmp_path, free_port(), tmp_path)
    deadline = time.time() + 60
    while len(children := _children(tmp_path)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert len(children) == 2 and job.poll() is None  # rank 0 sleeps, rank 1 waits for it in the group
    family = [psutil.Process(p.pid) for p in job.procs] + [psutil.Process(pid) for pid in children]
    job.kill()
    assert job.poll() == -9 and job.wait(timeout=1) == -9
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _children(logs) -> list[int]:
    lines = "".join(p.read_text() for p in logs.glob("*.out") if p.is_file()).splitlines()
    return [int(line.split()[-1]) for line in lines if " child " in line]
