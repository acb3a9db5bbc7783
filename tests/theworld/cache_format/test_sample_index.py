"""The shard index read a part at a time (theworld/cache_format/sample_index.py): a large cache opens from its shard
table alone, each process loads only the parts whose samples it reads, a remote part is downloaded once per node, and
what `Whole` checks at open is checked as each part loads. LAZY_BYTES is lowered so that small caches take that path;
remote cases against the real S3 server of test_storage.py, behind its request-logging proxy."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest

from tests.theworld.cache_format.conftest import BUCKET
from tests.theworld.cache_format.test_index import _cache, _gets, _index_gets
from tests.theworld.cache_format.test_storage import _put_tree, members_by_key
from theworld import cache_format as cf
from theworld.cache_format import index, sample_index, storage
from theworld.cache_format.layout import REMOTE_INDEX
from theworld.cache_format.names import SHARD_INDEX
from theworld.core.errors import CacheDamaged, UserError


@pytest.fixture
def lazy(monkeypatch):
    monkeypatch.setattr(index, "PART_SAMPLES", 8)  # 10 shards of 2: parts of shards 0-3, 4-7, 8-9
    monkeypatch.setattr(sample_index, "LAZY_BYTES", 0)


def _without_table(folder) -> cf.CacheReader:
    """The same cache read whole: a copy whose manifest names no shard table (as caches written before it)."""
    copy = folder.parent / f"{folder.name}-whole"
    if not copy.exists():
        shutil.copytree(folder, copy)
        manifest = json.loads((copy / cf.MANIFEST).read_text())
        del manifest["shard_table"]
        (copy / cf.MANIFEST).write_text(json.dumps(manifest))
    return cf.CacheReader(copy)


def test_a_large_local_cache_opens_from_its_shard_table_and_loads_only_the_parts_it_reads(tmp_path, lazy):
    folder = _cache(tmp_path / "c", 10)
    reader, whole = cf.CacheReader(folder), _without_table(folder)
    assert isinstance(reader._index, sample_index.Lazy) and isinstance(whole._index, sample_index.Whole)
    assert reader._index._parts == {} and len(reader) == len(whole) == 20
    assert reader.latent_hw.tolist() == whole.latent_hw.tolist() and reader.latent_hw.strides == (0, 4)  # one shape
    assert reader.shards.tolist() == whole.shards.tolist() and reader.checksummed
    assert reader.samples_in([9, 2]).tolist() == [4, 5, 18, 19] == whole.samples_in([9, 2]).tolist()
    # samples in shard order: each shard's first sample, read from the shard table alone
    assert reader.shard_starts.tolist() == whole.shard_starts.tolist() == list(range(0, 21, 2))
    assert np.array_equal(np.repeat(np.arange(10), np.diff(whole.shard_starts)), whole.shards)
    assert reader.key(10) == whole.key(10) and set(reader._index._parts) == {1}  # sample 10: shard 5, part 1
    assert reader.raw(11) == whole.raw(11) and set(reader._index._parts) == {1}
    assert members_by_key(reader) == members_by_key(whole) and set(reader._index._parts) == {0, 1, 2}
    assert reader.keys() == whole.keys() and reader.member_names() == whole.member_names()
    # the keys' digest: of the parts' sha256s (no part read), the same for every reader of this cache
    fresh = cf.CacheReader(folder)
    assert fresh.keys_digest() == reader.keys_digest() != whole.keys_digest() and fresh._index._parts == {}
    fresh.check_consistency()
    assert fresh._index._parts == {}
    # a DataLoader worker gets the reader without the parent's memory maps and maps the parts again
    again = pickle.loads(pickle.dumps(reader))
    assert again._index._parts == {} and again.raw(3) == whole.raw(3)


def test_a_damaged_part_or_a_member_outside_its_tar_is_one_line_when_its_part_loads(tmp_path, lazy):
    folder = _cache(tmp_path / "c", 10)
    part = folder / SHARD_INDEX / index.part_name(1)
    good = part.read_bytes()
    part.write_bytes(good[:-1] + b"x")
    reader = cf.CacheReader(folder)
    assert reader.raw(0)  # part 0 is intact
    with pytest.raises(CacheDamaged) as e:
        reader.raw(8)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and f"{SHARD_INDEX}/{part.name} sha256 differs" in msg and "shard-000004" in msg
    # a part that places a member past its tar's end (as the manifest lists it): the shard and key are named
    p = index.decode_unchecked(good)
    p.spans[3, 0, 0] = int(p.bytes[1])
    data = index.encode(p)
    part.write_bytes(data)
    manifest = json.loads((folder / cf.MANIFEST).read_text())
    manifest["shard_index"][1].update(bytes=len(data), sha256=index._sha(data))
    (folder / cf.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheDamaged, match=r"shard shard-000005\.tar, sample s00005_1: its sidecar places a member"):
        cf.CacheReader(folder).raw(9)


def test_a_shard_copied_over_another_is_named_at_the_start_of_run_check(tmp_path, lazy):
    folder = _cache(tmp_path / "c", 10)
    for ext in ("tar", "json"):
        shutil.copy(folder / f"shards/shard-000002.{ext}", folder / f"shards/shard-000006.{ext}")
    cf.write_manifest(
        folder,
        [cf.read_sidecar(folder, i) for i in range(10)],
        fingerprint={},
        latent_shape=[16, 1, 2, 2],
        latent_dtype="float32",
        num_errors=0,
        contents={},
    )
    with pytest.raises(CacheDamaged) as e:
        cf.CacheReader(folder).check_consistency()
    assert "shards shard-000002.tar and shard-000006.tar are the same bytes" in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_a_remote_part_is_downloaded_once_per_node_and_only_when_a_sample_of_it_is_read(s3, tmp_path, lazy):
    folder = _cache(tmp_path / "c", 10)
    want = members_by_key(_without_table(folder))
    remote = _put_tree(s3, folder, "lazy")
    start = len(s3.log)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    opened = _index_gets(s3, start, "lazy")
    # the shard table, and of the parts the first one's bytes the open asks for before the manifest names it (up to
    # GUESS_BYTES): no other part, no sidecar
    ranged = f"bytes=0-{storage.GUESS_BYTES - 1}"
    assert opened == {index.TABLE: [ranged], index.part_name(0): [ranged]}
    assert not [p for p in _gets(s3, start, "lazy") if "/shards/" in p]
    start = len(s3.log)
    reader.raw(17)  # shard 8: part 2
    assert [p.rsplit("/", 1)[1] for p in _gets(s3, start, f"lazy/{SHARD_INDEX}")] == [index.part_name(2)]
    # another process of the node (a second reader on the same local_dir) maps the node's copy, downloading nothing
    start = len(s3.log)
    other = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert other.raw(16) == want[other.key(16)]
    assert not _gets(s3, start, f"lazy/{SHARD_INDEX}/part-")
    assert members_by_key(reader) == want
    reader.check_consistency()
    assert np.array_equal(reader.shards, np.repeat(np.arange(10), 2))


def test_a_remote_shard_table_larger_than_the_guess_is_downloaded_by_ranges_once_per_node(
    s3, tmp_path, lazy, monkeypatch
):
    """At DataComp size the shard table is GBs: the first process of a node downloads it by ranges several at once
    (not one stream held in memory), the node's other processes and later runs open the node's copy with no request
    but the open's guess."""
    monkeypatch.setattr(storage, "GUESS_BYTES", 64)  # the table is larger than the open's guess
    monkeypatch.setattr(storage, "PART_BYTES", 256)
    folder = _cache(tmp_path / "c", 10)
    want = members_by_key(_without_table(folder))
    table = json.loads((folder / cf.MANIFEST).read_text())["shard_table"]
    remote = _put_tree(s3, folder, "big")
    start = len(s3.log)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    got = _index_gets(s3, start, "big")[index.TABLE]
    ranges = [f"bytes={lo}-{min(lo + 256, table['bytes'] + 1) - 1}" for lo in range(0, table["bytes"], 256)]
    assert got[0] == "bytes=0-63" and sorted(got[1:]) == sorted(ranges)  # the guess, then its parts
    start = len(s3.log)
    other = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert _index_gets(s3, start, "big")[index.TABLE] == ["bytes=0-63"]  # the guess alone
    assert members_by_key(other) == members_by_key(reader) == want


def test_a_stale_remote_shard_table_or_one_named_outside_the_cache_is_one_line(s3, tmp_path, lazy, monkeypatch):
    monkeypatch.setattr(storage, "GUESS_BYTES", 64)
    folder = _cache(tmp_path / "c", 10)
    remote = _put_tree(s3, folder, "stale")
    table = f"{BUCKET}/stale/{SHARD_INDEX}/{index.TABLE}"
    s3.fs.pipe_file(table, s3.fs.cat_file(table)[:-1] + b"\0")  # the same size, other bytes
    with pytest.raises(UserError) as e:
        cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert f"{SHARD_INDEX}/{index.TABLE}: the object is not what the manifest lists" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
    assert not list((tmp_path / "l").rglob(f"*{index.SUFFIX}"))  # nothing kept that a later open would trust

    manifest = json.loads((folder / cf.MANIFEST).read_text())
    manifest["shard_table"]["path"] = "../../outside.safetensors"
    s3.fs.pipe_file(f"{BUCKET}/stale/{cf.MANIFEST}", json.dumps(manifest).encode())
    with pytest.raises(UserError) as e:
        cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert "is not {path, bytes, sha256} of an object inside the cache" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
    assert not list(tmp_path.rglob("outside*"))


def test_a_rewritten_remote_cache_leaves_no_copy_of_its_earlier_index_on_the_node(s3, tmp_path, lazy):
    settings = cf.Settings(local_dir=str(tmp_path / "l"))
    remote = _put_tree(s3, _cache(tmp_path / "a", 10), "again")
    reader = cf.CacheReader(remote, settings=settings)
    reader.raw(0)  # part 0's copy beside the table's

    def copies() -> set[str]:
        return {p.name for p in (reader.cache_dir / REMOTE_INDEX).glob(f"*{index.SUFFIX}")}

    before = copies()
    assert len(before) == 2
    _put_tree(s3, _cache(tmp_path / "b", 9), "again")  # rewritten: another shard table, other parts
    other = cf.CacheReader(remote, settings=settings)
    want = members_by_key(cf.CacheReader(tmp_path / "b"))
    assert other.raw(0) == want[other.key(0)]
    assert len(copies()) == 2 and not copies() & before
