"""The shard index (theworld/cache_format/layout.py, storage.py): a cache's sidecars in a few objects written before
the manifest, so a cache in a bucket opens with a number of requests that does not grow with its shards; a missing
or stale index object is rebuilt from the sidecars with a note; caches written before it still open. Against the
real S3 server of test_storage.py, behind its request-logging proxy."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from tests.theworld.cache_format.conftest import BUCKET
from tests.theworld.cache_format.test_storage import _put_tree, members_by_key
from theworld import cache_format as cf
from theworld.cache_format import layout, storage
from theworld.cache_format.names import SHARD_INDEX
from theworld.core.errors import UserError


def _cache(folder: Path, n_shards: int, per_shard: int = 2) -> Path:
    """A small cache written by the cache format's own writer: n_shards shards of per_shard samples."""
    g = torch.Generator().manual_seed(n_shards)
    sides = []
    for i in range(n_shards):
        samples = []
        for j in range(per_shard):
            s = cf.Sample(
                key=f"s{i:05d}_{j}",
                caption=f"caption {i} {j}",
                meta={"prompt": "p"},
                mean=torch.randn(16, 1, 2, 2, generator=g),
                logvar=torch.randn(16, 1, 2, 2, generator=g),
            )
            samples.append((s.key, cf.encode_sample(s, "float32")))
        sides.append(cf.write_shard(folder, i, samples))
    cf.write_manifest(
        folder, sides, fingerprint={}, latent_shape=[16, 1, 2, 2], latent_dtype="float32", num_errors=0, contents={}
    )
    (folder / cf.ERRORS).write_text("")
    return folder


def _gets(proxy, start: int, prefix: str) -> list[str]:
    return [p for m, p, _ in proxy.log[start:] if m == "GET" and p.startswith(f"/{BUCKET}/{prefix}/")]


def test_the_index_agrees_with_the_sidecars(tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "SHARDS_PER_INDEX", 4)  # several index objects from a small cache
    folder = _cache(tmp_path / "c", 10)
    manifest = json.loads((folder / cf.MANIFEST).read_text())
    entries = manifest["shard_index"]
    assert [e["shards"] for e in entries] == [[0, 4], [4, 8], [8, 10]]
    sides = []
    for e in entries:
        data = (folder / e["path"]).read_bytes()
        assert len(data) == e["bytes"]
        sides += layout.read_index_part(data, e)
    assert sides == [cf.read_sidecar(folder, i) for i in range(10)]
    with pytest.raises(ValueError, match="sha256"):
        layout.read_index_part((folder / entries[1]["path"]).read_bytes(), entries[0])


def test_a_remote_cache_opens_with_requests_that_do_not_grow_with_its_shards(s3, tmp_path):
    counts = {}
    for n in (4, 64):
        remote = _put_tree(s3, _cache(tmp_path / f"c{n}", n), f"idx{n}")
        start = len(s3.log)
        reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / f"l{n}")))
        gets = _gets(s3, start, f"idx{n}")
        assert not [p for p in gets if "/shards/" in p]  # no sidecar, no tar: the index alone
        counts[n] = len(s3.log) - start
        assert members_by_key(reader) == members_by_key(cf.CacheReader(tmp_path / f"c{n}"))
        reader.check_consistency()
    assert counts[64] == counts[4] <= 10, counts


def test_a_missing_or_stale_index_object_is_rebuilt_from_the_sidecars_with_a_note(s3, tmp_path, caplog):
    folder = _cache(tmp_path / "c", 6)
    remote = _put_tree(s3, folder, "stale")
    entry = json.loads((folder / cf.MANIFEST).read_text())["shard_index"][0]
    other = _cache(tmp_path / "other", 6, per_shard=3)  # another cache's index at the same name: stale
    s3.fs.put_file(str(other / entry["path"]), f"{BUCKET}/stale/{entry['path']}")
    start = len(s3.log)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert "shard index object sha256 differs" in caplog.text and "reading the sidecars" in caplog.text
    assert len([p for p in _gets(s3, start, "stale") if p.endswith(".json")]) == 6 + 1  # sidecars + manifest
    assert members_by_key(reader) == members_by_key(cf.CacheReader(folder))
    s3.fs.rm_file(f"{BUCKET}/stale/{entry['path']}")
    caplog.clear()
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l2")))
    assert "shard index object missing" in caplog.text
    assert members_by_key(reader) == members_by_key(cf.CacheReader(folder))


def test_a_cache_written_before_the_index_opens_with_a_note(s3, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    folder = _cache(tmp_path / "c", 5)
    manifest = json.loads((folder / cf.MANIFEST).read_text())
    del manifest["shard_index"]
    (folder / cf.MANIFEST).write_text(json.dumps(manifest))
    shutil.rmtree(folder / SHARD_INDEX)
    remote = _put_tree(s3, folder, "old")
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert "written before the shard index" in caplog.text and "5 sidecar(s)" in caplog.text
    assert members_by_key(reader) == members_by_key(cf.CacheReader(folder))
    reader.check_consistency()
    # the test suite's version-2 cache, as a local folder, opens as before
    old = Path(__file__).parents[2] / "data" / "cache_v2"
    if old.is_dir():
        assert len(cf.CacheReader(old)) > 0


def test_an_unreachable_endpoint_is_one_line_within_10_s(s3, tmp_path, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    t = time.monotonic()
    with pytest.raises(UserError) as e:
        cf.CacheReader(
            f"s3://{BUCKET}/x",
            settings=cf.Settings({"skip_instance_cache": True}, local_dir=str(tmp_path / "l")),
        )
    took = time.monotonic() - t
    text = str(e.value)
    assert took < 10, took
    assert len(text.splitlines()) == 1 and f"s3://{BUCKET}/x" in text and "AWS_ENDPOINT_URL" in text, text


def test_an_endpoint_that_accepts_and_never_answers_does_not_hang(s3, tmp_path, monkeypatch):
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # accepts (the kernel does), never answers
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(storage, "POLICY", storage.RetryPolicy(attempts=2, read_s=1.0))
    t = time.monotonic()
    with pytest.raises(UserError) as e:
        cf.CacheReader(
            f"s3://{BUCKET}/x",
            settings=cf.Settings({"skip_instance_cache": True}, local_dir=str(tmp_path / "l")),
        )
    server.close()
    assert time.monotonic() - t < 10
    assert len(str(e.value).splitlines()) == 1 and "failed after 2 attempts" in str(e.value), str(e.value)


def test_a_storage_local_dir_that_is_a_file_is_one_line(s3, tmp_path):
    remote = _put_tree(s3, _cache(tmp_path / "c", 2), "localfile")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError) as e:
        cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "file")))
    assert len(str(e.value).splitlines()) == 1 and "config key 'storage.local_dir'" in str(e.value), str(e.value)
