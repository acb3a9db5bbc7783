"""Packed and length-grouped training runs (train.loader.packing, train.loader.group_by_length): a packed run trains on
the same samples as the plain one, its loss curve and eval losses equal within 1e-4, and both kinds resume bitwise."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import base_args, metrics, train_inproc, weights

STAGE3 = {"freeze.language": "false", "train.eval.every": 2, "train.eval.captions": 0, "train.checkpoint.every": 2}
PACKED = {"train.loader.packing": "true", "train.loader.pack_length": 400}


def _losses(run) -> list[float]:
    return [m["loss"] for m in metrics(run) if "loss" in m]


def _resumes_bitwise(cache, ref, tmp_path, extra) -> None:
    """`ref` (a finished 4-step run) continued from its checkpoint-2 ends with the same weights and losses."""
    resumed = tmp_path / f"{ref.name}-resumed"
    shutil.copytree(ref, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoint-4")
    assert train_inproc(base_args(cache, resumed, **extra)) == 0
    a, b = weights(ref), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(resumed) == _losses(ref)


@pytest.fixture(scope="module")
def plain_run(cache, tmp_path_factory):
    """The plain 4-step run both tests compare with (read only)."""
    out = tmp_path_factory.mktemp("plain") / "run"
    assert train_inproc(base_args(cache, out, **STAGE3)) == 0
    return out


@pytest.mark.slow
def test_a_packed_run_follows_the_plain_run_and_resumes_bitwise(cache, plain_run, tmp_path):
    assert train_inproc(base_args(cache, tmp_path / "packed", **STAGE3, **PACKED)) == 0
    plain, packed = metrics(plain_run), metrics(tmp_path / "packed")
    assert len(_losses(tmp_path / "packed")) == 4
    assert _losses(tmp_path / "packed") == pytest.approx(_losses(plain_run), abs=1e-4)
    evals = [
        [(m["eval_loss"], m["eval_loss_shuffled_world"], m["eval_tokens"]) for m in r if "eval_loss" in m]
        for r in (plain, packed)
    ]
    assert len(evals[1]) == 3 and [e[2] for e in evals[0]] == [e[2] for e in evals[1]]
    assert [x for e in evals[1] for x in e[:2]] == pytest.approx([x for e in evals[0] for x in e[:2]], abs=1e-4)
    _resumes_bitwise(cache, tmp_path / "packed", tmp_path, {**STAGE3, **PACKED})


@pytest.mark.slow
def test_a_length_grouped_run_resumes_bitwise(cache, plain_run, tmp_path):
    grouped = {**STAGE3, "train.loader.group_by_length": "true", "train.loader.group_window": 2}
    assert train_inproc(base_args(cache, tmp_path / "grouped", **grouped)) == 0
    assert _losses(tmp_path / "grouped") != _losses(plain_run)  # other samples together
    _resumes_bitwise(cache, tmp_path / "grouped", tmp_path, grouped)
