"""Read-ahead from a cache in a bucket (train/data/loader.py ReadAhead, storage.RemoteCache.stage) against a
fault-injecting proxy in front of the real S3 server: slow answers, 500s, bodies cut short or reset lose and
duplicate no sample; a download killed with SIGKILL leaves nothing a later run trusts; a bit flipped in the node's
shard cache is caught there, without blaming the bucket's object."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.theworld.cache_format.conftest import BUCKET
from tests.theworld.cache_format.test_index import _cache
from tests.theworld.cache_format.test_storage import _put_tree
from theworld import cache_format as cf
from theworld.core.errors import CacheDamaged
from train.data.loader import ReadAhead, stage_first
from train.data.order import rank_indices


def _read(reader, order: np.ndarray, depth: int) -> list[tuple[str, dict]]:
    ahead = ReadAhead(reader, order, depth)
    out = []
    for pos, index in enumerate(order.tolist()):
        ahead(pos)
        out.append((reader.key(index), reader.raw(index)))
    ahead._pool.shutdown(wait=True)
    return out


def test_read_ahead_through_faults_loses_and_duplicates_no_sample_and_resumes_exactly(s3, tmp_path):
    local = _cache(tmp_path / "c", 8, per_shard=3)
    remote = _put_tree(s3, local, "faults")
    truth = cf.CacheReader(local)
    train = np.arange(len(truth))
    order = rank_indices(train, 3, 0, 4, 0, 1, shards=truth.shards, window=2)
    want = [(truth.key(i), truth.raw(i)) for i in order.tolist()]
    # at most two faults per shard, fewer than the retry policy's attempts, whichever order the downloads run in
    for shard, faults in ((0, ("500", "truncate")), (2, ("reset", "slow")), (5, ("500",)), (7, ("truncate",))):
        s3.inject("GET", rf"/faults/shards/shard-{shard:06d}\.tar$", *faults)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert _read(reader, order, depth=2) == want
    assert not s3.faults  # every fault was met
    # resumed at global batch 3 (a fresh shard cache: everything downloaded again through more faults)
    for shard, faults in ((1, ("reset",)), (4, ("truncate", "500"))):
        s3.inject("GET", rf"/faults/shards/shard-{shard:06d}\.tar$", *faults)
    tail = rank_indices(train, 3, 0, 4, 0, 1, start_batch=3, shards=truth.shards, window=2)
    assert np.array_equal(tail, order[12:])
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l2")))
    assert _read(reader, tail, depth=3) == want[12:]
    staged = os.listdir(tmp_path / "l2" / "shards")
    # the staged shards and one lock for the folder's eviction: no lock or partial file per shard
    assert sorted(n for n in staged if not n.endswith(".tar")) == [".evict.lock"], staged


_STAGE = """
import sys
from theworld import cache_format as cf
from theworld.core.errors import CacheDamaged
reader = cf.CacheReader(sys.argv[1], settings=cf.Settings(local_dir=sys.argv[2]))
reader.stage(0)
"""


def test_a_download_killed_with_sigkill_leaves_nothing_a_later_run_trusts(s3, tmp_path):
    local = _cache(tmp_path / "c", 2)
    remote = _put_tree(s3, local, "kill9")
    shard_cache = tmp_path / "l"
    s3.hold("GET", r"/kill9/shards/shard-000000\.tar$")
    env = {**os.environ, **s3.env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _STAGE, remote, str(shard_cache)], env=env, cwd=ROOT)
    try:
        assert s3.held.wait(120)  # the download has begun
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        s3.release()
    left = os.listdir(shard_cache / "shards")
    assert not [n for n in left if n.endswith(".tar")], left  # no staged shard: only the download's .part
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(shard_cache)))
    truth = cf.CacheReader(local)
    assert [reader.raw(i) for i in range(len(reader))] == [truth.raw(i) for i in range(len(truth))]
    left = os.listdir(shard_cache / "shards")
    assert not [n for n in left if n.endswith(".part")], left  # the dead download's file is gone


def test_a_bit_flipped_in_the_shard_cache_is_caught_there_and_the_shard_downloaded_again(s3, tmp_path, caplog):
    local = _cache(tmp_path / "c", 2)
    remote = _put_tree(s3, local, "flip")
    settings = cf.Settings(local_dir=str(tmp_path / "l"))
    reader = cf.CacheReader(remote, settings=settings)
    reader.stage(0)
    (staged,) = (tmp_path / "l" / "shards").glob("*.tar")
    data = bytearray(staged.read_bytes())
    data[cf.read_sidecar(local, 0)["samples"][0]["members"][cf.LATENT][0] + 10] ^= 0x10  # a bit of sample 0
    staged.write_bytes(bytes(data))
    # this process checked the copy when it staged it: the member's crc32 catches the change, naming the copy
    with pytest.raises(CacheDamaged) as e:
        reader.raw(0)
    text = str(e.value)
    assert "this node's staged copy" in text and "the object in the bucket is not affected" in text, text
    assert "sidecar" not in text and "precompute" not in text, text  # no advice to rebuild the bucket's shard
    assert reader.raw(0) == cf.CacheReader(local).raw(0)  # the copy was dropped: downloaded again
    staged.write_bytes(bytes(data))  # damaged again, found by the next run's check of the copy
    start = len(s3.log)
    fresh = cf.CacheReader(remote, settings=settings)  # another run on this node
    truth = cf.CacheReader(local)
    assert fresh.raw(0) == truth.raw(0)
    assert "damaged on this node's disk" in caplog.text and "downloading it again" in caplog.text
    assert [p for m, p, _ in s3.log[start:] if m == "GET" and p.endswith(".tar")] == [
        f"/{BUCKET}/flip/shards/shard-000000.tar"
    ]


def test_a_read_ahead_deeper_than_the_shard_budget_downloads_each_shard_once(s3, tmp_path):
    local = _cache(tmp_path / "c", 8, per_shard=3)
    remote = _put_tree(s3, local, "budget")
    truth = cf.CacheReader(local)
    budget = 2 * int(truth.shard_table.bytes.max())  # two shards: less than window 1 + read-ahead 3
    settings = cf.Settings(local_dir=str(tmp_path / "l"), local_max_gb=budget / 1e9)
    reader = cf.CacheReader(remote, settings=settings)
    order = rank_indices(np.arange(len(truth)), 5, 0, 4, 0, 1, shards=truth.shards, window=1)
    ahead, got, start = ReadAhead(reader, order, 3), [], len(s3.log)
    for pos, index in enumerate(order.tolist()):
        got.append((reader.key(index), reader.raw(index)))
        ahead(pos)
        if ahead._pool is not None:  # a slow step: the read-ahead (one thread, in order) finishes what it was sent
            ahead._pool.submit(lambda: None).result()
    ahead._pool.shutdown(wait=True)
    assert got == [(truth.key(i), truth.raw(i)) for i in order.tolist()]
    tars = [p for m, p, _ in s3.log[start:] if m == "GET" and p.endswith(".tar")]
    assert sorted(tars) == [f"/{BUCKET}/budget/shards/shard-{i:06d}.tar" for i in range(8)], tars
    staged = sum(p.stat().st_size for p in (tmp_path / "l" / "shards").glob("*.tar"))
    assert staged <= budget


def test_captions_alone_are_read_as_byte_ranges_without_staging_their_shard(s3, tmp_path):
    """What the run reads before its first batch (the trained prompt, the text check) is each sample's caption and
    json: a range request each, checked by their crc32s, not the whole shard staged."""
    local = _cache(tmp_path / "c", 2, per_shard=3)
    remote = _put_tree(s3, local, "texts")
    truth = cf.CacheReader(local)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    reader.members = ()
    start = len(s3.log)
    got = [reader.raw(i) for i in range(len(reader))]
    assert got == [{k: v for k, v in truth.raw(i).items() if k in (cf.CAPTION, cf.META)} for i in range(len(truth))]
    assert not list((tmp_path / "l" / "shards").glob("*.tar"))  # nothing staged
    tar_gets = [p for m, p, _ in s3.log[start:] if m == "GET" and p.endswith(".tar")]
    assert len(tar_gets) == len(reader)  # one ranged request per sample
    # a byte of a caption changed in the bucket: its crc32 names the bucket's shard, not this node's copy
    damaged = cf.tar_path(local, 1).read_bytes()
    offset = cf.read_sidecar(local, 1)["samples"][0]["members"][cf.CAPTION][0]
    damaged = damaged[:offset] + bytes([damaged[offset] ^ 0x20]) + damaged[offset + 1 :]
    s3.fs.pipe_file(f"{BUCKET}/texts/shards/shard-000001.tar", damaged)
    with pytest.raises(CacheDamaged) as e:
        reader.raw(3)
    assert "shard-000001.tar" in str(e.value) and "crc32" in str(e.value) and "\n" not in str(e.value)


def test_the_workers_first_shards_are_staged_before_they_fork_and_a_failure_is_left_to_their_read(s3, tmp_path):
    """stage_first (the main process, before the workers fork): the shards of each worker's first
    batch, then the dataset order's up to 1 + depth, downloaded once each and checked; reading the first batches
    afterwards requests no tar. A shard whose download fails is not raised there: the read that needs it retries."""
    local = _cache(tmp_path / "c", 8, per_shard=3)
    remote = _put_tree(s3, local, "first")
    truth = cf.CacheReader(local)
    order = rank_indices(np.arange(len(truth)), 7, 0, 4, 0, 1, shards=truth.shards, window=2)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    ahead, first_batches = ReadAhead(reader, order, 2), np.arange(2 * 4)  # two workers, batches of 4
    want = list(dict.fromkeys(truth.shards[order[:8]].tolist()))  # the first batches' shards, in order
    want += [s for s in list(dict.fromkeys(truth.shards[order].tolist()))[:3] if s not in want]  # the order's 1 + 2
    assert ahead.first(first_batches, 6) == want and len(want) >= 3
    failed = f"/{BUCKET}/first/shards/shard-{want[-1]:06d}.tar"
    s3.inject("GET", rf"/first/shards/shard-{want[-1]:06d}\.tar$", "500", "500", "500")  # its every attempt
    start = len(s3.log)
    stage_first(ahead, 0, first_batches, workers=2)
    assert set(s3.downloads(start, r"\.tar$")) == {f"/{BUCKET}/first/shards/shard-{i:06d}.tar" for i in want}
    assert not [f for f in s3.faults if "/first/" in f[1]]  # every attempt was made (the server's faults are shared)
    start = len(s3.log)
    assert [reader.raw(int(i)) for i in order[:8]] == [truth.raw(int(i)) for i in order[:8]]
    assert [reader.raw(int(i)) for i in order if truth.shards[i] == want[-1]] == [
        truth.raw(int(i)) for i in order if truth.shards[i] == want[-1]
    ]
    assert s3.downloads(start, r"\.tar$") == [failed]  # the others were staged; the failed one by its read


def test_every_shard_of_the_main_processs_first_batch_is_staged_at_once(s3, tmp_path):
    """The main process makes the first batch itself: all its shards are staged (a windowed order spreads it over
    several), however few read-ahead would fetch for a worker; nothing beyond them when there is no worker."""
    local = _cache(tmp_path / "c", 8, per_shard=3)
    remote = _put_tree(s3, local, "here")
    truth = cf.CacheReader(local)
    order = rank_indices(np.arange(len(truth)), 7, 0, 8, 0, 1, shards=truth.shards, window=4)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    ahead, batch = ReadAhead(reader, order, 1), 8
    want = set(truth.shards[order[:batch]].tolist())
    assert len(want) > 1 + ahead.depth  # more than a worker's first read and read-ahead would stage
    start = len(s3.log)
    stage_first(ahead, batch, np.arange(batch), workers=0)
    assert sorted(s3.downloads(start, r"\.tar$")) == sorted(f"/{BUCKET}/here/shards/shard-{i:06d}.tar" for i in want)
    start = len(s3.log)
    assert [reader.raw(int(i)) for i in order[:batch]] == [truth.raw(int(i)) for i in order[:batch]]
    assert not s3.downloads(start, r"\.tar$")


def test_downloads_at_once_count_against_the_shard_cache_budget_from_their_start(s3, tmp_path):
    """Eight read-aheads started together over a budget of two shards: a download in flight reserves its shard's
    bytes, so two are staged, the others find no room (NoRoomAhead), and the shard cache never holds more than two."""
    from concurrent.futures import ThreadPoolExecutor

    from theworld.cache_format.storage import NoRoomAhead

    local = _cache(tmp_path / "c", 8, per_shard=3)
    remote = _put_tree(s3, local, "together")
    truth = cf.CacheReader(local)
    sizes = [truth.shard_table.entry(i)["bytes"] for i in range(8)]
    budget = 2 * max(sizes) + min(sizes) // 2  # two shards fit, never three
    settings = cf.Settings(local_dir=str(tmp_path / "l"), local_max_gb=budget / 1e9)
    reader = cf.CacheReader(remote, settings=settings)

    def stage(i: int) -> bool:
        try:
            reader.stage(i, ahead=True)
        except NoRoomAhead:
            return False
        return True

    with ThreadPoolExecutor(8) as pool:
        staged = list(pool.map(stage, range(8)))
    held = sorted((tmp_path / "l" / "shards").glob("*.tar"))
    assert sum(staged) == len(held) == 2, (staged, held)
    assert sum(p.stat().st_size for p in held) <= budget
    assert not list((tmp_path / "l" / "shards").glob(".*.part"))


@pytest.mark.parametrize("attempt", range(3))
def test_with_room_for_two_shards_the_main_processs_first_batch_is_staged_before_the_workers(s3, tmp_path, attempt):
    """The main process's shards go first, the workers' after them: staged at once, a worker's could take the room
    the main process's first batch needs, which it would then read outside the budget's care for what is read ahead,
    evicting a worker's shard to download it again (an epoch downloaded 1.14x the cache, one round in four)."""
    local = _cache(tmp_path / "c", 8, per_shard=3)
    remote = _put_tree(s3, local, f"room{attempt}")
    truth = cf.CacheReader(local)
    budget = 2 * int(truth.shard_table.bytes.max())
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l"), local_max_gb=budget / 1e9))
    order = rank_indices(np.arange(len(truth)), attempt, 0, 4, 0, 1, shards=truth.shards, window=2)
    mine = list(dict.fromkeys(truth.shards[order[:4]].tolist()))  # the main process's first batch of 4
    ahead = ReadAhead(reader, order, 2)
    assert len(ahead.first(np.arange(3 * 4), 8)) > 2 >= len(mine)  # the workers want more than there is room for
    start = len(s3.log)
    stage_first(ahead, 4, np.arange(3 * 4), workers=2)
    staged = s3.downloads(start, r"\.tar$")
    assert {f"/{BUCKET}/room{attempt}/shards/shard-{i:06d}.tar" for i in mine} <= set(staged) and len(staged) == 2
    start = len(s3.log)
    assert [reader.raw(int(i)) for i in order[:4]] == [truth.raw(int(i)) for i in order[:4]]
    assert not s3.downloads(start, r"\.tar$")
