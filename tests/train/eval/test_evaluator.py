"""The evaluator loop (train/eval/evaluator.py) logs what the three branches of Trainer.run_eval logged before it:
the session's trained run's caption, held-out and benchmark lines equal those the same run wrote at commit bc186e9
(tests/data/eval_lines_trained_run.jsonl, written by that commit's code with conftest's trained_run settings)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import (
    ROOT,
    base_args,
    metrics,
    train_inproc,
)

GOLDEN = ROOT / "tests" / "data" / "eval_lines_trained_run.jsonl"


def _eval_lines(lines: list[dict]) -> list[dict]:
    return [m for m in lines if "eval_loss" in m or "samples" in m or any(k.startswith("bench/") for k in m)]


def test_the_evaluator_loop_logs_the_lines_the_three_branches_logged(trained_run):
    before = [json.loads(line) for line in GOLDEN.read_text().splitlines()]
    now = _eval_lines(metrics(trained_run["run"]))
    assert [list(m) for m in now] == [list(m) for m in before]  # the same lines, keys in the same order
    # The golden lines were written on one CPU; another's kernels round a loss differently in its last float32
    # digits, and a gap (the difference of two losses) carries that as an absolute error.
    for a, b in zip(now, before):
        for k, v in b.items():
            assert a[k] == (pytest.approx(v, rel=1e-5, abs=1e-5) if isinstance(v, float) else v), (a["step"], k)


def test_one_eval_mode_for_every_evaluator():
    """TheWorld.evaluating: eval mode and the posterior mean inside, the caller's modes back after (also on error)."""
    from theworld.model.config import ModelConfig, WorldConfig
    from theworld.model.world import TheWorld

    model, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig())
    model.train()
    model.latent_mode = "sample"
    with pytest.raises(RuntimeError), model.evaluating():
        assert not model.training and model.latent_mode == "mean"
        raise RuntimeError
    assert model.training and model.latent_mode == "sample"
    with model.eval().evaluating(keep_mode=True):
        assert model.latent_mode == "mean" and not model.training
    assert model.latent_mode == "sample"


def test_eval_results_are_printed_as_they_happen(cache, tmp_path, capsys):
    assert train_inproc(base_args(cache, tmp_path / "run", steps=2, **{"train.eval.every": 1})) == 0
    err = capsys.readouterr().err
    evals = [m for m in metrics(tmp_path / "run") if "eval_loss" in m]
    for m in evals:
        assert (
            f"eval at step {m['step']}: eval_loss {m['eval_loss']:.4f}, eval_loss_shuffled_world "
            f"{m['eval_loss_shuffled_world']:.4f}"
        ) in err
    assert [m["step"] for m in evals] == [0, 1, 2]
