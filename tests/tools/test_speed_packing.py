"""tools/speed_packing.py: a smoke run at tiny sizes, so the benchmark cannot rot. Figures are checked for
sanity, not speed: speed targets live in the benchmark's own output (docs/performance.md)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import positive


@pytest.mark.slow
def test_packing_bench_smoke(capsys):
    """tools.speed_packing on 32 conversations: plain and packed train on the same samples and tokens, packing leaves
    less padding than plain, grouping less than plain too; the lengths follow the model of LLaVA-Instruct-150K."""
    from tools.speed_packing import answer_tokens, main

    assert 150 < answer_tokens("detail") < answer_tokens("complex_reasoning") < 250  # from the files' sizes
    assert main(["--json", "--samples", "32", "--micro-batch", "4", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows, shape = out["layouts"], out["shape"]
    assert set(rows) == {"plain", "grouped", "packed", "grouped+packed"} and shape["world_tokens"] == 66
    for row in rows.values():
        positive(row, "tokens_per_s", "tokens_per_cpu_s", "speedup", "speedup_cpu")
        assert row["samples"] == 32 and row["micro_batches"] == 8
    assert rows["packed"]["real_tokens"] == rows["plain"]["real_tokens"] == rows["grouped"]["real_tokens"]
    assert rows["packed"]["padding_share"] < rows["grouped"]["padding_share"] < rows["plain"]["padding_share"]
    assert shape["text_tokens"]["p10"] < shape["text_tokens"]["p90"] / 2  # a wide spread of lengths
