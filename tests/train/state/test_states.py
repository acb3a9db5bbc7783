"""The parts of a run's state: which parts a checkpoint holds and in what order, and that each part's state_dict
loads back into what it was taken from (weights, optimizer, EMA, RNG), with the config's learning-rate multipliers
winning over the checkpoint's, and LoopState's fields each in exactly one record."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import train_config
from theworld.core.errors import UserError
from theworld.model import stage_layout as layout
from train import components
from train.config import run_hash
from train.state import migrations, states
from train.step import LoopState


@pytest.fixture(scope="module")
def built():
    """Tiny components with an EMA, after one optimiser step (so AdamW holds state)."""
    cfg = train_config("model.dtype=float32", "train.optimizer.ema=0.5")
    c = components.build(cfg, components.make_accelerator(cfg), 1)
    for p in c.params:
        p.grad = torch.ones_like(p)
    c.optimizer.step()
    return c


def test_a_checkpoint_holds_its_parts_in_the_saved_order(built, tmp_path):
    parts = states.run_states(built, LoopState(), 10, None)
    assert [type(p).__name__ for p in parts] == [
        "Trainables", "Optimizer", "Ema", "Rng", "RunConfig",
        "LoopFields", "LoopFields", "LoopFields", "LoopFields", "DataOrder", "RunRecord",
    ]  # fmt: skip
    assert [p.file for p in parts[:5]] == [layout.WEIGHTS, layout.OPTIMIZER, layout.EMA, layout.RNG, layout.CONFIG]
    assert all(p.file == layout.STATE for p in parts[5:])
    weights_only = states.run_states(built, LoopState(), 10, None, optimizer=False, source=tmp_path)
    assert "Optimizer" not in [type(p).__name__ for p in weights_only] and weights_only[0].where == str(
        tmp_path / layout.WEIGHTS
    )


def test_loop_states_fields_are_each_in_exactly_one_record():
    records = states.SCHEDULE + states.PROGRESS + states.PLATEAU + states.TRACKERS
    assert sorted(records) == sorted(f.name for f in dataclasses.fields(LoopState)) and len(set(records)) == len(
        records
    )
    state = LoopState(step=3, samples_seen=48)
    progress = states.LoopFields(state, states.PROGRESS)
    saved = progress.state_dict()
    assert saved["samples_seen"] == 48 and "step" not in saved
    back = LoopState(samples_seen=1, nonfinite_steps=9)
    states.LoopFields(back, states.PROGRESS).load_state_dict({"samples_seen": 48})  # an older checkpoint's record
    assert back.samples_seen == 48 and back.nonfinite_steps == 0


def test_the_weights_and_the_ema_load_back_by_name(built):
    weights, ema = states.Trainables(built), states.Ema(built)
    # unsharded, the parts hand out the live tensors (the checkpointer writes them at once): keep copies
    saved_w = {n: t.clone() for n, t in weights.state_dict().items()}
    saved_e = {n: t.clone() for n, t in ema.state_dict().items()}
    assert list(saved_w) == [n for n, p in built.raw.named_parameters() if p.requires_grad] == list(saved_e)
    before = [p.detach().clone() for p in built.params]
    with torch.no_grad():
        for p, e in zip(built.params, built.ema):
            p.add_(1.0)
            e.mul_(0.0)
    weights.load_state_dict(saved_w)
    ema.load_state_dict(saved_e)
    assert all(torch.equal(p, b) for p, b in zip(built.params, before))
    assert all(torch.equal(e, saved_e[n]) for e, n in zip(built.ema, saved_e))
    with pytest.raises(UserError, match=r"^the/file: weights do not match the trainable set"):
        states.Trainables(built, "the/file").load_state_dict(dict(list(saved_w.items())[1:]))


def test_the_optimizer_loads_back_and_keeps_the_configs_lr_multipliers(built):
    part = states.Optimizer(built)
    saved = part.state_dict()
    saved["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in saved["state"].items()}
    steps = {i: st["step"] for i, st in saved["state"].items()}
    assert steps and all(float(s) == 1.0 for s in steps.values())
    for g in saved["param_groups"]:
        g["lr_multiplier"] = 123.0  # a checkpoint written under other multipliers
    for st in built.optimizer.state.values():
        st["exp_avg"].zero_()
    part.load_state_dict(saved)
    again = part.state_dict()
    assert all(torch.equal(again["state"][i]["exp_avg"], saved["state"][i]["exp_avg"]) for i in saved["state"])
    want = built.cfg.train.optimizer.lr_multipliers
    groups = built.optimizer.param_groups
    assert groups and all(g["lr_multiplier"] == getattr(want, g["part"]) != 123.0 for g in groups)


def test_the_rng_resumes_where_it_was():
    rng = states.Rng()
    saved = rng.state_dict()
    first = torch.rand(3)
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(3), first)


def test_the_records_say_where_the_data_order_is_and_what_wrote_the_checkpoint(built):
    order = states.DataOrder(LoopState(step=7), steps_per_epoch=3, cache={"id": "c"})
    assert order.state_dict() == {"epoch": 2, "data_cursor": {"epoch": 2, "batch_in_epoch": 1}, "cache": {"id": "c"}}
    record = states.RunRecord(built.cfg, 2).state_dict()
    assert record == {
        "config_hash": run_hash(built.cfg),
        "num_processes": 2,
        "format_version": migrations.FORMAT_VERSION,
    }
    assert "global_batch_size" in states.RunConfig(built.cfg).state_dict()["text"]
