"""Training loop tests (CPU): exact resume after kill -9, 1 vs 2 processes vs accumulation, stage chaining with live
VAE encoding, live == cached first-step loss, fingerprint and config errors, data order. The modules' own tests:
tests/train/state/test_checkpoint.py, test_data.py, test_step.py, test_trainer.py, test_batches.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ENV, ROOT, base_args, fork_command, kill_9_once, metrics, run2, train_inproc, weights

# ----------------------------------------------------------------------------------------------------------------------
# Pure functions: order, split, accumulation


def test_rank_slices_are_disjoint_complete_and_independent_of_process_count():
    from train.data.order import epoch_order, rank_indices

    train = list(range(100, 180))  # 80 samples, G=16: 5 global batches per epoch
    for epoch in (0, 1):
        one = rank_indices(train, 7, epoch, 16, 0, 1).tolist()
        two = [rank_indices(train, 7, epoch, 16, r, 2).tolist() for r in range(2)]
        four = [rank_indices(train, 7, epoch, 16, r, 4).tolist() for r in range(4)]
        assert sorted(one) == sorted(train) and sorted(two[0] + two[1]) == sorted(train)
        assert not set(two[0]) & set(two[1])
        for b in range(5):  # the same samples in each global batch whatever the number of processes
            g = set(one[b * 16 : (b + 1) * 16])
            assert g == set(two[0][b * 8 : (b + 1) * 8] + two[1][b * 8 : (b + 1) * 8])
            assert g == set(sum((f[b * 4 : (b + 1) * 4] for f in four), []))
        # resuming at global batch 3 reads exactly the tail
        assert rank_indices(train, 7, epoch, 16, 1, 2, start_batch=3).tolist() == two[1][24:]
    assert epoch_order(train, 7, 0).tolist() == epoch_order(train, 7, 0).tolist() != epoch_order(train, 7, 1).tolist()


def test_accumulation_must_be_integral():
    from theworld.core.config import load_config
    from theworld.core.errors import UserError
    from train.config import TrainConfig, accumulation_steps

    cfg = load_config(TrainConfig, None, ["train.global_batch_size=32", "train.micro_batch_size=8"])
    assert accumulation_steps(cfg, 1) == 4 and accumulation_steps(cfg, 2) == 2
    with pytest.raises(UserError, match="train.global_batch_size"):
        accumulation_steps(cfg, 3)


# ----------------------------------------------------------------------------------------------------------------------
# User errors: exit 2, one line naming the cause


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.learning_rate=1", "train.learning_rate"),
        ("train.hardware.mixed_precision=fp16", "train.hardware.mixed_precision"),
    ],
)
def test_bad_config_key_or_value_exits_2(capsys, override, key):
    assert train_inproc(["--config", str(ROOT / "configs" / "stage1.yaml"), "--set", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0]


def test_a_tracker_that_is_not_installed_is_refused_before_training(cache, tmp_path, capsys, monkeypatch):
    """Accelerate only warns and trains on without it: days of a run with no wandb curves."""
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)
    assert train_inproc(base_args(cache, tmp_path / "run", **{"trackers": "[tensorboard, wandb]"})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'trackers': wandb is not installed" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override,field",
    [
        ("image.resolution=32", "image.resolution"),
        ("model.dtype=bfloat16", "vae.dtype"),
        ("model.vae=/elsewhere/vae", "vae.model"),
    ],
)
def test_mismatched_cache_fingerprint_is_refused(cache, tmp_path, capsys, override, field):
    args = base_args(cache, tmp_path / "run") + ["--set", override]
    assert train_inproc(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
    assert not (tmp_path / "run").exists()


def test_weights_fingerprint_checked_after_model_load(cache, tmp_path, capsys, monkeypatch):
    """A VAE with the same name but other weights is caught by the weight hash (full check after loading)."""
    from theworld.model import encoders

    real = encoders.load_vae

    def perturbed(spec, dtype="bfloat16"):
        vae = real(spec, dtype)
        with torch.no_grad():
            next(vae.parameters()).add_(1e-3)
        return vae

    monkeypatch.setattr(encoders, "load_vae", perturbed)
    assert train_inproc(base_args(cache, tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vae.weights" in err[0], err


# ----------------------------------------------------------------------------------------------------------------------
# Exact resume


@pytest.mark.slow
def test_kill_9_and_resume_gives_bitwise_equal_weights(cache, tmp_path, capsys):
    """The uninterrupted reference and the resume run in this process (one thread, as the killed process computes:
    a process of its own, forked with its imports done); the kill -9 lands as soon as the first checkpoint is
    complete, and the resumed run crosses an epoch."""
    extra = {
        "train.checkpoint.every": 2,
        "train.checkpoint.keep_last": 2,
        "train.loader.flip": "true",
        "world.latent": "sample",
        "train.optimizer.ema": 0.9,
        "train.hardware.cpu_threads": 1,
    }
    steps = 7  # 80 train samples: 5 steps per epoch
    assert train_inproc(base_args(cache, tmp_path / "ref", steps=steps, **extra)) == 0
    out = tmp_path / "killed"
    proc = fork_command("train.loop", base_args(cache, out, steps=steps, **extra), logs=tmp_path / "forked")
    kill_9_once(proc, lambda: (out / "checkpoint-2").exists())
    assert (out / "checkpoint-2").exists() and not (out / "final").exists(), "not killed between save and end"
    capsys.readouterr()
    assert train_inproc(base_args(cache, out, steps=steps, **extra)) == 0
    assert "resumed from" in capsys.readouterr().err
    a, b = weights(tmp_path / "ref"), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ea = load_file(str(tmp_path / "ref" / "final" / "ema.safetensors"))
    eb = load_file(str(out / "final" / "ema.safetensors"))
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    # metrics read as one run: one line per step, the same losses
    la = [m["loss"] for m in metrics(tmp_path / "ref") if "loss" in m]
    lb = [m["loss"] for m in metrics(out) if "loss" in m]
    assert la == lb and len(la) == steps
    state = json.loads((out / f"checkpoint-{steps}" / "state.json").read_text())
    assert state["step"] == steps and state["samples_seen"] == steps * 16
    assert state["data_cursor"] == {"epoch": 1, "batch_in_epoch": 2}
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-7"]  # keep_last 2
    assert not list(out.glob(".tmp-*"))


_HOLD_LOCK = """
import sys
from theworld.core import run_lock
fd = run_lock.acquire(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_second_run_into_a_busy_output_dir_is_refused_and_deletes_nothing(cache, tmp_path, capsys):
    """A small process holds the folder's run lock (a run that is saving a checkpoint: locks belong to a process, so
    not this one); the second run, in this process, is refused."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(out)], cwd=ROOT, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        (out / ".tmp-checkpoint-3-999").mkdir()
        assert train_inproc(base_args(cache, out)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'output_dir'" in err[0] and f"in use by another run (pid {holder.pid} " in err[0]
        assert sorted(p.name for p in out.iterdir()) == [".run.lock", ".tmp-checkpoint-3-999"]
    finally:
        holder.communicate(timeout=60)  # stdin closed: the holder exits and its lock goes with it
    assert train_inproc(base_args(cache, out)) == 0  # the holder gone, that folder is a killed run's leftover
    assert not (out / ".tmp-checkpoint-3-999").exists() and (out / "final").is_dir()


def test_damaged_weights_and_a_too_short_max_length_are_one_line_errors(cache, tmp_path, capsys):
    def one_line_error(args, *words):
        assert train_inproc(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err

    bad = tmp_path / "weights.safetensors"
    bad.write_bytes(b"\x00" * 64)
    one_line_error(base_args(cache, tmp_path / "a", init_from=bad), str(bad))
    one_line_error(
        base_args(cache, tmp_path / "b", **{"train.loader.max_length": 8}), "train.loader.max_length", "prompt alone"
    )
    out = tmp_path / "c"
    assert train_inproc(base_args(cache, out, steps=1, **{"train.checkpoint.every": 1})) == 0
    (out / "checkpoint-1" / "optimizer.pt").write_bytes(b"torn")
    capsys.readouterr()
    one_line_error(base_args(cache, out, steps=2), "optimizer.pt", "the one before it")


def test_a_prompt_too_long_met_inside_a_loader_worker_is_one_line(cache, tmp_path, monkeypatch, capsys):
    """The loaders check the first sample before their workers fork; a longer prompt met later, inside a worker,
    still ends as one line naming the key (not the worker's traceback)."""
    from theworld.model import text
    from train.data import loader

    armed = {"on": False}
    label, check = text.ChatFormatter._label, loader.DataContext.check_first

    def long_prompt(self, prompt, full):
        if armed["on"]:
            raise text.PromptTooLong("prompt alone is 999 tokens, over max_length 900")
        return label(self, prompt, full)

    def check_then_arm(ctx):
        check(ctx)
        armed["on"] = True  # the forked loader workers inherit it
        return ctx

    monkeypatch.setattr(text.ChatFormatter, "_label", long_prompt)
    monkeypatch.setattr(loader.DataContext, "check_first", check_then_arm)
    assert train_inproc(base_args(cache, tmp_path / "run", **{"train.loader.num_workers": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: config key 'train.loader.max_length': prompt alone is 999 tokens, over max_length 900", (
        err
    )
    assert not any("Traceback" in line for line in err)


def test_eval_samples_0_runs_no_eval_and_1_is_refused(cache, tmp_path, capsys):
    assert (
        train_inproc(base_args(cache, tmp_path / "a", steps=2, **{"train.eval.samples": 0, "train.eval.every": 1})) == 0
    )
    assert not [m for m in metrics(tmp_path / "a") if "eval_loss" in m]
    assert "eval_loss" not in capsys.readouterr().out
    assert "final eval loss n/a" in (tmp_path / "a" / "final" / "README.md").read_text()
    assert train_inproc(base_args(cache, tmp_path / "b", steps=2, **{"train.eval.samples": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.eval.samples" in err[0], err


# ----------------------------------------------------------------------------------------------------------------------
# Process count and accumulation do not change the numbers


@pytest.mark.slow
def test_one_vs_two_processes_vs_accumulation(cache, tmp_path):
    # the hardest case: sampled latents, and the VAE and vision tower training (DDP fails on a trainable parameter
    # that gets no gradient)
    extra = {"train.loader.flip": "true", "world.latent": "sample", "freeze.vae": "false", "freeze.vision": "false"}
    assert train_inproc(base_args(cache, tmp_path / "one", steps=3, **extra)) == 0  # 1 process, 2 micro-batches of 8
    assert train_inproc(base_args(cache, tmp_path / "acc", steps=3, **extra, **{"train.micro_batch_size": 4})) == 0
    two = run2(base_args(cache, tmp_path / "two", steps=3, **extra))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es) x 1 micro-batches" in two.stderr + two.stdout
    w1, wa, w2 = weights(tmp_path / "one"), weights(tmp_path / "acc"), weights(tmp_path / "two")
    assert w1.keys() == wa.keys() == w2.keys()
    # Not attention key biases: a key bias adds the same logit to a whole row, which softmax ignores, so its gradient
    # is rounding noise that Adam scales to full-size steps. The tolerance is 0.1% of one step at lr 1e-2.
    for k in [k for k in w1 if not k.endswith("k_proj.bias")]:
        torch.testing.assert_close(wa[k], w1[k], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-5)
    l1 = [m["loss"] for m in metrics(tmp_path / "one") if "loss" in m]
    l2 = [m["loss"] for m in metrics(tmp_path / "two") if "loss" in m]
    assert l1 == pytest.approx(l2, rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# Stages


def test_live_vae_first_step_loss_equals_cached(cache, tmp_path):
    assert train_inproc(base_args(cache, tmp_path / "cached", steps=1)) == 0
    assert train_inproc(base_args(cache, tmp_path / "live", steps=1, **{"freeze.vae": "false"})) == 0
    cached = metrics(tmp_path / "cached")[0]
    live = metrics(tmp_path / "live")[0]
    assert cached["step"] == live["step"] == 1
    assert live["loss"] == pytest.approx(cached["loss"], rel=1e-5, abs=1e-6)
    assert any(k.startswith("world_encoder.vae.") for k in weights(tmp_path / "live"))


def test_stage_chain_1_2_4(cache, tmp_path, capsys):
    cfgs = ROOT / "configs"
    small = {
        "train.max_steps": 2,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.eval.samples": 8,
        "train.loader.num_workers": 0,
        "trackers": "[]",
        "train.eval.every": 0,
        "cache_dir": cache,
    }
    s = lambda d: [a for k, v in d.items() for a in ("--set", f"{k}={v}")]
    s1, s2, s4 = tmp_path / "s1", tmp_path / "s2", tmp_path / "s4"
    assert (
        train_inproc(
            [
                "--config",
                str(cfgs / "stage1.yaml"),
                *s({**small, "output_dir": s1, "profile.enabled": "true", "profile.start_step": 0, "profile.steps": 1}),
            ]
        )
        == 0
    )
    out1 = capsys.readouterr()
    assert "latents cached" in out1.err
    assert (s1 / "profile" / "trace-rank0.json").stat().st_size > 0 and "aten::" in out1.err
    assert (
        train_inproc(
            ["--config", str(cfgs / "stage2.yaml"), *s({**small, "output_dir": s2, "init_from": s1 / "final"})]
        )
        == 0
    )
    out2 = capsys.readouterr()
    w1, w2 = weights(s1), weights(s2)
    assert set(w1) == {k for k in w2 if k.startswith("projector.")}
    assert any(k.startswith("gemma.model.vision_tower.") for k in w2)
    n_new = len(w2) - len(w1)
    assert f"loaded {len(w1)} tensors, {n_new} new, 0 ignored" in out2.err
    assert (
        train_inproc(
            [
                "--config",
                str(cfgs / "stage4.yaml"),
                *s({**small, "output_dir": s4, "init_from": s2 / "final", "train.loader.num_workers": 1}),
            ]
        )
        == 0
    )
    out4 = capsys.readouterr()
    assert "latents live" in out4.err and f"loaded {len(w2)} tensors" in out4.err
    w4 = weights(s4)
    assert any(k.startswith("world_encoder.vae.") for k in w4)
    assert any(k.startswith("gemma.model.language_model.") for k in w4)
    final = s4 / "final"
    assert str(s2 / "final") in (final / "README.md").read_text()
    assert "vae: false" in (final / "config.yaml").read_text()
    assert "eval_loss" in metrics(s4)[-1]


# ----------------------------------------------------------------------------------------------------------------------
# The loader and the attention kernel (non-finite steps: tests/train/test_step.py)


def test_a_slow_loader_shows_as_data_wait(cache, tmp_path, monkeypatch, capsys):
    from train.data import loader

    slow = loader.CacheDataset.__getitem__

    def getitem(self, pos):
        time.sleep(0.05)
        return slow(self, pos)

    monkeypatch.setattr(loader.CacheDataset, "__getitem__", getitem)  # num_workers=0: loading runs in this process
    assert train_inproc(base_args(cache, tmp_path / "run", steps=2)) == 0
    waits = [m["data_wait"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert len(waits) == 2 and all(0 < w <= 1 for w in waits), waits  # a fraction of the step's time
    # 16 samples x 50 ms a step: sleeping never takes less, however loaded the machine (no upper bound on a shared one)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "waiting for data" in ln)
    assert float(line.split("waiting for data ")[1].split(" ms/step")[0]) >= 800, line


def test_train_attention_sets_the_language_models_kernel_only():
    from theworld.core.config import load_config
    from theworld.core.errors import UserError
    from theworld.model.arch import TINY
    from tools.speed_real import build_gemma
    from train.components import set_language_attention
    from train.config import TrainConfig

    gemma = build_gemma(TINY, torch.device("cpu"), "eager")  # goes through set_language_attention
    assert gemma.model.language_model.config._attn_implementation == "eager"
    assert gemma.model.vision_tower.config._attn_implementation == "sdpa"
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="train.hardware.attention.*CUDA"):
            set_language_attention(gemma, "flex_attention")
    with pytest.raises(UserError, match="train.hardware.attention"):
        load_config(TrainConfig, None, ["train.hardware.attention=flash"])


def test_flex_attention_without_cuda_is_refused_before_any_model_loads(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same refusal on a machine with a GPU
    _refused_before_any_model_loads(
        base_args(cache, tmp_path / "run", **{"train.hardware.attention": "flex_attention"}),
        tmp_path / "run",
        monkeypatch,
        capsys,
        "train.hardware.attention",
        "CUDA",
    )


def _refused_before_any_model_loads(args: list[str], out, monkeypatch, capsys, *words: str) -> None:
    """The run exits 2 with one line holding `words`, without loading a model or creating its output_dir."""
    from theworld.model.world import TheWorld

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(TheWorld, "from_config", no_loading)
    assert train_inproc(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------------------------
# Aspect-ratio buckets: the same guarantees on a cache of several latent shapes


@pytest.fixture(scope="module")
def bucket_cache(tmp_path_factory):
    """48 images of five aspect ratios at 128 px (latent shapes 12x20, 12x24, 16x16, 20x12, 24x12), flipped latents
    and images kept."""
    from precompute.config import load as load_pre
    from precompute.pipeline import run
    from tests._precompute_helpers import bucket_folder

    root = tmp_path_factory.mktemp("bucket")
    src = bucket_folder(root / "src", 48)
    cfg = load_pre(
        str(ROOT / "configs" / "precompute.yaml"),
        [
            f"output_dir={root / 'cache'}",
            "source.type=folder",
            f"source.path={src}",
            "image.resize=bucket",
            "image.resolution=128",
            "shard_size=16",
            "batch_size=16",
            "num_workers=0",
            "cache.flip=true",
            "cache.siglip=false",
            "cache.dtype=float32",
            "model.dtype=float32",
        ],
    )
    run(cfg)
    return root / "cache"


def bucket_args(cache: Path, out: Path, steps: int, **extra) -> list[str]:
    return base_args(
        cache,
        out,
        steps=steps,
        **{
            "image.resolution": 128,
            "image.resize": "bucket",
            "world.pool": 2,
            "train.global_batch_size": 4,
            "train.micro_batch_size": 2,
            "train.eval.samples": 8,
            "train.loader.flip": "true",
            "world.latent": "sample",
            **extra,
        },
    )


@pytest.mark.slow
def test_bucketed_cache_resumes_exactly_and_two_processes_match_one(bucket_cache, tmp_path, capsys):
    # 40 train samples in five shapes, G=4: every step's batch has one shape, the world-token count changes between
    # steps. Resume: a finished run with its last checkpoint and final/ removed is continued from checkpoint-2.
    assert train_inproc(bucket_args(bucket_cache, tmp_path / "ref", 4, **{"train.checkpoint.every": 2})) == 0
    assert "latent shapes (train samples): " in capsys.readouterr().err
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ref", resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoint-4")
    assert train_inproc(bucket_args(bucket_cache, resumed, 4, **{"train.checkpoint.every": 2})) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "checkpoint-2" in err
    a, b = weights(tmp_path / "ref"), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics(resumed) if "loss" in m] == [
        m["loss"] for m in metrics(tmp_path / "ref") if "loss" in m
    ]
    two = run2(bucket_args(bucket_cache, tmp_path / "two", 4, **{"train.checkpoint.every": 2}))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es) x 1 micro-batches" in two.stderr + two.stdout
    w2 = weights(tmp_path / "two")
    for k in [k for k in a if not k.endswith("k_proj.bias")]:
        torch.testing.assert_close(w2[k], a[k], rtol=1e-5, atol=1e-5)
    l1 = [m["loss"] for m in metrics(tmp_path / "ref") if "loss" in m]
    assert l1 == pytest.approx([m["loss"] for m in metrics(tmp_path / "two") if "loss" in m], rel=1e-5)
    e1 = [m for m in metrics(tmp_path / "ref") if "eval_loss" in m][-1]
    e2 = [m for m in metrics(tmp_path / "two") if "eval_loss" in m][-1]
    assert e1["eval_tokens"] == e2["eval_tokens"] and e1["eval_loss"] == pytest.approx(e2["eval_loss"], rel=1e-5)


def test_bucketed_micro_batches_hold_one_shape_and_live_encoding_matches_the_cache(bucket_cache, tmp_path):
    from theworld.core.config import load_config
    from train import components
    from train.config import TrainConfig
    from train.data import cache as data
    from train.data import loader, order

    cfg = load_config(TrainConfig, None, [a for a in bucket_args(bucket_cache, tmp_path / "run", 1) if a != "--set"])
    reader, plan = data.open_cache(cfg)
    c = components.build(cfg, components.make_accelerator(cfg), 2)
    ctx = loader.DataContext.build(cfg, reader, plan, c.processor)
    steps = order.check_sizes(cfg, reader, ctx.train_indices, 1)
    shapes = []
    for batch in loader.build_train_loader(cfg, ctx, 0, 1, epoch=1):
        mean = batch.to("cpu").latent_mean
        shapes.append(tuple(mean.shape[-2:]))
    assert len(shapes) == 2 * steps and len(set(shapes)) == 5  # every shape met, one per micro-batch (or no stack)
    # stage 4's live VAE input has the bucket's size: the first step's loss equals the cached one
    assert train_inproc(bucket_args(bucket_cache, tmp_path / "cached", 1, **{"world.latent": "mean"})) == 0
    assert (
        train_inproc(bucket_args(bucket_cache, tmp_path / "live", 1, **{"world.latent": "mean", "freeze.vae": "false"}))
        == 0
    )
    cached, live = metrics(tmp_path / "cached")[0], metrics(tmp_path / "live")[0]
    assert live["loss"] == pytest.approx(cached["loss"], rel=1e-5, abs=1e-6)


def test_a_mean_only_cache_trains_with_the_mean_and_refuses_sampling(tmp_path, capsys, monkeypatch):
    from precompute.config import load as load_pre
    from precompute.pipeline import run
    from theworld import cache_format as cf

    out = tmp_path / "cache"
    run(
        load_pre(
            str(ROOT / "configs" / "precompute.yaml"),
            [
                f"output_dir={out}",
                "source.num_samples=40",
                "shard_size=20",
                "batch_size=20",
                "num_workers=0",
                "cache.siglip=false",
                "cache.latents=mean",
            ],
        )
    )
    assert cf.load_manifest(out)["contents"]["latents"] == "mean"
    assert (
        train_inproc(
            base_args(
                out,
                tmp_path / "mean",
                steps=1,
                **{"train.global_batch_size": 8, "train.micro_batch_size": 8, "train.eval.samples": 8},
            )
        )
        == 0
    )
    capsys.readouterr()
    _refused_before_any_model_loads(
        base_args(out, tmp_path / "sample", **{"world.latent": "sample"}),
        tmp_path / "sample",
        monkeypatch,
        capsys,
        "'world.latent'",
        "cache.latents: mean",
    )
