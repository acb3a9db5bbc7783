"""train.checkpoint.keep_best: the checkpoint with the best metric in metrics.jsonl stays beside the last ones, is
named in the model card, and stays the same across a resume (it is read from the log, which the resume continues)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import base_args, metrics, train_inproc


def _best_step(out: Path, steps: list[int]) -> int:
    """The step among `steps` with the largest eval_loss in metrics.jsonl (mode max), by the log itself."""
    evals = {m["step"]: m["eval_loss"] for m in metrics(out) if "eval_loss" in m}
    return max(steps, key=lambda s: (evals[s], -s))


def test_keep_best_keeps_the_step_with_the_best_metric_and_survives_a_resume(cache, tmp_path, capsys):
    out = tmp_path / "run"
    sets = {
        "train.eval.every": 1,
        "train.eval.captions": 0,
        "train.checkpoint.every": 1,
        "train.checkpoint.keep_last": 1,
        "train.checkpoint.keep_best": "{metric: eval_loss, mode: max}",  # max: an early step wins, not the last
    }
    assert train_inproc(base_args(cache, out, steps=3, **sets)) == 0
    best = _best_step(out, [1, 2, 3])
    assert best != 3
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted({f"checkpoint-{best}", "checkpoint-3"})
    assert f"best checkpoint by eval_loss (max): `checkpoint-{best}`" in (out / "final" / "README.md").read_text()
    # resumed to step 5: the best over every step's checkpoint so far is still there, the others beyond keep_last not
    assert train_inproc(base_args(cache, out, steps=5, **sets)) == 0
    assert "resumed from" in capsys.readouterr().err
    again = _best_step(out, [1, 2, 3, 4, 5])
    assert again == best  # the loss falls: the first checkpoint stays the best by max
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted({f"checkpoint-{best}", "checkpoint-5"})
    assert f"`checkpoint-{best}`" in (out / "final" / "README.md").read_text()


def test_without_keep_best_keep_last_alone_decides(cache, tmp_path):
    out = tmp_path / "run"
    sets = {"train.eval.every": 1, "train.eval.captions": 0, "train.checkpoint.every": 1}
    assert train_inproc(base_args(cache, out, steps=3, **{**sets, "train.checkpoint.keep_last": 1})) == 0
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-3"]
    assert "best checkpoint" not in (out / "final" / "README.md").read_text()
