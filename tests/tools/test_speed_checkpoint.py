"""tools/speed_checkpoint.py: a smoke run at the tiniest size (the tiny Gemma 3, 2 steps: one counted save per layout,
8 samples), so the benchmark cannot rot. Figures are checked for sanity, not speed: the target lives in the
benchmark's own output."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, positive


@pytest.mark.slow
def test_checkpoint_bench_smoke(tmp_path, monkeypatch, capsys):
    from tools.speed_checkpoint import LAYOUTS, main

    monkeypatch.chdir(tmp_path)  # its cache goes to cache/bench/ under the working directory
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the runs it launches import train.loop from this checkout
    assert main(["--json", "--steps", "2", "--samples", "8", "--model", "tiny"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["block_s"]) == set(out["saves"]) == set(out["less_than_gathered"]) == set(LAYOUTS)
    positive(out["block_s"], *LAYOUTS)
    positive(out["less_than_gathered"], *LAYOUTS)
    assert out["less_than_gathered"]["gathered"] == 1.0
    assert all(n >= 1 for n in out["saves"].values()), out["saves"]
    assert (tmp_path / "cache" / "bench" / "tiny-128px-8" / "manifest.json").is_file()
