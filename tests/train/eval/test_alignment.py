"""train.eval.alignment: world tokens' norms, nearest-vocabulary cosine and effective rank at every eval, and the PCA
picture train.report draws."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import base_args, metrics, train_inproc
from train.eval import alignment


def test_stats_measure_world_vectors_against_the_vocabulary():
    vocab = torch.eye(4, 8) * 3.0  # four rows along the first four axes, norm 3
    on = alignment.stats(vocab[:2] * 2.0, vocab)  # along two rows: cosine 1, norm 6
    assert on["align/nearest_cosine"] == pytest.approx(1.0) and on["align/world_norm"] == pytest.approx(6.0)
    assert on["align/vocab_norm"] == pytest.approx(3.0)
    off = alignment.stats(torch.eye(8)[4:] * 5.0, vocab)  # orthogonal to every row
    assert off["align/nearest_cosine"] == pytest.approx(0.0, abs=1e-6)
    assert off["align/rank"] == pytest.approx(3.0, rel=1e-3)  # 4 orthogonal vectors, centred: 3 equal directions
    flat = alignment.pca(vocab[:2], vocab)
    assert len(flat["world"]) == 2 and len(flat["vocab"]) == 4 and all(len(p) == 2 for p in flat["world"])


def test_a_run_logs_alignment_at_every_eval_and_the_report_draws_it(cache, tmp_path):
    from train import report

    out = tmp_path / "run"
    sets = {"train.eval.alignment": "true", "train.eval.every": 1, "train.eval.captions": 0}
    assert train_inproc(base_args(cache, out, steps=1, **sets)) == 0
    lines = [m for m in metrics(out) if "align/world_norm" in m]
    assert [m["step"] for m in lines] == [0, 1]
    for m in lines:
        assert m["align/world_norm"] > 0 and -1 <= m["align/nearest_cosine"] <= 1 and m["align/rank"] >= 1
    pic = json.loads((out / "alignment" / "step-1.json").read_text())
    assert pic["step"] == 1 and 0 < len(pic["vocab"]) <= alignment.VOCAB_SAMPLE and pic["world"]
    assert all("align/world_norm" not in m for m in metrics(out) if "eval_loss" in m)  # its own line
    page = tmp_path / "report.html"
    assert report.main([str(out), "--out", str(page)]) == 0
    html = page.read_text()
    assert "World tokens against the vocabulary" in html and "step 1 (PCA)" in html and "nearest_cosine" in html
