"""train.loop --plan (train/plan.py): the run's steps, tokens and trainable parameters before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import base_args
from train.loop import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_plan_counts_the_cache_it_would_train_on(cache, tmp_path, capsys):
    """96 samples, 16 held out: 80 / 16 = 5 steps per epoch, 2 epochs; the tiny stage 1's projector share."""
    args = base_args(cache, tmp_path / "run") + ["--set", "train.epochs=2", "--plan"]
    assert main(["--config", str(CONFIGS / "stage1.yaml"), *args]) == 0
    out = capsys.readouterr().out
    assert "samples: 96 (16 held out for eval, 80 trained on)" in out
    assert "optimizer steps: 10 (5 per epoch of 16 samples, 2.00 epochs, 160 samples seen)" in out
    assert "trainable: 18.9k trainable (2.05%) of 925.0k" in out
    assert not (tmp_path / "run").exists()  # a plan starts nothing


@pytest.mark.parametrize("weight, held, steps", [("1", 32, 10), ("samples", 16, 11)])
def test_plan_of_a_mixture_holds_eval_samples_out_of_each_cache_or_of_one_dataset(
    cache, tmp_path, capsys, weight, held, steps
):
    """Two caches of 96: 16 held out of each by weight; of the two as one dataset in parts (weight samples)."""
    import shutil

    other = tmp_path / "copy"
    shutil.copytree(cache, other)
    sets = base_args(cache, tmp_path / "run")
    args = [x for f, v in zip(sets[::2], sets[1::2]) if not v.startswith("cache_dir=") for x in (f, v)]
    data = f"data=[{{cache: {cache}, weight: {weight}}}, {{cache: {other}, weight: {weight}}}]"
    assert main(["--config", str(CONFIGS / "stage1.yaml"), *args, "--set", data, "--plan"]) == 0
    out = capsys.readouterr().out
    assert f"samples: 192 ({held} held out for eval, {192 - held} trained on)" in out
    assert f"{steps} per epoch of 16 samples" in out


def test_plan_reports_the_trainable_share_as_the_plan_does(capsys):
    """configs/real/stage1.yaml: the world projector alone, 6.6M of Gemma 3 4B + the Wan VAE (4.43B), 0.15%."""
    assert main(["--config", str(CONFIGS / "real" / "stage1.yaml"), "--plan", "--samples", "100000"]) == 0
    out = capsys.readouterr().out
    assert "trainable: 6.6M trainable (0.15%) of 4.43B" in out
    assert "optimizer steps: 20,000" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--samples", "0"], "--samples must be >= 1"),
        (["--gpus", "0"], "--gpus must be >= 1"),
        ([], "no finished cache at"),
    ],
)
def test_plan_refuses_in_one_line(tmp_path, capsys, extra, message):
    args = ["--set", f"cache_dir={tmp_path / 'none'}", "--plan", *extra]
    assert main(["--config", str(CONFIGS / "stage1.yaml"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
