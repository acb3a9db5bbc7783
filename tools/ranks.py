"""Two-process CPU runs for benchmarks and tests, each rank forked from a server process that imported the commands
once.

Each rank is a process of its own with the environment `accelerate launch --multi_gpu --num_processes 2` gives it
(RANK, WORLD_SIZE, MASTER_ADDR/PORT, ACCELERATE_*), its own stdout and stderr, its exit status, and one gloo group
with its peer; what it does not pay is the launcher's and each rank's imports (~26 s of CPU a launch on the 2-core
VM). The server is multiprocessing's forkserver, started once per process that calls `run`, with PRELOAD imported: a
rank is a fork of a process that has run nothing. `launch` returns the ranks as one `Job` that a test polls and kills
with kill -9 (every rank and its loader workers). Where the launcher itself is the point (its exit status, a signal
it forwards, its output), tests start a real launch (tests/conftest.py `launch2`).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the commands, and the VAE class every run of them loads (diffusers imports it lazily, 2 s of CPU a process)
PRELOAD = ["tools.ranks", "train.loop", "precompute.cosmos_latents", "diffusers.models.autoencoders.autoencoder_kl_wan"]
RANKS = 2
GRACE_S = 30  # after one rank fails, the other's wait for its peer ends in an error or is cut here


def launcher_env(rank: int, port: int, nodes: int = 1) -> dict[str, str]:
    """What accelerate's multi-process launch (through torch.distributed.run) sets for `rank` of RANKS on `nodes`
    machines (RANKS // nodes processes each), less torchelastic's agent bookkeeping (its store, its error file): here
    rank 0 hosts the group's store."""
    per_node = RANKS // nodes
    return {
        "ACCELERATE_DYNAMO_BACKEND": "NO",
        "ACCELERATE_DYNAMO_MODE": "default",
        "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
        "ACCELERATE_MIXED_PRECISION": "no",
        "GROUP_RANK": str(rank // per_node),
        "GROUP_WORLD_SIZE": str(nodes),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "RANK": str(rank),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(RANKS),
        "WORLD_SIZE": str(RANKS),
    }


def _rank(module: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked process (a rank, or a command alone): `env` as its whole environment, its output to files, then
    `python -m module args`."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # as the interpreter the launcher starts reads it
    mod = importlib.import_module(module)
    sys.argv = [mod.__file__, *args]
    sys.exit(mod.main(args))


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: once per process that starts forks
    return ctx


def run(
    module: str,
    args: list[str],
    env: dict[str, str],
    cwd: Path,
    port: int,
    timeout: float = 600,
    grace: float = GRACE_S,
) -> subprocess.CompletedProcess:
    """`python -m module args` (its `main(args)`) on RANKS forked ranks to their end: a CompletedProcess whose
    returncode is the first non-zero exit status (0 when every rank succeeds) and whose stdout and stderr are the
    ranks' in rank order. `env`: each rank's whole environment, to which the launcher's is added."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        job = launch(module, args, env, cwd, port, Path(tmp))
        code = _wait(job, timeout, grace)
        out, err = ("".join(Path(f[k]).read_text(errors="replace") for f in job.files) for k in (0, 1))
    return subprocess.CompletedProcess([module, *args], code, out, err)


def run_nodes(
    module: str, args_of, env: dict[str, str], cwds: list[Path], port: int, timeout: float = 600
) -> list[subprocess.CompletedProcess]:
    """`python -m module args_of(r)` as rank r of RANKS, one on each of RANKS "nodes" (the environment a launcher with
    --nnodes RANKS gives it), each in its own working directory `cwds[r]`, to their end: each rank's exit status
    and output."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        files = [(f"{tmp}/{r}.out", f"{tmp}/{r}.err") for r in range(RANKS)]
        envs = [{**env, **launcher_env(r, port, nodes=RANKS)} for r in range(RANKS)]
        job = Job([start(module, args_of(r), envs[r], cwds[r], *files[r]) for r in range(RANKS)], files)
        _wait(job, timeout, GRACE_S)
        texts = [[Path(f).read_text(errors="replace") for f in pair] for pair in files]
    return [subprocess.CompletedProcess([module], p.exitcode, *t) for p, t in zip(job.procs, texts)]


class Job:
    """RANKS ranks started by `launch`, polled, waited for and killed as one, as a launcher's process would be."""

    def __init__(self, procs: list, files: list[tuple[str, str]]):
        self.procs, self.files = procs, files

    def poll(self) -> int | None:
        """None while any rank runs; then the first non-zero exit status, or 0."""
        if any(p.exitcode is None for p in self.procs):
            return None
        return next((p.exitcode for p in self.procs if p.exitcode), 0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        for p in self.procs:
            p.join(None if deadline is None else max(0.0, deadline - time.time()))
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"ranks {[p.pid for p in self.procs]}", timeout)
        return self.poll()

    def kill(self) -> None:
        """kill -9 every rank and every process it started (its loader workers), and wait until they are gone."""
        import psutil

        family = []
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank = psutil.Process(p.pid)
                family += [rank, *rank.children(recursive=True)]
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(family, timeout=60)
        if alive:
            raise RuntimeError(f"still running a minute after kill -9: {alive}")
        for p in self.procs:
            p.join()


def launch(module: str, args: list[str], env: dict[str, str], cwd: Path, port: int, logs: Path) -> Job:
    """Start `python -m module args` on RANKS forked ranks and return at once; rank r's stdout and stderr go to the
    files r.out and r.err in `logs`."""
    files = [(str(logs / f"{r}.out"), str(logs / f"{r}.err")) for r in range(RANKS)]
    return Job([start(module, args, {**env, **launcher_env(r, port)}, cwd, *files[r]) for r in range(RANKS)], files)


def call(module: str, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """`python -m module args` as one forked process to its end: a CompletedProcess with its exit status and its
    stdout and stderr as text. OMP_NUM_THREADS, where `env` has none, is this process's torch thread count, as a new
    interpreter on this machine would take it."""
    import torch

    env = {"OMP_NUM_THREADS": str(torch.get_num_threads()), **env}
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        process = start(module, args, env, cwd, f"{tmp}/out", f"{tmp}/err")
        process.join()
        out, err = (Path(f"{tmp}/{name}").read_text(errors="replace") for name in ("out", "err"))
    return subprocess.CompletedProcess([module, *args], process.exitcode, out, err)


def start(module: str, args: list[str], env: dict[str, str], cwd: Path, out: str, err: str):
    """`python -m module args` as one process forked from the server, with the environment `env` alone, in `cwd`,
    its stdout and stderr going to the files `out` and `err`: a started multiprocessing.Process."""
    process = _context().Process(target=_rank, args=(module, args, env, str(cwd), out, err))
    process.start()
    return process


def _wait(job: Job, timeout: float, grace: float) -> int:
    """Wait for every rank; once one fails the others get `grace` seconds, then (or at `timeout`) are killed."""
    procs, deadline, code = job.procs, time.time() + timeout, 0
    while any(p.is_alive() for p in procs):
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed and not code:
            code, deadline = failed[0], min(deadline, time.time() + grace)
        if time.time() > deadline:
            for p in procs:
                if p.is_alive():
                    p.kill()
            code = code or -9
        time.sleep(0.02)
    for p in procs:
        p.join()
    return code or job.poll()
