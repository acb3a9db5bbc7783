"""tools/ranks.py: two forked ranks form one gloo group with the launcher's environment, keep their own output in
rank order, and report the first failing exit status, a peer left waiting being cut after the grace period."""

from __future__ import annotations

import time

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
