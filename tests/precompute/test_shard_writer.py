"""The writer thread: shards land in order with their error files and sidecars, a failure surfaces in the caller at
its next call, and a full disk leaves no partial file of the shard behind."""

from __future__ import annotations

import errno
import json
import tarfile
import threading
from pathlib import Path

import pytest
import torch

from precompute.shard_writer import ShardWriter
from theworld import cache_format as cf
from theworld.cache_format import reader
from theworld.core import atomic


def _samples(index: int, n: int = 2) -> list[cf.Sample]:
    g = torch.Generator().manual_seed(index)
    return [
        cf.Sample(f"k{index}-{i}", f"a scene {i}", {"prompt": "p"}, mean=torch.randn(4, 2, 2, generator=g))
        for i in range(n)
    ]


def _cache_dir(out: Path) -> Path:
    """An output_dir as claim_output leaves it: the shards' and the error files' folders."""
    (out / cf.SHARDS).mkdir()
    (out / cf.ERRORS_DIR).mkdir()
    return out


def _read(tar) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tar) as tf:
        for m in tf.getmembers():
            key, name = m.name.split(".", 1)
            out.setdefault(key, {})[name] = tf.extractfile(m).read()
    return out


def test_shards_are_written_with_their_errors_and_published_in_order(tmp_path):
    published = []
    w = ShardWriter(_cache_dir(tmp_path), "float32", publish=published.append)
    samples = {0: _samples(0), 1: _samples(1, 3)}
    w.put(0, samples[0], [{"key": "bad", "error": "cannot read"}])
    w.put(1, samples[1], [])
    w.close()
    assert published == [0, 1] and w.write_seconds > 0
    sides = [cf.read_sidecar(tmp_path, i) for i in (0, 1)]
    assert [s["count"] for s in sides] == [2, 3] and w.bytes_written == sum(s["bytes"] for s in sides)
    for i, want in samples.items():
        got = _read(cf.tar_path(tmp_path, i))
        assert list(got) == [s.key for s in want]
        back = [reader.decode_sample(k, m) for k, m in got.items()]
        assert all(torch.equal(b.mean, s.mean) and b.caption == s.caption for b, s in zip(back, want))
    lines = cf.error_path(tmp_path, 0).read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"error": "cannot read", "key": "bad"}]
    assert cf.error_path(tmp_path, 1).read_bytes() == b""


def test_a_failed_write_is_raised_in_the_caller_and_no_later_shard_is_written(tmp_path):
    queued = threading.Event()

    def publish(index):
        queued.wait(10)
        raise RuntimeError(f"bucket refused shard {index}")

    w = ShardWriter(_cache_dir(tmp_path), "float32", publish=publish)
    w.put(0, _samples(0), [])
    w.put(1, _samples(1), [])
    queued.set()
    with pytest.raises(RuntimeError, match="bucket refused shard 0"):
        w.close()
    assert cf.read_sidecar(tmp_path, 0) is not None and cf.read_sidecar(tmp_path, 1) is None
    with pytest.raises(RuntimeError, match="bucket refused shard 0"):
        w.put(2, _samples(2), [])


def test_a_full_disk_removes_the_shards_partial_files_and_names_the_tar(tmp_path, monkeypatch):
    def disk_full(cache_dir, index, samples):
        partial = atomic.partial_path(cf.tar_path(cache_dir, index))
        partial.write_bytes(b"half a tar")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cf, "write_shard", disk_full)
    w = ShardWriter(_cache_dir(tmp_path), "float32")
    with pytest.raises(OSError) as e:
        w.write(3, _samples(3), [])
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(cf.tar_path(tmp_path, 3))
    assert list((tmp_path / cf.SHARDS).iterdir()) == []  # no tar, no sidecar: the shard is redone on a rerun
    assert [p.name for p in (tmp_path / cf.ERRORS_DIR).iterdir()] == ["shard-000003.jsonl"]  # rewritten then
    w.close()
