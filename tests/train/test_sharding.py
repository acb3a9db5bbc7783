"""Sharded training (train.hardware.sharding: fsdp, FSDP2 on gloo with two real CPU processes),
train.optimizer.lr_multipliers and the memory plan (tools.memory_plan): FSDP equals one process, kill -9 + resume under
FSDP is bitwise exact, the stage chain crosses shardings, multipliers reach their parameter groups, the plan's counts
are exact and its estimate matches a measured peak."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ENV, ROOT, base_args, fork2, kill_9_once, metrics, run2, train_inproc, weights

STAGE3 = {"freeze.vision": "false", "freeze.language": "false"}


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in metrics(run_dir) if "loss" in m]


# ----------------------------------------------------------------------------------------------------------------------
# FSDP across two processes: one uninterrupted two-process run (the module's `fsdp_runs`) is the reference of the
# one-process comparison, the step-0 evaluation comparison and the kill -9 + resume comparison.

# Stage 3 (vision and language train) as a shipped sharded config reaches its first evaluation (step 0, before any
# training forward): the caption samples run the model's parts (embeddings, the world block, generation) before the
# eval loss runs its root forward. 19 held-out samples give the two processes 2 and 1 eval batches: every forward is a
# collective under FSDP. The gathered checkpoint layout (train.checkpoint.sharded: false; the sharded one:
# tests/train/state/test_shards.py), EMA and sampled latents (noise seeded per sample, so 1 == 2 processes) for the
# kill -9 comparison.
FSDP_REF = {
    **STAGE3,
    "train.eval.every": 2,
    "train.eval.captions": 2,
    "train.eval.caption_tokens": 4,
    "train.eval.samples": 19,
    "train.checkpoint.sharded": "false",
    "train.checkpoint.every": 2,
    "train.optimizer.ema": 0.9,
    "world.latent": "sample",
}
# the two-process runs ask for FSDP the way an accelerate launch config does (with host offload from the launcher:
# tests/theworld/model/test_lora.py), the one-process run through train.hardware.sharding (which with one process
# shards nothing)
LAUNCHER_FSDP = {"ACCELERATE_USE_FSDP": "true"}
REF_STEPS = 5


@pytest.fixture(scope="module")
def fsdp_runs(cache, tmp_path_factory):
    """The reference on two processes (its stderr kept) and the same run in this process."""
    root = tmp_path_factory.mktemp("fsdp")
    two = run2(base_args(cache, root / "two", steps=REF_STEPS, **FSDP_REF), env=LAUNCHER_FSDP)
    assert two.returncode == 0, two.stderr[-3000:]
    one = base_args(cache, root / "one", steps=REF_STEPS, **FSDP_REF, **{"train.hardware.sharding": "fsdp"})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train_inproc(one)
    assert code == 0, err.getvalue()[-3000:]
    return {"root": root, "two": two.stderr, "one": err.getvalue()}


def assert_close_weights(w1: dict, w2: dict) -> None:
    assert w1.keys() == w2.keys() and any(k.startswith("gemma.model.language_model.") for k in w1)
    # not attention key biases: softmax ignores them, so their gradient is rounding noise (see test_train.py)
    for k in [k for k in w1 if not k.endswith("k_proj.bias")]:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.slow
def test_fsdp_two_processes_give_the_weights_of_one(fsdp_runs):
    root = fsdp_runs["root"]
    assert "sharding fsdp with 1 process: unsharded" in fsdp_runs["one"]
    two = fsdp_runs["two"]
    assert "sharding fsdp (FSDP2 fully_shard" in two and "ACCELERATE_USE_FSDP" in two
    assert "sharding: fsdp" in (root / "two" / "final" / "config.yaml").read_text()
    for name in ("trainable", "ema"):
        assert_close_weights(*(load_file(str(root / d / "final" / f"{name}.safetensors")) for d in ("one", "two")))
    assert len(losses(root / "one")) == REF_STEPS
    assert losses(root / "one") == pytest.approx(losses(root / "two"), rel=1e-5)
    ev1, ev2 = ([m for m in metrics(root / d) if "eval_loss" in m][-1] for d in ("one", "two"))
    assert ev1["eval_tokens"] == ev2["eval_tokens"] and ev1["eval_loss"] == pytest.approx(ev2["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_fsdp_two_processes_evaluate_with_samples_at_step_0_as_one_process(fsdp_runs):
    root = fsdp_runs["root"]
    evals = [[m for m in metrics(root / d) if "eval_loss" in m] for d in ("one", "two")]
    assert [m["step"] for m in evals[1]] == [0, 2, 4, 5] == [m["step"] for m in evals[0]]
    for e1, e2 in zip(*evals):
        assert e1["eval_loss"] == pytest.approx(e2["eval_loss"], rel=1e-5)
        assert e1["eval_loss_shuffled_world"] == pytest.approx(e2["eval_loss_shuffled_world"], rel=1e-5)
    samples = [[m["samples"] for m in metrics(root / d) if "samples" in m] for d in ("one", "two")]
    assert len(samples[1]) == 4 and samples[0] == samples[1]  # the same greedy captions at steps 0, 2, 4 and 5


@pytest.mark.slow
def test_fsdp_kill_9_and_resume_gives_bitwise_equal_weights(fsdp_runs, cache, tmp_path, capsys):
    """Both processes killed with kill -9 once checkpoint-2 is sealed, resumed on two processes: bitwise the
    uninterrupted reference (weights, EMA, losses)."""
    ref = fsdp_runs["root"] / "two"
    out = tmp_path / "killed"
    proc = fork2(base_args(cache, out, steps=REF_STEPS, **FSDP_REF), tmp_path / "logs", env=LAUNCHER_FSDP)
    kill_9_once(proc, lambda: (out / "checkpoint-2").exists())  # both processes
    assert (out / "checkpoint-2").exists() and not (out / "final").exists(), "not killed between save and end"
    resumed = run2(base_args(cache, out, steps=REF_STEPS, **FSDP_REF), env=LAUNCHER_FSDP)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    a, b = weights(ref), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ea = load_file(str(ref / "final" / "ema.safetensors"))
    eb = load_file(str(out / "final" / "ema.safetensors"))
    assert ea.keys() == a.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)
    assert losses(ref) == losses(out) and len(losses(out)) == REF_STEPS
    # a checkpoint written by two FSDP processes holds whole tensors: one process resumes it (any count may)
    ckpt = ref / "checkpoint-4"
    shapes = {k: v.shape for k, v in load_file(str(ckpt / "trainable.safetensors")).items()}
    assert shapes == {k: v.shape for k, v in a.items()}
    # AdamW state for exactly the trainable tensors, whole: the frozen VAE has none
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert sorted(tuple(st["exp_avg"].shape) for st in opt["state"].values()) == sorted(map(tuple, shapes.values()))
    assert not any(k.startswith("world_encoder.") for k in shapes)
    again = tmp_path / "one"
    again.mkdir()
    shutil.copytree(ckpt, again / "checkpoint-4")
    capsys.readouterr()
    one = {**FSDP_REF, "train.hardware.sharding": "fsdp"}
    assert train_inproc(base_args(cache, again, steps=REF_STEPS, **one)) == 0
    assert "written by 2 process(es), resumed by 1" in capsys.readouterr().err


@pytest.mark.slow
def test_fsdp_stage_chain_1_2_4(cache, tmp_path, capsys):
    """Stage 1 sharded over two processes, stage 2 in one, stage 4 sharded again: init_from reads whole tensors by
    name whatever wrote them."""
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
        "train.hardware.sharding": "fsdp",
    }
    s = lambda d: [a for k, v in d.items() for a in ("--set", f"{k}={v}")]
    s1, s2, s4 = tmp_path / "s1", tmp_path / "s2", tmp_path / "s4"
    r1 = run2(["--config", str(cfgs / "stage1.yaml"), *s({**small, "output_dir": s1})])
    assert r1.returncode == 0, r1.stderr[-3000:]
    capsys.readouterr()
    assert (
        train_inproc(
            ["--config", str(cfgs / "stage2.yaml"), *s({**small, "output_dir": s2, "init_from": s1 / "final"})]
        )
        == 0
    )
    w1, w2 = weights(s1), weights(s2)
    assert set(w1) == {k for k in w2 if k.startswith("projector.")}
    assert f"loaded {len(w1)} tensors, {len(w2) - len(w1)} new, 0 ignored" in capsys.readouterr().err
    r4 = run2(
        [
            "--config",
            str(cfgs / "stage4.yaml"),
            *s(
                {
                    **small,
                    "output_dir": s4,
                    "init_from": s2 / "final",
                    "train.hardware.gradient_checkpointing": "true",
                    "train.hardware.mixed_precision": "bf16",
                }
            ),
        ]
    )
    assert r4.returncode == 0, r4.stderr[-3000:]
    assert "latents live" in r4.stderr and f"loaded {len(w2)} tensors" in r4.stderr
    assert "sharding fsdp (FSDP2 fully_shard" in r4.stderr
    w4 = weights(s4)
    # bf16 compute from fp32 master weights: what trains is saved in fp32, and it moved
    assert {v.dtype for v in w4.values()} == {torch.float32} and all(math.isfinite(x) for x in losses(s4))
    assert any(not torch.equal(w4[k], w2[k]) for k in w2)
    assert any(k.startswith("world_encoder.vae.encoder.") for k in w4)
    assert any(k.startswith("gemma.model.language_model.") for k in w4)
    # whole tensors under the model's own names: exactly the trainable set of an unsharded stage-4 model
    from theworld.core.config import load_config
    from tools.memory_plan import build_world
    from train.config import TrainConfig

    cfg = load_config(TrainConfig, str(cfgs / "stage4.yaml"), ["model.dtype=float32"])
    expected = {n: p.shape for n, p in build_world(cfg).named_parameters() if p.requires_grad}
    assert {k: v.shape for k, v in w4.items()} == expected


# ----------------------------------------------------------------------------------------------------------------------
# Host offload (train.hardware.cpu_offload)


@pytest.mark.slow
def test_cpu_offload_with_one_process_equals_unsharded_and_resumes_bitwise(cache, tmp_path, capsys):
    """One process with FSDP2's CPUOffloadPolicy shards over a group of one (the path a single GPU takes for stages 3
    and 4): its weights and EMA equal a plain one-process run's, and a rerun from its step-2 checkpoint ends bitwise
    equal to it. In this process: the group of one is made and destroyed by the run itself."""
    extra = {**STAGE3, "train.checkpoint.every": 2, "train.optimizer.ema": 0.9}
    offload = {**extra, "train.hardware.sharding": "fsdp", "train.hardware.cpu_offload": "true"}
    assert train_inproc(base_args(cache, tmp_path / "off", **offload)) == 0
    err = capsys.readouterr().err
    assert "over 1 process(es); parameters, gradients and optimizer state offloaded to host memory" in err, err[-3000:]
    assert not torch.distributed.is_initialized()
    assert "cpu_offload: true" in (tmp_path / "off" / "final" / "config.yaml").read_text()
    assert train_inproc(base_args(cache, tmp_path / "plain", **extra)) == 0
    assert "sharding ddp (1 process)" in capsys.readouterr().err
    for name in ("trainable", "ema"):
        a, b = (load_file(str(tmp_path / d / "final" / f"{name}.safetensors")) for d in ("off", "plain"))
        assert a.keys() == b.keys() and any(k.startswith("gemma.model.language_model.") for k in a)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6)
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(tmp_path / "off" / "checkpoint-2", again / "checkpoint-2")
    assert train_inproc(base_args(cache, again, **offload)) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "offloaded to host memory" in err
    a, b = weights(tmp_path / "off"), weights(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "off")[2:] == losses(again)


@pytest.mark.parametrize(
    "config,env,expected",
    [
        ("ddp", {"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"}, ("fsdp", True)),
        ("ddp", {"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "false"}, ("fsdp", False)),
        ("ddp", {"FSDP_OFFLOAD_PARAMS": "true"}, ("ddp", False)),  # an offload flag alone does not turn FSDP on
        ("fsdp", {"FSDP_OFFLOAD_PARAMS": "true"}, ("fsdp", True)),
        ("fsdp", {}, ("fsdp", False)),
    ],
)
def test_launcher_fsdp_and_offload_flags_select_the_plan(monkeypatch, config, env, expected):
    from train import sharding
    from train.config import TrainConfig

    for k in ("ACCELERATE_USE_FSDP", "FSDP_OFFLOAD_PARAMS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = TrainConfig()
    cfg.train.hardware.sharding = config
    plan = sharding.resolve(cfg.train.hardware)
    assert (plan.mode, plan.offload) == expected
    assert plan.sharded(1) == plan.offload and plan.sharded(2) == (plan.mode == "fsdp")
    assert not {"ACCELERATE_USE_FSDP", "FSDP_OFFLOAD_PARAMS"} & set(os.environ)  # Accelerator() must not see them
    # offloaded shards are host tensors: a GPU group of several processes needs gloo for their collectives
    assert sharding.process_group_backend(plan, cpu=False, processes=8) == (
        "cuda:nccl,cpu:gloo" if plan.offload else None
    )
    assert sharding.process_group_backend(plan, cpu=True, processes=8) is None  # gloo already
    assert sharding.process_group_backend(plan, cpu=False, processes=1) is None  # accelerate makes no group


# ----------------------------------------------------------------------------------------------------------------------
# Learning-rate multipliers


def test_lr_multipliers_reach_their_parameter_groups(cache, tmp_path):
    from theworld.core.config import load_config
    from train import components, optim
    from train.config import TrainConfig
    from train.data import cache as data
    from train.data import loader
    from train.step import LoopState, optimization_step

    mult = {"projector": 10.0, "vision": 0.5, "language": 2.0, "vae": 1.0}
    sets = [
        a
        for a in base_args(
            cache,
            tmp_path / "run",
            **STAGE3,
            **{"train.lr_schedule.warmup_steps": 0, "train.optimizer.lr": "1e-3", "train.optimizer.weight_decay": 0.1},
        )
        if a != "--set"
    ]
    cfg = load_config(TrainConfig, None, sets + [f"train.optimizer.lr_multipliers.{k}={v}" for k, v in mult.items()])
    reader, plan = data.open_cache(cfg)
    c = components.build(cfg, components.make_accelerator(cfg), 2)
    names = {id(p): n for n, p in c.raw.named_parameters()}
    groups = c.optimizer.param_groups
    assert sorted({g["part"] for g in groups}) == ["language", "projector", "vision"]  # the frozen VAE has none
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in c.params) and len(set(grouped)) == len(grouped)
    for g in groups:
        assert g["lr_multiplier"] == mult[g["part"]]
        for p in g["params"]:
            n = names[id(p)]
            assert optim.part_of(n) == g["part"]
            no_decay = p.ndim < 2 or "norm" in n or n in ("projector.sow", "projector.eow")
            assert g["weight_decay"] == (0.0 if no_decay else 0.1), n
    ctx = loader.DataContext.build(cfg, reader, plan, c.processor)
    it = iter(loader.build_train_loader(cfg, ctx, 0, 1, epoch=0, start=0))
    before = {id(p): p.detach().clone() for p in c.params}
    out = optimization_step(c, LoopState(), [next(it), next(it)])
    assert out["lr"] == pytest.approx(1e-3)
    for g in groups:
        lr = 1e-3 * mult[g["part"]]
        assert g["lr"] == pytest.approx(lr)
        # AdamW's first step moves a weight by at most lr (|m / sqrt(v)| <= 1) plus its decay lr * wd * |w|, and
        # some weight of the group by nearly lr
        steps = max((p.detach() - before[id(p)]).abs().max().item() for p in g["params"])
        w = max(before[id(p)].abs().max().item() for p in g["params"])
        assert 0.5 * lr < steps <= lr * (1 + g["weight_decay"] * w) * 1.001, (g["part"], steps, lr)


def test_checkpoint_with_one_adamw_group_per_decay_setting_resumes_exactly(cache, tmp_path):
    """Checkpoints written before the per-part groups hold AdamW state in two groups (decay, then no decay, each in
    parameter order): such a stage-3 checkpoint resumes, its state re-keyed by parameter name, and ends bitwise
    equal to the run that wrote it."""
    from theworld.cache_format import sha256_file
    from theworld.core.config import load_config
    from train import components, optim
    from train.config import TrainConfig

    extra = {**STAGE3, "train.checkpoint.every": 2, "train.optimizer.weight_decay": 0.1}
    assert train_inproc(base_args(cache, tmp_path / "ref", **extra)) == 0
    sets = [a for a in base_args(cache, tmp_path / "ref", **extra) if a != "--set"]
    model, _ = components.build_model(load_config(TrainConfig, None, sets))
    order = [n for n, p in model.named_parameters() if p.requires_grad]
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = optim.param_groups(model, 0.1)
    now = [name_of[id(p)] for g in groups for p in g["params"]]
    decay = {name_of[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert len(groups) > 2 and decay and len(decay) < len(now)
    before = [n for n in order if n in decay] + [n for n in order if n not in decay]
    ckpt = tmp_path / "old" / "checkpoint-2"
    shutil.copytree(tmp_path / "ref" / "checkpoint-2", ckpt)
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    settings = {k: v for k, v in saved["param_groups"][0].items() if k not in ("params", "part", "lr_multiplier")}
    saved["state"] = {before.index(now[i]): st for i, st in saved["state"].items()}
    saved["param_groups"] = [
        {**settings, "weight_decay": 0.1, "params": list(range(len(decay)))},
        {**settings, "weight_decay": 0.0, "params": list(range(len(decay), len(before)))},
    ]
    torch.save(saved, ckpt / "optimizer.pt")
    state = json.loads((ckpt / "state.json").read_text())
    state["sha256"]["optimizer.pt"] = sha256_file(ckpt / "optimizer.pt")
    state.pop("state_sha256")  # written before state.json sealed itself, too
    (ckpt / "state.json").write_text(json.dumps(state))
    assert train_inproc(base_args(cache, tmp_path / "old", **extra)) == 0
    a, b = weights(tmp_path / "ref"), weights(tmp_path / "old")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "value,key",
    [
        ("train.optimizer.lr_multipliers.decoder=2", "train.optimizer.lr_multipliers.decoder"),
        ("train.optimizer.lr_multipliers.projector=0", "train.optimizer.lr_multipliers.projector"),
        ("train.optimizer.lr_multipliers.vision=-1", "train.optimizer.lr_multipliers.vision"),
        ("train.optimizer.lr_multipliers.vae=.nan", "train.optimizer.lr_multipliers.vae"),
        ("train.optimizer.lr_multipliers.language=.inf", "train.optimizer.lr_multipliers.language"),
        ("train.hardware.sharding=zero3", "train.hardware.sharding"),
        ("train.hardware.cpu_offload=true", "train.hardware.cpu_offload"),
    ],
)  # offload without fsdp
def test_bad_lr_multiplier_or_sharding_is_a_one_line_error(capsys, value, key):
    assert train_inproc(["--config", str(ROOT / "configs" / "stage3.yaml"), "--set", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err


# ----------------------------------------------------------------------------------------------------------------------
# Memory plan


@pytest.mark.parametrize("stage", ["stage1", "stage3", "stage4"])
def test_memory_plan_counts_parameters_exactly(stage):
    from theworld.core.config import load_config
    from tools import memory_plan as memory
    from train import components
    from train.config import TrainConfig

    cfg = load_config(TrainConfig, str(ROOT / "configs" / f"{stage}.yaml"))
    model, _ = components.build_model(cfg)  # the real thing: from_pretrained of the tiny models, freeze flags applied
    params = dict(model.named_parameters())
    plan = memory.estimate(cfg, gpus=2, gpu_memory_gib=80)
    assert plan["total_params"] == sum(p.numel() for p in params.values())
    assert plan["trainable_params"] == sum(p.numel() for p in params.values() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in params.values() if not p.requires_grad)
    assert plan["per_gpu_bytes"]["ddp"]["frozen_weights"] == frozen
    assert plan["per_gpu_bytes"]["fsdp"]["frozen_weights"] == frozen // 2
    assert plan["per_gpu_bytes"]["ddp"]["trainable_weights"] == 4 * plan["trainable_params"]


def test_memory_cli_real_configs_offline(capsys):
    """The real configs resolve offline to the architectures tools.speed_real builds: Gemma 3 4B (4,300,079,472
    parameters, as published for google/gemma-3-4b-it) + the Wan 2.1 VAE + the projector."""
    from theworld.model.arch import REAL
    from tools import memory_plan as memory

    assert memory.main(["--config", str(ROOT / "configs" / "real" / "stage3.yaml"), "--gpus", "8", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    h = REAL["text"]["hidden_size"]
    projector = 16 * h + h + h * h + h + 2 * h
    vae = p["total_params"] - p["trainable_params"]  # stage 3: the VAE is the frozen part
    assert p["total_params"] - vae - projector == 4_300_079_472
    assert set(p["per_gpu_bytes"]) == {"ddp", "fsdp", "fsdp_offload"} and not p["fits"]["ddp"] and p["fits"]["fsdp"]
    ddp, fsdp, offload = (p["per_gpu_bytes"][k] for k in ("ddp", "fsdp", "fsdp_offload"))
    assert fsdp["optimizer_state"] == ddp["optimizer_state"] // 8
    # offload: the GPU keeps gathered units and activations; each process's host holds its eighth of every weight
    # (fp32 trainable, frozen in model.dtype), gradient and both AdamW moments: 16 bytes per trainable parameter
    assert offload["optimizer_state"] == offload["gradients"] == offload["trainable_weights"] == 0
    assert offload["total"] == fsdp["working_buffers"] + fsdp["activations"]
    whole = 16 * p["trainable_params"] + ddp["frozen_weights"]
    assert whole / 8 <= p["host_bytes_per_process"]["fsdp_offload"] <= whole / 8 * 1.05
    assert p["config"]["micro_batch_size"] == 8  # the config's `auto` as a run on 8 processes resolves it
    assert memory.main(["--config", str(ROOT / "configs" / "real" / "stage3.yaml")]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "optimizer_state" in out and "fsdp_offload" in out
    assert memory.main(["--config", str(ROOT / "configs" / "stage3.yaml"), "--gpus", "0"]) == 2
    assert (
        memory.main(["--config", str(ROOT / "configs" / "stage3.yaml"), "--set", "model.gemma=google/gemma-3-27b-it"])
        == 2
    )
    assert "model.gemma" in capsys.readouterr().err


MEASURE = """
import gc, json, sys, torch
torch.set_num_threads(1)
from theworld.core.config import load_config
from tools import memory_plan as memory
from train import optim
from tools.speed_real import batch
from train.config import TrainConfig

def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

def steps(cfg, sizes, n):
    model = memory.build_world(cfg, "cpu").train()
    opt = optim.build_optimizer(cfg.train.optimizer, model)
    x = batch(sizes, cfg.train.micro_batch_size, torch.device("cpu"))
    for _ in range(n):
        model(x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

sizes, warm, target = json.loads(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split()
steps(load_config(TrainConfig, None, warm), {**sizes, "text": {**sizes["text"], "num_hidden_layers": 1}}, 1)
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # peak RSS starts again from here: every kernel library is loaded
base = status("VmRSS")
steps(load_config(TrainConfig, None, target), sizes, 2)  # the second step runs with the optimiser state in place
print(json.dumps({"peak_delta": status("VmHWM") - base}))
"""


@pytest.mark.slow
def test_memory_estimate_matches_peak_rss_of_a_small_model(tmp_path):
    """The plan's one-process ddp total against the measured peak resident memory of two training steps (language
    model training, about 25 M trainable parameters on the CPU): within 15%."""
    from theworld.core.config import load_config
    from theworld.model.arch import TINY, gemma_config
    from tools import memory_plan as memory
    from train.config import TrainConfig

    text = dict(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        sliding_window=64,
        vocab_size=16384,
        query_pre_attn_scalar=128,
    )
    sizes = {**TINY, "text": text}
    for name, s in (("warm", {**sizes, "text": {**text, "num_hidden_layers": 1}}), ("gemma", sizes)):
        gemma_config(s).save_pretrained(tmp_path / name)
    common = [
        "model.vae=tiny",
        "model.dtype=float32",
        "freeze.language=false",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "image.resolution=64",
    ]
    warm, target = common + [f"model.gemma={tmp_path / 'warm'}"], common + [f"model.gemma={tmp_path / 'gemma'}"]
    r = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(sizes), " ".join(warm), " ".join(target)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    measured = json.loads(r.stdout.strip().splitlines()[-1])["peak_delta"]
    cfg = load_config(TrainConfig, None, target)
    model = memory.build_world(cfg)
    c = memory.count(model)
    assert c.trainable > 20_000_000
    estimate = memory.per_gpu(cfg, model, c, gpus=1, micro=4, foreach=False)["ddp"]["total"]
    print(f"peak RSS delta {measured / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB")
    assert math.isclose(measured, estimate, rel_tol=0.15), (measured, estimate)
