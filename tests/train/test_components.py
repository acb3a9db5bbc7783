"""What a run trains with: the launch values resolved once (micro-batch, accumulation, sharding), a kernel this
machine cannot run refused before anything loads, and the built components (trainable fp32 parameters in a fixed
order, the EMA beside them, checkpointing and attention as configured)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import train_config
from theworld.core.errors import UserError
from theworld.model import recompute
from train import components
from train.optim import lr_factor


@pytest.mark.parametrize(
    ("world_size", "sets", "micro", "accum"),
    [
        (None, ("train.global_batch_size=16",), 16, 1),  # auto: the largest micro-batch that fits
        (None, ("train.global_batch_size=16", "train.micro_batch_size=4"), 4, 4),
        ("2", ("train.global_batch_size=16", "train.max_micro_batch_size=4"), 4, 2),
    ],
)
def test_the_launch_resolves_micro_batch_and_accumulation_for_the_launched_processes(
    monkeypatch, world_size, sets, micro, accum
):
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    cfg = train_config(*sets)
    launch = components.resolve_launch(cfg)
    assert launch.processes == int(world_size or 1) and launch.accum == accum
    assert cfg.train.hardware.sharding == launch.sharding.mode == "ddp"
    assert cfg.train.global_batch_size == micro * accum * launch.processes


def test_a_kernel_this_machine_cannot_run_is_refused_before_anything_loads():
    cfg = train_config("train.hardware.attention=flex_attention")
    if torch.cuda.is_available():  # a GPU machine runs it
        assert components.resolve_launch(cfg).processes >= 1
        return
    with pytest.raises(UserError, match="config key 'train.hardware.attention': flex_attention needs a CUDA GPU"):
        components.resolve_launch(cfg)
    components.check_attention("sdpa")
    components.check_attention("eager")


def test_build_trains_the_trainable_parameters_in_fp32_with_the_ema_beside_them(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = train_config(
        "model.dtype=bfloat16",
        "train.optimizer.ema=0.5",
        "train.hardware.attention=eager",
        "train.hardware.activation_checkpointing=full",
        "train.max_steps=10",
    )
    launch = components.resolve_launch(cfg)
    c = components.build(cfg, components.make_accelerator(cfg, launch), launch.accum)
    trainable = [p for p in c.raw.parameters() if p.requires_grad]
    assert len(c.params) == len(trainable) and all(a is b for a, b in zip(c.params, trainable))
    assert all(p.dtype == torch.float32 for p in c.params)
    assert {p.dtype for p in c.raw.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert all(torch.equal(e, p) and e.data_ptr() != p.data_ptr() for e, p in zip(c.ema, c.params))
    assert (c.rank, c.world_size, c.sharded, c.sharding) == (0, 1, False, "sharding ddp (1 process)")
    want = lr_factor(cfg.train.lr_schedule, 10)
    assert [c.lr_fn(s) for s in (0, 5, 10)] == [want(s) for s in (0, 5, 10)]
    assert c.raw.training and c.raw.gemma.config.text_config._attn_implementation == "eager"
    assert all(layer.gradient_checkpointing for layer in recompute.stacks(c.raw)["language"])
    assert {id(g["params"][0]) for g in c.optimizer.param_groups} <= {id(p) for p in c.params}
    assert components.build(cfg, c.accelerator, 1, (c.raw, None)).ema is not None  # a model built elsewhere
    cfg.train.optimizer.ema = 0.0
    assert components.build(cfg, c.accelerator, 1, (c.raw, None)).ema is None
