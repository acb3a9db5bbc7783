"""tools/speed_eval.py: a smoke run at tiny sizes, so the benchmark cannot rot. Figures are checked for
sanity, not speed: speed targets live in the benchmark's own output (docs/performance.md)."""

from __future__ import annotations

import json

from tests.conftest import positive


def test_eval_bench_smoke(capsys):
    """tools.speed_eval at toy sizes, in process: both cases score the same items both ways and agree."""
    from tools.speed_eval import main

    assert main(["--json", "--sizes", "tiny", "--items", "2", "--batch", "2", "--repeats", "1"]) == 0
    cases = json.loads(capsys.readouterr().out)["cases"]
    assert set(cases) == {"demo", "real_shaped"}
    for row in cases.values():
        positive(row, "items_per_s_shared", "items_per_s_unshared", "speedup", "speedup_cpu_time")
        assert row["items"] == 2 and row["choices"] == 4 and row["max_abs_score_diff"] < 1e-4
    assert cases["real_shaped"]["world_tokens"] == 18 and cases["real_shaped"]["image_tokens"] == 4
