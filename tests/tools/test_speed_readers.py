"""Smoke run of tools.speed_readers at tiny size: every reader (ours, webdataset's URL pipeline, MosaicML Streaming)
reads the test cache from an S3 server the benchmark starts on 127.0.0.1, and all of them yield exactly the samples
a local CacheReader reads (the comparison is fair). Figures are checked for sanity, not speed."""

from __future__ import annotations

import hashlib
import math

import pytest

from tests.conftest import bench_json
from theworld import cache_format as cf
from tools import speed_readers as bench_readers


def _local_digest(cache) -> tuple[str, str]:
    """(keys digest, latents digest) of the cache read locally, computed as the benchmark's rows give them."""
    reader = cf.CacheReader(cache)
    h = hashlib.sha256()
    for i in range(len(reader)):
        s = reader.sample(i)
        h.update(s.key.encode())
        h.update(s.mean.contiguous().numpy().tobytes())
    return hashlib.sha256("\n".join(reader.keys()).encode()).hexdigest()[:16], h.hexdigest()[:16]


@pytest.mark.slow
def test_bench_readers_rows_have_positive_rates_and_every_reader_reads_the_same_samples(cache, tmp_path):
    report = bench_json(["tools.speed_readers", "--cache", str(cache), "--rounds", "1"], tmp_path)
    assert (report["samples"], report["shards"], report["rounds"]) == (96, 3, 1)
    rows = {r["reader"]: r for r in report["rows"]}
    assert list(rows) == ["theworld", "webdataset", "streaming"]
    assert {n: r["exact_resume"] for n, r in rows.items()} == {"theworld": True, "webdataset": False, "streaming": True}
    keys, latents = _local_digest(cache)
    for name, row in rows.items():
        for k in ("epoch1_samples_per_s", "epoch2_samples_per_s"):
            assert math.isfinite(row[k]) and row[k] > 0, (name, k, row[k])
        assert (row["keys_digest"], row["latents_digest"]) == (keys, latents), name


def test_bench_readers_bad_cache_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_readers.main(["--cache", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--cache {tmp_path}: no manifest.json there" in err
