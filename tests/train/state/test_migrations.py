"""Checkpoints of format_version 1 (no version in state.json) resume; a version this code does not know is one line
naming it (train/state/migrations.py). The optimiser re-keying of version-1 state is checked bitwise by
tests/train/test_sharding.py (test_checkpoint_with_one_adamw_group_per_decay_setting_resumes_exactly)."""

from __future__ import annotations

import json

import pytest

from theworld.core.errors import UserError
from train.state import checkpoint
from train.state import migrations as checkpoint_migrations


def _ckpt(tmp_path, state: dict):
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "trainable.safetensors").write_bytes(b"weights")
    (ckpt / "state.json").write_text(json.dumps(state))
    return ckpt


def test_new_checkpoints_record_the_current_version():
    from train.config import TrainConfig
    from train.state.states import RunRecord

    assert RunRecord(TrainConfig(), 1).state_dict()["format_version"] == checkpoint_migrations.FORMAT_VERSION


def test_a_version_1_checkpoint_without_digests_is_taken_as_it_is(tmp_path):
    state = checkpoint.check_resumable(_ckpt(tmp_path, {"step": 3}), max_steps=10)
    assert state["step"] == 3 and state["sha256"] == {}


@pytest.mark.parametrize("version", [4, "2", None])
def test_an_unknown_checkpoint_version_is_refused_naming_it(tmp_path, version):
    with pytest.raises(UserError, match=f"format_version {version!r}, this code reads 1, 2, 3"):
        checkpoint.check_resumable(_ckpt(tmp_path, {"step": 3, "format_version": version}), max_steps=10)


def test_optimizer_state_in_the_current_layout_is_kept():
    saved = {"state": {}, "param_groups": [{"part": "projector", "params": [0]}]}
    assert checkpoint_migrations.optimizer(None, saved) is saved
