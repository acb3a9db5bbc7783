"""train/step.py: one optimisation step (non-finite steps skipped and counted) and the EMA (its warmup ramp, in
units and in a run's checkpoints)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import base_args, train_inproc
from theworld.core.config import load_config
from theworld.core.errors import UserError
from train.config import TrainConfig
from train.step import LoopState, ema_decay


def test_nonfinite_loss_is_skipped_and_counted(cache, tmp_path):
    from theworld.core.config import load_config
    from train import components
    from train.config import TrainConfig
    from train.data import batches, loader
    from train.data import cache as data
    from train.step import LoopState, NonFiniteError, optimization_step

    cfg = load_config(
        TrainConfig, None, [a for a in base_args(cache, tmp_path / "run") if a != "--set"] + ["train.max_nonfinite=2"]
    )
    reader, plan = data.open_cache(cfg)
    acc = components.make_accelerator(cfg)
    c = components.build(cfg, acc, 2)
    ctx = loader.DataContext.build(cfg, reader, plan, c.processor)
    it = iter(loader.build_train_loader(cfg, ctx, 0, 1, epoch=0, start=0))
    good = [next(it), next(it)]
    inputs = good[0].to("cpu")
    mean = inputs.latent_mean.clone()
    mean[0, 0, 0, 0, 0] = float("nan")
    bad = [batches.Batch.of(inputs.with_inputs(latent_mean=mean)), good[1]]
    assert bad[0].num_tokens == good[0].num_tokens
    state = LoopState()
    before = {k: v.clone() for k, v in c.raw.trainable_state_dict().items()}
    out = optimization_step(c, state, bad)
    assert out["skipped"] and state.nonfinite_steps == 1 and state.step == 1
    assert all(torch.equal(before[k], v) for k, v in c.raw.trainable_state_dict().items())
    out = optimization_step(c, state, good)  # a good step resets the run of non-finite ones
    assert not out["skipped"] and state.nonfinite_in_a_row == 0 and state.nonfinite_steps == 1
    assert not all(torch.equal(before[k], v) for k, v in c.raw.trainable_state_dict().items())
    optimization_step(c, state, bad)
    with pytest.raises(NonFiniteError, match="2 non-finite steps in a row"):
        optimization_step(c, state, bad)
    assert state.nonfinite_steps == 3


def test_the_trained_ema_follows_the_warmup_ramp(cache, tmp_path):
    """A checkpoint after every step holds the weights w_s and the EMA e_s of steps 1..5. With train.optimizer.ema 0.9
    ramped over 3 steps the decays after steps 1..5 are 0, 0.3, 0.6, 0.9, 0.9: e_1 = w_1, then e_s = d_s e_(s-1) + (1 -
    d_s) w_s. Without the ramp e_1 would keep 90% of the initial weights."""
    out = tmp_path / "run"
    sets = {
        "train.optimizer.ema": 0.9,
        "train.optimizer.ema_warmup_steps": 3,
        "train.checkpoint.every": 1,
        "train.checkpoint.keep_last": 5,
    }
    assert train_inproc(base_args(cache, out, steps=5, **sets, **{"train.lr_schedule.warmup_steps": 0})) == 0
    saved = {s: out / f"checkpoint-{s}" for s in range(1, 6)}
    w = {s: load_file(str(d / "trainable.safetensors")) for s, d in saved.items()}
    e = {s: load_file(str(d / "ema.safetensors")) for s, d in saved.items()}
    assert w[1].keys() == e[1].keys() and any(not torch.equal(w[1][k], w[2][k]) for k in w[1])  # the weights move
    expected = {}
    for s, decay in zip(range(1, 6), [0.0, 0.3, 0.6, 0.9, 0.9]):
        expected = {k: decay * expected.get(k, 0.0) + (1 - decay) * v for k, v in w[s].items()}
        for k in expected:
            torch.testing.assert_close(e[s][k], expected[k], rtol=1e-5, atol=1e-6, msg=f"step {s}: {k}")
    assert any(not torch.allclose(e[5][k], w[5][k]) for k in w[5])  # an average, not the last weights


def test_ema_warmup_ramps_the_decay_up_from_zero():
    assert [ema_decay(0.9, 4, s) for s in range(6)] == pytest.approx([0, 0.225, 0.45, 0.675, 0.9, 0.9])
    assert ema_decay(0.9, 0, 0) == 0.9
    with pytest.raises(UserError, match="train.optimizer.ema_warmup_steps"):
        load_config(TrainConfig, None, ["train.optimizer.ema_warmup_steps=-1"])


def test_a_loop_state_read_back_takes_the_fields_it_knows_and_defaults_for_the_rest():
    saved = {"step": 7, "samples_seen": 112, "plateau_step": 6, "epoch": 1, "sha256": {}}  # and other records' keys
    state = LoopState.from_json(saved)
    assert (state.step, state.samples_seen, state.plateau_step) == (7, 112, 6)
    assert state.history == [] and state.wandb_run_id is None and state.last_eval is None
    assert LoopState.from_json(state.to_json()) == state
