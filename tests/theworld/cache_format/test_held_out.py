"""theworld/cache_format/held_out.py: the held-out split is a pure function of the sample keys (the eval_samples keys
with the smallest sha256), whatever the order of the samples in the cache; read from the shard table's candidates
(no part loaded) where they hold it, by the full pass (logged) where they do not. Caches of index records alone
(`_index_cache`: sidecars, no tars): the split reads no sample."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from tests.theworld.cache_format.test_index import without_candidates
from theworld import cache_format as cf
from theworld.cache_format import held_out, index, sample_index
from theworld.cache_format.held_out import split
from theworld.core.errors import UserError


class _Keys:  # what split reads of a CacheReader without held-out candidates
    cache_dir = "keys"

    def __init__(self, keys: list[str]):
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def key_array(self) -> np.ndarray:
        return np.array([k.encode() for k in self.keys])

    def held_out_candidates(self) -> None:
        return None


def test_the_held_out_keys_are_those_with_the_smallest_sha256_in_any_layout(monkeypatch):
    monkeypatch.setattr(held_out, "FULL_PASS_CHUNK", 6)  # the full pass a chunk of keys at a time
    keys = [f"sample-{i:03d}" for i in range(50)]
    expected = sorted(sorted(keys, key=lambda k: hashlib.sha256(k.encode()).digest())[:7])
    for order in range(3):
        shuffled = keys[:]
        random.Random(order).shuffle(shuffled)
        train, held = split(_Keys(shuffled), 7)
        assert [shuffled[i] for i in held] == expected  # in key order
        assert list(train) == [i for i in range(50) if shuffled[i] not in expected]  # in cache order
        assert train.dtype == held.dtype == np.int64


def test_holding_out_every_sample_is_one_line():
    with pytest.raises(
        UserError, match=r"^config key 'train.eval.samples': 5 leaves nothing to train on \(5 samples\)$"
    ):
        split(_Keys([f"k{i}" for i in range(5)]), 5)


def _reference(keys: list[str], n: int) -> list[str]:
    """The split as first written: the n keys of smallest sha256, in key order."""
    return sorted(sorted(keys, key=lambda k: hashlib.sha256(k.encode()).digest())[:n])


def _index_cache(folder: Path, shards: list[list[str]]) -> Path:
    """A cache's manifest and shard index for shards of these keys (the writer's write_manifest; no tars)."""
    folder.mkdir(parents=True)
    shape = [16, 1, 2, 2]
    sides = [
        {
            "count": len(keys),
            "bytes": 4096,
            "sha256": hashlib.sha256(str(i).encode()).hexdigest(),
            "samples": [
                {"key": k, "members": {"txt": [512, 3]}, "crc32": {"txt": 1}, "latent_shape": shape} for k in keys
            ],
        }
        for i, keys in enumerate(shards)
    ]
    cf.write_manifest(
        folder, sides, fingerprint={}, latent_shape=shape, latent_dtype="float32", num_errors=0, contents={}
    )
    (folder / cf.ERRORS).write_text("")
    return folder


def _loads(monkeypatch) -> list[int]:
    """The parts a lazily read cache loads from now on, in order."""
    loaded, load = [], sample_index.Lazy._load
    monkeypatch.setattr(sample_index.Lazy, "_load", lambda self, p: loaded.append(p) or load(self, p))
    return loaded


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(index, "PART_SAMPLES", 12)  # 8 shards of 4: parts of 12, 12 and 8 samples
    monkeypatch.setattr(index, "HELD_OUT_CANDIDATES", 5)
    return [[f"s{i:03d}-{j}" for j in range(4)] for i in range(8)]


@pytest.mark.parametrize("lazy", [False, True], ids=["whole", "lazy"])
@pytest.mark.parametrize("n", [0, 1, 3, 5, 6])
def test_the_candidates_split_as_the_full_pass_and_a_lazy_reader_loads_no_part(
    tmp_path, monkeypatch, caplog, small, lazy, n
):
    monkeypatch.setattr(sample_index, "LAZY_BYTES", 0 if lazy else 1 << 40)
    reader = cf.CacheReader(_index_cache(tmp_path / "c", small))
    loaded = _loads(monkeypatch)
    keys = [k for shard in small for k in shard]
    full = split(_Keys(keys), n)  # the full pass over the same keys
    caplog.clear()
    caplog.set_level(logging.INFO)
    train, held = split(reader, n)
    assert reader.lazy == lazy and [keys[i] for i in held] == _reference(keys, n)  # in key order
    assert train.tolist() == [i for i in range(32) if i not in held] and train.dtype == held.dtype == np.int64
    assert train.tolist() == full[0].tolist() and held.tolist() == full[1].tolist()
    if n <= 5:  # candidates serve: nothing hashed, no part loaded
        assert "hashing" not in caplog.text and loaded == []
    else:
        assert (
            f"cache {reader.cache_dir}: hashing 32 keys for the held-out split: train.eval.samples 6 is above the 5 "
            "candidates a part of its shard table keeps"
        ) in caplog.text
        assert loaded == ([0, 1, 2] if lazy else [])


def _replace_table(folder, table: bytes) -> None:
    """The cache's shard table replaced by `table`, its manifest entry made to match."""
    manifest = json.loads((folder / cf.MANIFEST).read_text())
    (folder / manifest["shard_table"]["path"]).write_bytes(table)
    manifest["shard_table"].update(bytes=len(table), sha256=hashlib.sha256(table).hexdigest())
    (folder / cf.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("lazy", [False, True], ids=["whole", "lazy"])
def test_a_shard_table_written_before_the_candidates_splits_by_the_full_pass_with_a_line(
    tmp_path, monkeypatch, caplog, small, lazy
):
    monkeypatch.setattr(sample_index, "LAZY_BYTES", 0 if lazy else 1 << 40)
    folder = _index_cache(tmp_path / "c", small)
    path = folder / json.loads((folder / cf.MANIFEST).read_text())["shard_table"]["path"]
    _replace_table(folder, without_candidates(path.read_bytes()))
    caplog.set_level(logging.INFO)
    reader = cf.CacheReader(folder)
    keys = [k for shard in small for k in shard]
    assert reader.held_out_candidates() is None and [keys[i] for i in split(reader, 3)[1]] == _reference(keys, 3)
    assert (
        f"cache {reader.cache_dir}: hashing 32 keys for the held-out split: no held-out candidates in this cache's "
        "shard table"
    ) in caplog.text


def test_the_demo_caches_split_is_the_one_its_numbers_were_measured_on(tmp_path, monkeypatch):
    """configs/precompute.yaml's synthetic source: 4,096 keys in 8 shards of 512, train.eval.samples 256 (stage 1)."""
    keys = [f"synthetic-0-{i:08d}" for i in range(4096)]
    folder = _index_cache(tmp_path / "demo", [keys[lo : lo + 512] for lo in range(0, 4096, 512)])
    monkeypatch.setattr(sample_index, "LAZY_BYTES", 0)
    loaded = _loads(monkeypatch)
    for reader in (cf.CacheReader(folder), cf.CacheReader(folder, members=())):
        train, held = split(reader, 256)
        assert [keys[i] for i in held] == _reference(keys, 256) and len(train) == 3840
        # pinned (the split as first written gives it): the README's demo figures were measured on this split
        assert held[:3].tolist() == [2, 5, 23] and hashlib.sha256(held.tobytes()).hexdigest()[:16] == "c4b66f643d88ca8a"
    assert loaded == []


def test_a_whole_reader_trusts_no_shard_table_of_other_shards_than_its_index(tmp_path, monkeypatch, caplog, small):
    """Another cache's table (its manifest entry made to match): the full pass, not that table's candidates."""
    monkeypatch.setattr(sample_index, "LAZY_BYTES", 1 << 40)
    folder = _index_cache(tmp_path / "c", small)
    other = _index_cache(tmp_path / "other", [[f"t{i:03d}-{j}" for j in range(5)] for i in range(8)])
    _replace_table(folder, (other / json.loads((folder / cf.MANIFEST).read_text())["shard_table"]["path"]).read_bytes())
    caplog.set_level(logging.INFO)
    reader = cf.CacheReader(folder)
    keys = [k for shard in small for k in shard]
    assert reader.held_out_candidates() is None and [keys[i] for i in split(reader, 3)[1]] == _reference(keys, 3)
    assert "hashing 32 keys for the held-out split" in caplog.text


def test_the_training_split_indexes_as_its_array_without_holding_it():
    rng = np.random.default_rng(0)
    for n, k in [(1, 0), (7, 3), (50, 0), (50, 49), (1000, 17), (1000, 400)]:
        held = rng.choice(n, k, replace=False)
        kept, array = held_out.Kept(n, held), np.setdiff1d(np.arange(n), held)
        assert len(kept) == len(array) and np.asarray(kept).tolist() == array.tolist()
        for s in (slice(None), slice(3, None), slice(None, 5), slice(2, 40, 3), slice(-4, None), slice(None, None, -1)):
            assert kept[s].tolist() == array[s].tolist(), s
        if len(array):
            positions = rng.integers(-len(array), len(array), 30)
            assert kept[positions].tolist() == array[positions].tolist()
            assert [kept[int(p)] for p in positions[:5]] == array[positions[:5]].tolist()
            mask = rng.random(len(array)) < 0.5
            assert kept[mask].tolist() == array[mask].tolist() and kept.shape == array.shape
        with pytest.raises(IndexError):
            kept[len(array)]


def test_the_training_split_of_a_billion_samples_takes_the_memory_of_its_held_out_samples():
    import tracemalloc

    n, held = 1_400_000_000, np.random.default_rng(1).choice(1_400_000_000, 256, replace=False)
    tracemalloc.start()
    kept = held_out.Kept(n, held)
    first, some = kept[:64], kept[np.arange(0, len(kept), len(kept) // 1000)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(kept) == n - 256 and peak < 1 << 20, peak  # the array it stands for: 11 GB
    assert not np.isin(some, held).any() and (np.diff(some) > 0).all()
    assert first.tolist() == np.setdiff1d(np.arange(64 + 256), held)[:64].tolist()
