"""train.epochs and the per-part parameter counts of the start line (train.optimizer.ema_warmup_steps:
tests/train/test_step.py)."""

from __future__ import annotations

import pytest

from theworld.core.config import load_config
from theworld.core.errors import UserError
from train.config import TrainConfig
from train.data.order import total_steps


def train_section(**sets):
    return load_config(TrainConfig, None, [f"train.{k}={v}" for k, v in sets.items()]).train


def test_epochs_set_the_number_of_steps_and_win_over_max_steps():
    assert total_steps(train_section(max_steps=7), per_epoch=5) == 7
    assert total_steps(train_section(epochs=0.5), per_epoch=5) == 3  # 2.5 rounded up
    assert total_steps(train_section(epochs=2, max_steps=7), per_epoch=5) == 10
    assert total_steps(train_section(epochs=0.1), per_epoch=30) == 3  # not 4 from 3.0000000000000004
    assert total_steps(train_section(epochs=0.01), per_epoch=5) == 1


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_bad_epochs_are_refused_naming_the_key(value):
    with pytest.raises(UserError, match="train.epochs"):
        train_section(epochs=value)


def test_parameter_counts_per_part_with_an_adapter_hook():
    import torch

    from train import params

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.projector = torch.nn.Linear(10, 10)  # 110
            self.gemma = torch.nn.Module()
            self.gemma.lm_head = torch.nn.Linear(1000, 1000, bias=False)  # 1.0 M, frozen
            self.gemma.lm_head.lora_A = torch.nn.Linear(1000, 4, bias=False)  # 4000, trainable adapter (peft: .lora_A.)
            self.gemma.lm_head.weight.requires_grad_(False)

    counts = params.part_counts(Tiny())
    assert counts["projector"] == {"trainable": 110, "total": 110, "adapter": 0}
    assert counts["language"] == {"trainable": 4000, "total": 1_004_000, "adapter": 4000}
    assert (
        params.describe(Tiny())
        == "parameters trainable / total: projector 110 / 110, language 4.0 k / 1.0 M (LoRA 4.0 k)"
    )
