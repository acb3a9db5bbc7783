"""train.eval.plateau.min_steps: a plateau (and a stop on it) is held back until that step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.conftest import base_args, metrics
from train.config import PlateauConfig
from train.eval import plateau


def test_record_holds_the_plateau_step_back_until_min_steps():
    state = SimpleNamespace(step=0, eval_history=[], plateau_step=None)
    cfg = PlateauConfig(window_evals=1, min_improvement=0.01, min_steps=3)
    flat = []
    for step, loss in [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0)]:
        state.step = step
        flat.append(plateau.record(state, cfg, 1, 100, loss)["plateaued"])
    assert flat == [False, True, True, True]  # reported flat from step 1 on ...
    assert state.plateau_step == 3  # ... but a plateau only from min_steps


def test_min_steps_holds_a_plateau_stop_back(trained_run, tmp_path, capsys):
    """min_improvement 10: every eval from step 1 on is flat; without min_steps the run stops at step 1
    (tests/train/eval/test_samples.py), with min_steps 3 it trains on to step 3 and stops there."""
    from train.loop import main

    out = tmp_path / "run"
    sets = {
        "train.eval.plateau.window_evals": 1,
        "train.eval.plateau.min_improvement": 10,
        "train.eval.plateau.min_steps": 3,
        "train.eval.stop_on_plateau": "true",
        "train.global_batch_size": 8,
        "train.eval.samples": 8,
        "train.eval.every": 1,
        "train.eval.captions": 0,
        "train.checkpoint.every": 1,
        "train.lr_schedule.warmup_steps": 1,
    }
    assert main(base_args(trained_run["cache"], out, steps=4, **sets)) == 0
    evals = [e for e in metrics(out) if "eval_loss" in e]
    assert [(e["step"], e["plateaued"]) for e in evals] == [(0, False), (1, True), (2, True), (3, True)]
    assert max(e["step"] for e in metrics(out) if "loss" in e) == 3  # step 4 never trained
    assert json.loads((out / "checkpoint-3" / "state.json").read_text())["plateau_step"] == 3
    assert "plateaued at step 3" in (out / "final" / "README.md").read_text()
    assert "stopping: train.eval.stop_on_plateau" in capsys.readouterr().err


def test_the_default_window_is_the_guides_5000_steps_or_a_quarter_of_a_shorter_run():
    assert plateau.window_evals(0, eval_every=500, max_steps=100_000) == 10  # 5,000 steps
    assert plateau.window_evals(0, eval_every=250, max_steps=4000) == 4  # the last 1,000 of 4,000 steps
    assert plateau.window_evals(0, eval_every=250, max_steps=1000) == 2  # never fewer than two evals
    assert plateau.window_evals(0, eval_every=0, max_steps=1000) == 0  # evals only at the end: never judged
    assert plateau.window_evals(3, eval_every=0, max_steps=1000) == 3


@pytest.mark.parametrize(
    "losses,window,flat",
    [
        ([2.0, 1.5, 1.2, 1.0], 2, False),  # 1.5 -> 1.0: 33% better
        ([2.0, 1.0, 0.999, 0.995], 2, True),  # 0.5% better than 1.0 over the last two evals
        ([2.0, 1.0, 1.01, 1.02], 2, True),  # worse
        ([2.0, 1.0], 2, False),  # too short to judge
        ([1.0, 0.995], 1, True),
    ],
)
def test_plateaued_is_less_than_min_improvement_over_the_window(losses, window, flat):
    assert plateau.plateaued(losses, window, 0.01) is flat


def test_record_keeps_one_entry_per_step_and_the_first_plateau_step():
    state = SimpleNamespace(step=0, eval_history=[], plateau_step=None)
    cfg = PlateauConfig(window_evals=1, min_improvement=0.01)
    for step, loss in [(0, 2.0), (1, 1.0), (2, 0.999), (2, 0.999), (3, 0.5), (4, 0.499)]:
        state.step = step
        out = plateau.record(state, cfg, 1, 100, loss)
    assert [s for s, _ in state.eval_history] == [0, 1, 2, 3, 4]
    assert state.plateau_step == 2 and out["plateaued"] is True
    assert out["plateau_improvement"] == pytest.approx(0.002)


def test_plateau_config_is_checked():
    from theworld.core.errors import UserError

    with pytest.raises(UserError, match="train.eval.plateau.window_evals"):
        PlateauConfig(window_evals=-1)
    with pytest.raises(UserError, match="train.eval.plateau.min_improvement"):
        PlateauConfig(min_improvement=float("nan"))
