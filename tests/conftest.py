"""Shared test set-up: no network, tiny models built once per checkout, a fake VAE on request, two-process launches,
training runs on a small synthetic cache (the `cache` fixture, `base_args`, in-process and subprocess runs)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("THEWORLD_MODELS", str(ROOT / "cache" / "models"))  # built once, reused by every test
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(ROOT))
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # what every subprocess a test starts gets


@pytest.fixture(autouse=True)
def one_thread_per_worker():
    """Under pytest-xdist (pyproject.toml's addopts: two workers) each worker computes on one thread: two workers of
    two OpenMP threads each on a 2-core machine spin against each other. Per test, as an in-process run's
    train.cpu_threads sets the count for the rest of the process."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def pil_strict_after():
    """lmms_eval.api.task sets PIL's ImageFile.LOAD_TRUNCATED_IMAGES = True when imported
    (tests/theworld/test_lmms_adapter.py,
    test_scoring.py's lmms_eval.tasks import): PIL's default (False) again after every test, so whatever order an
    xdist worker runs the files in, later tests still see truncated images refused."""
    yield
    from PIL import ImageFile

    ImageFile.LOAD_TRUNCATED_IMAGES = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_process_command(module: str, *args: str, via: str = "accelerate.commands.launch") -> list[str]:
    """`python -m MODULE ARGS` as two real CPU processes (gloo) through this interpreter's accelerate (or `via`, a
    module taking accelerate launch's arguments: train.launch), on a free port; run it with ACCELERATE_USE_CPU=true
    (`accelerate launch --cpu --num_processes 2` silently runs one)."""
    return [
        sys.executable,
        "-m",
        via,
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        "-m",
        module,
        *args,
    ]


def launch2(
    args: list[str],
    env: dict | None = None,
    module: str = "train.loop",
    via: str = "accelerate.commands.launch",
    **popen,
) -> subprocess.Popen:
    """Start `module` (a training run by default) on two processes; `popen` goes to subprocess.Popen."""
    return subprocess.Popen(
        two_process_command(module, *args, via=via),
        cwd=ROOT,
        env=_cpu_env(env),
        **popen,
    )


def run2(args: list[str], env: dict | None = None, module: str = "train.loop") -> subprocess.CompletedProcess:
    """`module` on two processes to its end, its output captured as text: each rank forked from a server that imported
    the commands once (tools/ranks.py), with the environment accelerate's launch gives it."""
    from tools import ranks

    return ranks.run(module, args, _cpu_env(env), ROOT, free_port())


def fork2(args: list[str], logs: Path, env: dict | None = None, module: str = "train.loop"):
    """Start `module` on two forked ranks as `run2` does and return at once: a tools.ranks.Job, which `kill_9_once`
    kills as one (both ranks and their loader workers), each rank's output in `logs`. For a kill -9 of the whole job,
    where the launcher is not the point."""
    from tools import ranks

    logs.mkdir(parents=True, exist_ok=True)
    return ranks.launch(module, args, _cpu_env(env), ROOT, free_port(), logs)


def _cpu_env(env: dict | None) -> dict:
    """A two-process run's environment (a launch's, or each forked rank's besides tools.ranks.launcher_env): the
    tests' ENV on the CPU, then `env`."""
    return {**ENV, "ACCELERATE_USE_CPU": "true", **(env or {})}


@pytest.fixture(autouse=True, scope="session")
def _command_logging():
    """In-process calls print what the commands print: every command installs the one stderr handler of
    theworld/core/log.py, so a test must not depend on whether an earlier test happened to run a command first."""
    from theworld.core import log

    log.configure()


@pytest.fixture
def fake_vae(monkeypatch):
    """Make every `theworld.model.encoders.load_vae` call return a FakeWanVAE (fast, deterministic)."""
    from tests.fake_vae import FakeWanVAE
    from theworld.model import encoders

    vae = FakeWanVAE()
    monkeypatch.setattr(encoders, "load_vae", lambda spec, dtype="float32": vae)
    return vae


def fixed_inputs(model, processor, n: int = 2):
    """Prompt + caption batch of synthetic scenes with live world and image inputs (for comparing logits)."""
    import torch

    from theworld.embedded import synthetic
    from theworld.model import images
    from theworld.model.inputs import text_batch
    from theworld.model.text import ChatFormatter

    fmt = ChatFormatter(processor)
    scenes = [synthetic.scene(3, i) for i in range(n)]
    return text_batch(
        [fmt.encode(synthetic.PROMPT, cap) for _, cap in scenes],
        fmt.pad_id,
        images=torch.stack([images.to_uint8_tensor(img) for img, _ in scenes]),
        pixel_values=torch.stack([images.siglip_pixels(processor.image_processor, img) for img, _ in scenes]),
    )


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A 4-step stage-1 run on the tiny models with a synthetic multiple-choice benchmark evaluated at every eval;
    the logits of the model as training ends are recorded (export_final is wrapped) for from_pretrained to match."""
    import torch

    from precompute.config import load as load_pre
    from precompute.pipeline import run
    from theworld.infer import benchmark_items
    from train.loop import main
    from train.state import final

    root = tmp_path_factory.mktemp("trained")
    cache, out, mc = root / "cache", root / "run", root / "mc" / "items.jsonl"
    run(
        load_pre(
            str(ROOT / "configs" / "precompute.yaml"),
            [f"output_dir={cache}", "source.num_samples=48", "shard_size=24", "batch_size=24", "num_workers=0"],
        )
    )
    benchmark_items.make_synthetic(mc, 6)
    recorded = {}
    original = final.export_final

    def export_and_record(c, state, cfg_yaml, output_dir, *whole):
        with torch.no_grad():
            c.raw.eval()
            recorded["logits"] = c.raw(fixed_inputs(c.raw, c.processor), return_logits=True).logits
        return original(c, state, cfg_yaml, output_dir, *whole)

    sets = {
        "cache_dir": cache,
        "output_dir": out,
        "model.dtype": "float32",
        "train.max_steps": 4,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 8,
        "train.eval.samples": 8,
        "train.loader.num_workers": 0,
        "trackers": "[]",
        "train.checkpoint.every": 2,
        "train.eval.every": 2,
        "train.lr_schedule.warmup_steps": 1,
        "train.eval.benchmarks": f"[{mc}]",
    }
    argv = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    final.export_final = export_and_record
    try:
        assert main(argv) == 0
    finally:
        final.export_final = original
    return {"run": out, "logits": recorded["logits"], "mc": mc, "cache": cache}


# ----------------------------------------------------------------------------------------------------------------------
# Training runs on a small synthetic cache


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    """A copy of the session's trained run for a test that writes into it (evaluate adds its rows to final/README.md's
    card): the session's run stays as it was, whatever order or worker the tests run in."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained_run["run"], out, symlinks=True)
    return out


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """96 synthetic samples at 64 px, float32, flipped latents and images kept (3 shards of 32); no SigLIP features,
    since flip augmentation needs image tokens computed live from the flipped picture. Built once per session (per
    xdist worker) for the many modules that train on it: tests only read it, which its teardown checks."""
    from precompute.config import load as load_pre
    from precompute.pipeline import run

    out = tmp_path_factory.mktemp("train") / "cache"
    cfg = load_pre(
        str(ROOT / "configs" / "precompute.yaml"),
        [
            f"output_dir={out}",
            "source.num_samples=96",
            "shard_size=32",
            "batch_size=32",
            "num_workers=0",
            "cache.flip=true",
            "cache.siglip=false",
        ],
    )
    run(cfg)
    files = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))}
    yield out
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))} == files, "a test changed it"


def base_args(cache: Path, out: Path, steps: int = 4, **extra) -> list[str]:
    sets = {
        "cache_dir": cache,
        "output_dir": out,
        "model.dtype": "float32",
        "train.max_steps": steps,
        "train.global_batch_size": 16,
        "train.micro_batch_size": 8,
        "train.eval.samples": 16,
        "train.loader.num_workers": 0,
        "trackers": "[]",
        "train.logging.every": 1,
        "train.checkpoint.every": 100,
        "train.eval.every": 0,
        "train.lr_schedule.warmup_steps": 2,
        "train.optimizer.lr": "1e-2",
        **extra,
    }
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def watched_args(cache: Path, out: Path, **extra) -> list[str]:
    """conftest's small run with an eval (and its sampled captions) every step and a checkpoint every second."""
    watched = {
        "train.global_batch_size": 8,
        "train.eval.samples": 8,
        "train.checkpoint.every": 2,
        "train.eval.every": 1,
    }
    watched |= {"train.lr_schedule.warmup_steps": 1, "train.eval.captions": 2, "train.eval.caption_tokens": 4}
    return base_args(cache, out, steps=4, **watched, **extra)


HEAVY = ("torch", "transformers", "diffusers", "accelerate")  # what a command imports before it runs anything


def main_in_a_fresh_interpreter(module: str, args: list[str], env: dict | None = None) -> tuple[int, list[str], str]:
    """`module`.main(args) in a new interpreter (this one has torch already), with ENV plus `env`: its exit status,
    which of HEAVY it had imported when it returned, and its stderr."""
    probe = (
        f"import importlib, sys\ncode = importlib.import_module({module!r}).main({args!r})\n"
        f"print(code, *sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    env = {**ENV, **(env or {})}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    code, *heavy = done.stdout.splitlines()[0].split() if done.stdout else ["-1"]
    return int(code), heavy, done.stderr


def one_error_line(capsys, *words: str) -> str:
    """The command's one error line (a run stopped mid-way has also printed its progress bar and start line): it
    names each of `words`, and no traceback came with it."""
    text = capsys.readouterr().err
    err = [ln for ln in text.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and err[0].startswith("error: ") and all(w in err[0] for w in words), text[-3000:]
    assert "Traceback" not in text
    return err[0]


def final_bytes(out: Path) -> bytes:
    """The run's final weights as bytes (a bitwise comparison of two runs)."""
    return (out / "final" / "trainable.safetensors").read_bytes()


def evaluate_main(*argv) -> int:
    from theworld.evaluate import main

    return main([str(a) for a in argv])


def train_config(*sets: str):
    """The training config with `sets` (--set key=value) over the defaults."""
    from theworld.core.config import load_config
    from train.config import TrainConfig

    return load_config(TrainConfig, None, list(sets))


def slurm_job(**extra: str) -> dict:
    """SLURM's environment for node 2 of a 4-node job (job 77 on gpu07-gpu10), with `extra` over it."""
    return {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[07-10]"} | extra


@pytest.fixture
def small_cache(tmp_path, fake_vae):
    """10 samples in shards of 4 at 32 px (fake VAE), this test's own: it may damage it."""
    from precompute import pipeline
    from tests._precompute_helpers import make_cfg

    out = tmp_path / "cache"
    pipeline.run(make_cfg(out, n=10, shard=4, res=32))
    return out


def only_line(capsys, *words: str) -> str:
    """stderr holds one line, naming each of `words`, with no object's address in it."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert " at 0x" not in err[0]
    return err[0]


def bench_json(args: list[str], tmp_path) -> dict:
    """`python -m MODULE ARGS --json` (a benchmark) from tmp_path, required to succeed: its figures. Run in process
    (the module's main(argv), stdout captured; no ~10 s interpreter start; the processes it starts find this
    checkout): the working directory, environment and torch's thread count are restored afterwards."""
    import contextlib
    import importlib
    import io

    import torch

    out, cwd, env, threads = io.StringIO(), os.getcwd(), dict(os.environ), torch.get_num_threads()
    os.chdir(tmp_path)
    os.environ["PYTHONPATH"] = str(ROOT)  # for the processes the benchmark starts
    try:
        with contextlib.redirect_stdout(out):
            code = importlib.import_module(args[0]).main([*args[1:], "--json"])
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
    assert code == 0, out.getvalue()[-3000:]
    return json.loads(out.getvalue())  # --json: stdout is the figures alone, nothing before or after them


def positive(row: dict, *keys: str) -> None:
    """Each of `keys` in a benchmark's row is a finite positive number."""
    import math

    for k in keys:
        assert isinstance(row[k], (int, float)) and math.isfinite(row[k]) and row[k] > 0, (k, row[k])


def train_cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train.loop", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


def train_inproc(args: list[str]) -> int:
    from train.loop import main

    return main(args)


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "trainable.safetensors"))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for_step(out: Path, proc: subprocess.Popen, step: int, timeout: float = 240) -> None:
    """Wait until `proc`'s run at `out` has logged training step `step` (raises if it ends or times out first)."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if last_logged_step(out) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run did not reach step {step} (exit {proc.poll()})")


def still_running(pids: list[int], within: float) -> list[int]:
    """Which of `pids` still run (zombies do not count) once `within` seconds have passed, polled every 10 ms: an
    empty list as soon as none does."""
    import psutil

    def running() -> list[int]:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    deadline = time.time() + within
    while (alive := running()) and time.time() < deadline:
        time.sleep(0.01)
    return alive


def last_logged_step(out: Path) -> int:
    """The last training step the run at `out` has logged so far (-1: none yet)."""
    steps = [m.get("step", -1) for m in metrics_lines(out) if "loss" in m]
    return steps[-1] if steps else -1


def metrics_lines(out: Path) -> list[dict]:
    """The run's metrics.jsonl lines so far (a line being written is left out)."""
    try:
        text = (out / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # being written
            pass
    return lines


# ----------------------------------------------------------------------------------------------------------------------
# Kill -9, stop-signal and resume tests (tests/e2e/test_train.py, test_nodes.py, tests/train/test_sharding.py, ...)


def kill_9_once(proc, until, timeout: float = 300) -> None:
    """Poll `until()` every 10 ms (up to `timeout` s, or until `proc` ends), then kill -9 `proc`: a process, or a
    job of forked ranks (`fork2`), which dies with the processes its ranks started."""
    deadline = time.time() + timeout
    while not until() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.wait()


# ----------------------------------------------------------------------------------------------------------------------
# One process of a command, forked from tools/ranks.py's server (its imports done once)


class Forked:
    """A process forked by `fork_command`, with the part of subprocess.Popen's interface the helpers here use."""

    def __init__(self, process, logs: Path):
        self.process, self.logs, self.pid = process, logs, process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"fork of {self.pid}", timeout)
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def fork_command(module: str, args: list[str], env: dict | None = None, *, logs: Path) -> Forked:
    """Start `python -m module args` as one process of its own, forked from the server that imported the commands
    (tools/ranks.py): ENV plus `env`, cwd ROOT, stdout and stderr to the files out and err in `logs`.
    For a test whose point is a kill of the process, not a fresh interpreter: no ~11 s of imports."""
    from tools import ranks

    logs.mkdir(parents=True, exist_ok=True)
    process = ranks.start(module, args, {**ENV, **(env or {})}, ROOT, str(logs / "out"), str(logs / "err"))
    return Forked(process, logs)
