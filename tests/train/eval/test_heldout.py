"""The held-out loss per split: train.eval.sets (named caches evaluated apart) and a `data:` mixture's caches
reported apart, on the same eval line as the run's own split."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import (
    base_args,
    metrics,
    run2,
    train_inproc,
)


def test_eval_sets_report_apart(cache, tmp_path):
    """A set holding the run's own held-out samples (same cache, same count: the same key-hash split) reports the
    run's own numbers; a set of the whole cache reports its own."""
    out = tmp_path / "run"
    sets = f"[{{name: same, cache: {cache}, samples: 16}}, {{name: whole, cache: {cache}}}]"
    assert train_inproc(base_args(cache, out, steps=1, **{"train.eval.sets": sets, "train.eval.captions": 0})) == 0
    (line,) = [m for m in metrics(out) if "eval_loss" in m]
    for k in ("eval_loss", "eval_loss_shuffled_world", "eval_gap", "eval_tokens"):
        assert line[f"same/{k}"] == line[k], k
    assert line["whole/eval_tokens"] > line["eval_tokens"] and line["whole/eval_loss"] != line["eval_loss"]
    assert list(line)[:5] == ["step", "eval_loss", "eval_loss_shuffled_world", "eval_gap", "eval_tokens"]


def test_a_set_with_a_bad_name_or_twice_the_same_name_is_one_line(cache, tmp_path):
    from theworld.core.errors import UserError
    from train.config import TrainConfig, load_config

    for sets, match in [
        ("[{name: a/b, cache: x}]", "must be non-empty, without '/'"),
        ("[{name: a, cache: x}, {name: a, cache: y}]", "two sets named 'a'"),
    ]:
        with pytest.raises(UserError, match=match):
            load_config(TrainConfig, None, [f"train.eval.sets={sets}"])


def _mixture_eval(cache: Path, tmp_path: Path, weight: str) -> dict:
    """The eval line of one step trained on `cache` and a copy of it named `other`, each of weight `weight`."""
    other = tmp_path / "other"
    shutil.copytree(cache, other)
    out = tmp_path / "run"
    data = f"[{{cache: {cache}, weight: {weight}}}, {{cache: {other}, weight: {weight}}}]"
    assert train_inproc(base_args(cache, out, steps=1, **{"data": data, "train.eval.captions": 0})[2:]) == 0
    (line,) = [m for m in metrics(out) if "eval_loss" in m]
    return line


def test_a_mixtures_caches_are_reported_apart(cache, tmp_path):
    """eval_loss (own world) is a sum over samples: the caches' losses, weighted by their answer tokens, give it."""
    line = _mixture_eval(cache, tmp_path, "1")
    a, b = (f"data/{cache.name}/", "data/other/")
    assert line[a + "eval_tokens"] + line[b + "eval_tokens"] == line["eval_tokens"]
    mixed = (line[a + "eval_loss"] * line[a + "eval_tokens"] + line[b + "eval_loss"] * line[b + "eval_tokens"]) / line[
        "eval_tokens"
    ]
    assert mixed == pytest.approx(line["eval_loss"], rel=1e-9)


def test_parts_of_one_dataset_are_evaluated_once_as_one(cache, tmp_path):
    """weight `samples`: the parts' held-out samples together, not again apart."""
    line = _mixture_eval(cache, tmp_path, "samples")
    assert line["eval_loss"] > 0 and not [k for k in line if k.startswith("data/")]


@pytest.mark.slow
def test_the_shuffled_world_eval_is_the_same_on_one_and_two_processes(cache, tmp_path):
    args = lambda out: base_args(
        cache, out, steps=1, **{"train.eval.every": 1, "train.eval.samples": 14, "train.eval.batch_size": 4}
    )
    assert train_inproc(args(tmp_path / "one")) == 0
    two = run2(args(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    e1 = [m for m in metrics(tmp_path / "one") if "eval_loss" in m]
    e2 = [m for m in metrics(tmp_path / "two") if "eval_loss" in m]
    assert [m["step"] for m in e1] == [m["step"] for m in e2] == [0, 1]
    for a, b in zip(e1, e2):  # 14 samples: 7 per process, batches of 4 and 3 vs 4, 4, 4, 2 on one
        assert a["eval_tokens"] == b["eval_tokens"]
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
        assert b["eval_loss_shuffled_world"] == pytest.approx(a["eval_loss_shuffled_world"], rel=1e-5)
        assert a["eval_loss_shuffled_world"] != pytest.approx(a["eval_loss"], rel=1e-4)  # worlds really swapped
