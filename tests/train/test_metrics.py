"""train.metrics: where the trackers write."""

from __future__ import annotations

import pytest

from tests.conftest import base_args, train_inproc


@pytest.mark.slow
def test_wandb_files_go_under_wandb_dir_when_the_user_set_it_and_under_output_dir_otherwise(
    cache, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(scratch))
    out = tmp_path / "run"
    assert train_inproc(base_args(cache, out, steps=1, trackers="[wandb]", **{"wandb.project": "p"})) == 0
    assert len(list((scratch / "wandb").glob("offline-run-*"))) == 1 and not (out / "wandb").exists()
    monkeypatch.delenv("WANDB_DIR")
    other = tmp_path / "run2"
    assert train_inproc(base_args(cache, other, steps=1, trackers="[wandb]", **{"wandb.project": "p"})) == 0
    assert len(list((other / "wandb").glob("offline-run-*"))) == 1
    assert len(list((scratch / "wandb").glob("offline-run-*"))) == 1
