"""train/trainer.py: the run's checks before any model loads (Checked) and what it prints before its first step."""

from __future__ import annotations

import pytest

from tests.conftest import base_args, metrics, train_inproc


def test_train_epochs_sets_the_run_length_and_the_start_line_counts_parameters(cache, tmp_path, capsys):
    out = tmp_path / "half"
    # 80 training samples in global batches of 16: 5 steps per epoch, half an epoch rounded up is 3
    assert (
        train_inproc(
            base_args(
                cache,
                out,
                steps=50,
                **{"train.epochs": 0.5, "train.optimizer.ema": 0.9, "train.optimizer.ema_warmup_steps": 2},
            )
        )
        == 0
    )
    printed = capsys.readouterr()
    assert [m["step"] for m in metrics(out) if "loss" in m] == [1, 2, 3]
    assert "train.epochs 0.5: 3 steps of 5 per epoch" in printed.out + printed.err
    assert "parameters trainable / total: projector " in printed.out + printed.err


def _config(cache, out, **extra):
    from theworld.core.config import load_config
    from train.config import TrainConfig

    return load_config(TrainConfig, None, [a for a in base_args(cache, out, **extra) if a != "--set"])


def test_checked_settles_the_run_length_and_split_before_any_model_loads(cache, tmp_path):
    from train.trainer import Checked

    checked = Checked.of(_config(cache, tmp_path / "run", **{"train.epochs": 0.5}))
    assert checked.per_epoch == 5 and checked.cfg.train.max_steps == 3  # 80 train samples, batches of 16
    train, held = checked.split
    assert len(train) == 80 and len(held) == 16 and not set(train) & set(held)
    assert not (tmp_path / "run").exists()  # nothing written yet


def test_checked_refuses_init_from_weights_that_are_not_there(cache, tmp_path):
    from theworld.core.errors import UserError
    from train.trainer import Checked

    with pytest.raises(UserError, match="config key 'init_from': no weights at"):
        Checked.of(_config(cache, tmp_path / "run", init_from=tmp_path / "nothing"))
