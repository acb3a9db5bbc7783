"""theworld/infer/stats.py: Wilson intervals, the exact McNemar test and the paired summaries of baselines."""

from __future__ import annotations

import pytest

from theworld.infer import scoring, stats
from theworld.infer.scoring import summarize, wilson


@pytest.mark.parametrize(
    "b,c,p",
    [
        (1, 7, 18 / 256),  # Fagerland et al. 2013 (BMC Med Res Methodol 13:91): 0.070
        (0, 0, 1.0),
        (5, 5, 1.0),
        (0, 10, 2 / 1024),
        (3, 0, 0.25),
        (12, 2, 0.012939453125),
    ],
)
def test_exact_mcnemar_against_known_values(b, c, p):
    assert stats.mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)
    assert stats.mcnemar_exact(c, b) == stats.mcnemar_exact(b, c)


def test_paired_difference_and_summary_of_baselines():
    # 10 items: model right on 0..6, baseline right on 5..9 -> only model 0..4 (5), only baseline 7..9 (3)
    recs = [
        {
            "item": str(i),
            "category": None,
            "answer": 0,
            "pred": 0 if i < 7 else 1,
            "pred_shuffled_world": 1,
            "preds": {"no_world": 0 if i >= 5 else 1},
        }
        for i in range(10)
    ]
    s = scoring.summarize(recs, ["no_world"], "loglik")["baselines"]["no_world"]
    assert s["accuracy"] == 0.5 and s["accuracy_ci95"] == stats.wilson(5, 10)
    assert s["difference"] == pytest.approx(0.2) and s["p_value"] == pytest.approx(2 * (1 + 8 + 28 + 56) / 256)


def test_wilson_interval_and_summary():
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert wilson(0, 5)[0] == 0.0 and wilson(5, 5)[1] == 1.0
    recs = [
        {
            "item": str(i),
            "category": "x" if i < 3 else "y",
            "answer": 0,
            "pred": int(i % 2 == 1),
            "pred_shuffled_world": 0,
        }
        for i in range(4)
    ]
    s = summarize(recs)
    assert (s["n"], s["accuracy"], s["accuracy_shuffled_world"]) == (4, 0.5, 1.0)
    assert s["categories"]["x"]["n"] == 3 and s["categories"]["x"]["accuracy"] == pytest.approx(2 / 3)
    assert s["accuracy_ci95"] == wilson(2, 4)
