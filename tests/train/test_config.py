"""train.config: settings that would do nothing, or something else than they say, are refused in one line."""

from __future__ import annotations

import pytest

from theworld.core.config import load_config
from theworld.core.errors import UserError
from train.config import TrainConfig


@pytest.mark.parametrize(
    "sets",
    [
        ["train.hardware.activation_checkpointing.parts=[]"],
        ["train.hardware.activation_checkpointing={mode: selective, every_n: 3, parts: []}"],
    ],
)
def test_activation_checkpointing_of_no_part_is_refused_naming_the_way_out(sets):
    with pytest.raises(UserError) as e:
        load_config(TrainConfig, None, sets)
    line = str(e.value)
    assert "'train.hardware.activation_checkpointing.parts': []" in line and "checkpoints nothing" in line
    assert "use mode none" in line and "\n" not in line


def test_no_part_with_mode_none_says_the_same_thing_twice_and_loads():
    cfg = load_config(TrainConfig, None, ["train.hardware.activation_checkpointing={mode: none, parts: []}"])
    assert not any(cfg.train.hardware.activation_checkpointing.wraps(p) for p in ("language", "vision", "vae"))
