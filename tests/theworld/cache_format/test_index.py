"""The shard index (theworld/cache_format/index.py, layout.py, storage.py): every shard's and sample's record in a
few safetensors objects written before the manifest, so a cache in a bucket opens with a number of requests that does
not grow with its shards; a missing or stale index object is rebuilt from the sidecars with a note or refused in one
line; caches written before it (format 3) still open. Against the real S3 server of test_storage.py, behind its
request-logging proxy."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from tests.theworld.cache_format.conftest import BUCKET, as_format_3
from tests.theworld.cache_format.test_storage import _put_tree, members_by_key
from theworld import cache_format as cf
from theworld.cache_format import index, storage
from theworld.cache_format.names import SHARD_INDEX
from theworld.core.errors import CacheDamaged, UserError


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
    monkeypatch.setattr(index, "PART_SAMPLES", 8)  # several index objects from a small cache (shards of 2)
    folder = _cache(tmp_path / "c", 10)
    manifest = json.loads((folder / cf.MANIFEST).read_text())
    assert (manifest["num_shards"], manifest["num_samples"]) == (10, 20)
    # the list design.md's layout gives tools that read the tars, equal to the index the reader uses
    assert manifest["shards"] == cf.shard_table(folder, {k: v for k, v in manifest.items() if k != "shards"}).entries()
    entries = manifest["shard_index"]
    assert [e["shards"] for e in entries] == [[0, 4], [4, 8], [8, 10]]
    sides = []
    for e in entries:
        data = (folder / e["path"]).read_bytes()
        assert len(data) == e["bytes"] and data[8 : 8 + int.from_bytes(data[:8], "little")].startswith(b"{")
        part = index.decode(data, e)
        sides += [index.sidecar(part, i) for i in range(*e["shards"])]
    assert sides == [cf.read_sidecar(folder, i) for i in range(10)]
    table = cf.shard_table(folder, manifest)
    assert table.entries() == [
        {"path": f"shards/{s['shard']}", "num_samples": s["count"], "bytes": s["bytes"], "sha256": s["sha256"]}
        for s in sides
    ]
    assert (
        manifest["bytes"] == sum(s["bytes"] for s in sides) == (folder / "shards/shard-000003.tar").stat().st_size * 10
    )
    with pytest.raises(ValueError, match="sha256"):
        index.decode((folder / entries[1]["path"]).read_bytes(), entries[0])
    # the reader's arrays are the sidecars' records, concatenated across parts
    reader = cf.CacheReader(folder)
    assert reader.keys() == [s["key"] for side in sides for s in side["samples"]]
    assert reader.shards.tolist() == [i for i in range(10) for _ in range(2)]
    assert reader.latent_hw.tolist() == [[2, 2]] * 20 and reader.checksummed
    first = sides[3]["samples"][1]
    assert reader.raw(7) == {
        name: (folder / "shards/shard-000003.tar").read_bytes()[lo : lo + n]
        for name, (lo, n) in first["members"].items()
    }
    reader.check_consistency()


def test_the_index_parts_are_the_same_bytes_on_every_write(tmp_path):
    a, b = _cache(tmp_path / "a", 3), _cache(tmp_path / "b", 3)
    assert (a / cf.MANIFEST).read_bytes() == (b / cf.MANIFEST).read_bytes()


def test_a_missing_or_stale_local_index_part_is_rebuilt_from_the_sidecars_or_refused_in_one_line(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(index, "PART_SAMPLES", 8)
    folder = _cache(tmp_path / "c", 10)
    want = members_by_key(cf.CacheReader(folder))
    part = folder / SHARD_INDEX / index.part_name(1)
    good = part.read_bytes()
    part.write_bytes(good[:-1] + b"x")  # stale: its sha256 differs from the manifest's
    assert members_by_key(cf.CacheReader(folder)) == want
    assert f"shard index part {SHARD_INDEX}/{part.name} sha256 differs" in caplog.text
    assert "building it from the sidecars of shards 4-7" in caplog.text
    part.unlink()
    caplog.clear()
    assert members_by_key(cf.CacheReader(folder)) == want and "is missing; building it" in caplog.text
    cf.sidecar_path(folder, 5).unlink()  # the sidecars are gone too: refused, naming the part
    with pytest.raises(cf.storage.UserError) as e:
        cf.CacheReader(folder)
    assert len(str(e.value).splitlines()) == 1 and f"{SHARD_INDEX}/{part.name}" in str(e.value), str(e.value)
    assert "rerun the precompute command" in str(e.value)


def test_a_format_3_cache_opens_locally_and_remotely_and_reads_the_same_samples(s3, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    new = _cache(tmp_path / "new", 5)
    old = _cache(tmp_path / "old", 5)
    as_format_3(old)
    want = members_by_key(cf.CacheReader(new))
    reader = cf.CacheReader(old)
    assert members_by_key(reader) == want and reader.manifest["written_as"] == 3
    assert (
        reader.manifest["num_shards"] == 5
        and reader.manifest["bytes"] == json.loads((new / cf.MANIFEST).read_text())["bytes"]
    )
    assert "written as format 3, so opening it parses every sidecar record (5 shards" in caplog.text
    reader.check_consistency()
    assert cf.shard_table(old, reader.manifest).entries() == cf.shard_table(new, cf.load_manifest(new)).entries()
    remote = _put_tree(s3, old, "fmt3")
    start = len(s3.log)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert not [p for p in _gets(s3, start, "fmt3") if "/shards/" in p]  # its JSON index, not the sidecars
    assert members_by_key(reader) == want
    reader.check_consistency()


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


def test_parts_hold_a_span_of_samples_whatever_the_shards_size(monkeypatch):
    assert index.part_bounds(np.ones(16384, np.int64)) == [0, 16384]  # small shards: one part, one object to fetch
    assert index.part_bounds(np.full(10000, 1024, np.int64)) == [0, 4096, 8192, 10000]  # DataComp's shards
    assert index.part_bounds(np.zeros(0, np.int64)) == [0]
    monkeypatch.setattr(index, "PART_SAMPLES", 8)
    # first samples at 0, 3, 6, 9, 29, 30, 30: spans 0, 0, 0, 1, 3, 3, 3 (a shard over the span is a part alone)
    assert index.part_bounds(np.array([3, 3, 3, 20, 1, 0, 2])) == [0, 3, 4, 7]
    # a plan's count, in integers: the same as the bounds of that many equal shards
    for shards, size in [(0, 3), (1, 3), (5, 1), (9, 3), (17, 4), (6, 8), (4, 9), (7, 20)]:
        assert index.parts_of(shards, size) == len(index.part_bounds(np.full(shards, size))) - 1, (shards, size)


def test_a_cache_of_many_small_shards_opens_in_one_round_and_finds_each_shards_record(s3, tmp_path):
    """5,000 one-sample shards (more than a part held when parts were counted in shards): the index is one part,
    asked for beside the manifest, and the stand-in folder gives each shard's record from it."""
    from theworld.cache_format.layout import read_sidecar, write_manifest

    folder = tmp_path / "c"
    folder.mkdir()
    member = {cf.LATENT: [512, 64]}
    sides = [
        {
            "count": 1,
            "bytes": 1024,
            "sha256": hashlib.sha256(b"%d" % i).hexdigest(),
            "format_version": cf.FORMAT_VERSION,
            "samples": [{"key": f"k{i:05d}", "members": member, "latent_shape": [16, 1, 2, 2]}],
        }
        for i in range(5000)
    ]
    write_manifest(
        folder, sides, fingerprint={}, latent_shape=[16, 1, 2, 2], latent_dtype="float32", num_errors=0, contents={}
    )
    (folder / cf.ERRORS).write_text("")
    remote = _put_tree(s3, folder, "small-shards")
    start = len(s3.log)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    ranged = f"bytes=0-{storage.GUESS_BYTES - 1}"
    assert _index_gets(s3, start, "small-shards") == {index.part_name(0): [ranged], index.TABLE: [ranged]}
    assert len(reader) == 5000 and reader.shard_of(4999) == 4999
    assert read_sidecar(reader.cache_dir, 4999)["samples"][0]["key"] == "k04999"


def test_a_remote_cache_with_parts_of_unequal_shards_gives_each_shards_record(s3, tmp_path, monkeypatch):
    """Parts of 2 and 1 shards alternately: the stand-in folder finds each shard's record in the part that holds it
    (what the final step and `precompute.inspect verify` read of a cache in a bucket)."""
    from theworld.cache_format.layout import read_sidecar

    monkeypatch.setattr(index, "PART_SAMPLES", 3)  # shards of 2 start at 0, 2, 4, 6, ...: spans 0, 0, 1, 2, 2, ...
    local = _cache(tmp_path / "c", 10)
    sizes = [b - a for a, b in (e["shards"] for e in cf.load_manifest(local)["shard_index"])]
    assert sizes == [2, 1, 2, 1, 2, 1, 1]
    reader = cf.CacheReader(_put_tree(s3, local, "unequal"), settings=cf.Settings(local_dir=str(tmp_path / "l")))
    for i in range(10):
        want = json.loads(cf.sidecar_path(local, i).read_text())
        got = read_sidecar(reader.cache_dir, i)
        assert [s["key"] for s in got["samples"]] == [s["key"] for s in want["samples"]], i
        assert (got["sha256"], got["count"]) == (want["sha256"], want["count"])
    assert read_sidecar(reader.cache_dir, 10) is None


def test_a_cache_rewritten_in_fewer_parts_keeps_no_part_its_manifest_does_not_name(tmp_path, monkeypatch):
    """A cache written in parts of another size (an earlier version's, 4,096 shards a part) and written again:
    the parts the new manifest does not name go, and it reads the same."""
    from theworld.cache_format.layout import write_manifest

    monkeypatch.setattr(index, "PART_SAMPLES", 4)
    folder = _cache(tmp_path / "c", 6)  # shards of 2: three parts
    assert len(list((folder / SHARD_INDEX).glob("part-*"))) == 3
    want = members_by_key(cf.CacheReader(folder))
    monkeypatch.undo()
    m = cf.load_manifest(folder)
    sides = [json.loads(cf.sidecar_path(folder, i).read_text()) for i in range(6)]
    fields = ("fingerprint", "latent_shape", "latent_dtype", "num_errors", "contents")
    write_manifest(folder, sides, **{k: m[k] for k in fields})
    assert sorted(p.name for p in (folder / SHARD_INDEX).glob("part-*")) == [index.part_name(0)]
    assert members_by_key(cf.CacheReader(folder)) == want


def test_a_parts_first_shard_is_read_from_its_header_and_damaged_headers_are_none(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "PART_SAMPLES", 3)
    folder = _cache(tmp_path / "c", 4)  # shards of 2: parts of shards 0-1, 2, 3
    firsts = [index.first_shard(folder / e["path"]) for e in cf.load_manifest(folder)["shard_index"]]
    assert firsts == [0, 2, 3]
    for name, data in [
        ("huge", (1 << 62).to_bytes(8, "little") + b"{}"),  # a length no file holds: not allocated
        ("cut", (40).to_bytes(8, "little") + b'{"__metadata__":'),
        ("list", (2).to_bytes(8, "little") + b"[]"),
        ("empty", b""),
    ]:
        (tmp_path / name).write_bytes(data)
        assert index.first_shard(tmp_path / name) is None, name


def _index_gets(proxy, start: int, prefix: str) -> dict[str, list[str | None]]:
    """{shard-index object: the Range header of each GET of it} since `start`."""
    out: dict[str, list[str | None]] = {}
    for m, p, r in proxy.log[start:]:
        if m == "GET" and p.startswith(f"/{BUCKET}/{prefix}/{SHARD_INDEX}/"):
            out.setdefault(p.rsplit("/", 1)[1], []).append(r)
    return out


def test_the_shard_index_is_asked_for_with_the_manifest_and_fetched_once(s3, tmp_path):
    """A cache whose index fits in GUESS_BYTES opens in one round of requests: its first part and shard table are
    asked for as byte ranges beside the manifest, and what the manifest then names is not asked for again."""
    remote = _put_tree(s3, _cache(tmp_path / "c", 6), "guess")
    start = len(s3.log)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    ranged = f"bytes=0-{storage.GUESS_BYTES - 1}"
    assert _index_gets(s3, start, "guess") == {index.part_name(0): [ranged], index.TABLE: [ranged]}
    assert members_by_key(reader) == members_by_key(cf.CacheReader(tmp_path / "c"))
    reader.check_consistency()


def test_an_index_larger_than_the_guess_is_fetched_as_the_manifest_names_it(s3, tmp_path, monkeypatch):
    """Over GUESS_BYTES the guess is cut short and dropped: the part is then fetched whole, and reads the same."""
    remote = _put_tree(s3, _cache(tmp_path / "c", 6), "big")
    monkeypatch.setattr(storage, "GUESS_BYTES", 64)
    start = len(s3.log)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert _index_gets(s3, start, "big")[index.part_name(0)] == ["bytes=0-63", None]
    assert members_by_key(reader) == members_by_key(cf.CacheReader(tmp_path / "c"))


def test_a_missing_or_stale_index_object_is_rebuilt_from_the_sidecars_with_a_note(s3, tmp_path, caplog):
    folder = _cache(tmp_path / "c", 6)
    remote = _put_tree(s3, folder, "stale")
    entry = json.loads((folder / cf.MANIFEST).read_text())["shard_index"][0]
    other = _cache(tmp_path / "other", 6, per_shard=3)  # another cache's index at the same name: stale
    s3.fs.put_file(str(other / entry["path"]), f"{BUCKET}/stale/{entry['path']}")
    start = len(s3.log)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    assert "shard index object sha256 differs" in caplog.text and "reading the sidecars" in caplog.text
    gets = _gets(s3, start, "stale")
    assert len([p for p in gets if p.endswith(".json") and "/shards/" in p]) == 6  # each sidecar once
    assert gets.count(f"/{BUCKET}/stale/{cf.MANIFEST}") == 1
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
    as_format_3(folder)
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


def _open_fails_in_one_line_within_10_s(port: int, tmp_path, monkeypatch) -> None:
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


def test_an_unreachable_endpoint_is_one_line_within_10_s(s3, tmp_path, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _open_fails_in_one_line_within_10_s(port, tmp_path, monkeypatch)


def test_an_endpoint_that_drops_connections_is_one_line_within_10_s(s3, tmp_path, monkeypatch):
    """A firewall that drops the packets: connects hang until the connect timeout, on every attempt."""
    import socket

    with contextlib.ExitStack() as sockets:
        server = sockets.enter_context(socket.socket())
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        for _ in range(8):  # a full accept queue: the kernel drops later connection requests unanswered
            sock = sockets.enter_context(socket.socket())
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
        probe = sockets.enter_context(socket.socket())
        probe.settimeout(0.5)
        with pytest.raises(TimeoutError):  # the premise: a connect here goes unanswered
            probe.connect(("127.0.0.1", port))
        _open_fails_in_one_line_within_10_s(port, tmp_path, monkeypatch)


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


def test_the_final_step_reads_each_process_records_object_and_checks_each_file_by_its_md5(s3, tmp_path):
    """Precompute's final step (RemoteWriter.fetch_records) on rank 0: listings and the other processes' records
    objects, not two requests per shard; a file whose object changed after its records object (md5 differs from the
    listing's) is requested alone."""
    n = 24
    other = storage.for_writing(f"s3://{BUCKET}/recs", cf.Settings(local_dir=str(tmp_path / "other")))
    for i in range(n):
        cf.tar_path(other.out, i).parent.mkdir(parents=True, exist_ok=True)
        cf.error_path(other.out, i).parent.mkdir(parents=True, exist_ok=True)
        cf.tar_path(other.out, i).write_bytes(b"x" * (10 + i))
        cf.sidecar_path(other.out, i).write_text(json.dumps({"bytes": 10 + i, "count": i}))
        cf.error_path(other.out, i).write_text(json.dumps({"reason": f"r{i}"}) + "\n" if i % 3 else "")
    _put_tree(s3, other.out, "recs")
    other.put_records(1, range(n))
    changed = json.dumps({"bytes": 17, "count": 99}).encode()  # a later run's sidecar of shard 7
    s3.fs.pipe_file(f"{BUCKET}/recs/shards/shard-000007.json", changed)
    rank0 = storage.for_writing(f"s3://{BUCKET}/recs", cf.Settings(local_dir=str(tmp_path / "rank0")))
    rank0.out.mkdir(parents=True)
    start = len(s3.log)
    rank0.fetch_records(n)
    gets = [p for m, p, _ in s3.log[start:] if m == "GET"]
    assert [p for p in gets if p.startswith(f"/{BUCKET}/recs/")] == [
        f"/{BUCKET}/recs/shard-records/rank-00001.json.gz",
        f"/{BUCKET}/recs/shards/shard-000007.json",
    ], gets
    assert len(gets) <= 2 + 4  # and three listings (a page each)
    for i in range(n):
        for path in (cf.sidecar_path, cf.error_path):
            want = changed if (path, i) == (cf.sidecar_path, 7) else path(other.out, i).read_bytes()
            assert path(rank0.out, i).read_bytes() == want


EDITS = {
    "fewer": (lambda m: m["shards"][:2], "lists 2 shards, its shard index 3"),
    "bytes": (lambda m: [*m["shards"][:1], {**m["shards"][1], "bytes": 1}, m["shards"][2]], "shards[1] differs"),
    "not a list": (lambda m: 5, "'shards' is not a list"),
    "numbers": (lambda m: [1, 2, 3], "shard list is not [{path, num_samples, bytes, sha256}]"),
    "no path": (lambda m: [{k: v for k, v in e.items() if k != "path"} for e in m["shards"]], "shards[0] is None"),
    "short sha256": (lambda m: [{**e, "sha256": "ab"} for e in m["shards"]], "shard list is not"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_a_manifest_list_that_departs_from_the_index_is_one_line(tmp_path, edit):
    """A format-4 manifest still lists the shards (design.md's layout); its list and its index must agree, and a
    list of another shape is one line too."""
    folder = _cache(tmp_path / "c", 3)
    manifest = json.loads((folder / cf.MANIFEST).read_text())
    change, want = EDITS[edit]
    manifest["shards"] = change(manifest)
    cf.atomic_write_json(folder / cf.MANIFEST, manifest)
    reader = cf.CacheReader(folder)
    assert "shards" not in reader.manifest  # compared with the index as it opened, then not kept
    with pytest.raises(CacheDamaged) as e:
        reader.check_consistency()
    assert want in str(e.value) and "\n" not in str(e.value), str(e.value)


def _wide(part: index.Part) -> bytes:
    """A part as format 4 first wrote it: int64 spans and crc32 (-1: absent, none recorded), int32 (N, 4) shapes."""
    width = max(part.keys.dtype.itemsize, 1)
    tensors = {
        "count": part.count,
        "bytes": part.bytes,
        "sha256": part.sha256,
        "text_rule": part.text_rule.astype(np.int32),
        "keys": np.frombuffer(part.keys.astype(f"S{width}").tobytes(), dtype=np.uint8).reshape(-1, width),
        "spans": part.spans,
        "crc32": part.crc32,
        "latent_shape": part.latent_shape,
    }
    meta = {"index": json.dumps({"first": part.first, "names": part.names, "rules": part.rules}, sort_keys=True)}
    return st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=meta)


def _odd_sidecars(tar_bytes: int) -> list[dict]:
    """Two shards whose samples differ in members, checksums and latent shapes."""

    def sample(k: int, members: dict, crc: dict, hw: int) -> dict:
        return {"key": f"k{k}", "members": members, "crc32": crc, "latent_shape": [16, 1, hw, hw]}

    samples = [
        sample(0, {"txt": [512, 3], "json": [1024, 9]}, {"txt": 0xFFFFFFFF, "json": 0}, 2),
        sample(1, {"txt": [2048, 4], "json": [3072, 5], "image": [4096, 100]}, {"txt": 7}, 4),  # json, image: none
        sample(2, {"txt": [512, 3], "json": [1024, 9]}, {"txt": 1, "json": 2}, 2),
    ]
    sha = "ab" * 32
    return [
        {"count": 2, "bytes": tar_bytes, "sha256": sha, "text_rule": "r1", "samples": samples[:2]},
        {"count": 1, "bytes": 8192, "sha256": sha, "samples": samples[2:]},
    ]


@pytest.mark.parametrize("tar_bytes", [8192, 5 << 30])
def test_a_part_is_written_narrow_and_reads_back_the_same_records(tar_bytes):
    part = index.build(_odd_sidecars(tar_bytes), 7)
    data = index.encode(part)
    head = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    # uint32 spans while every tar is under 4 GiB (a larger one keeps the part's spans int64), uint32 crc32 with a
    # mask for the members without one, one latent shape id a sample
    assert head["spans"]["dtype"] == ("U32" if tar_bytes < 1 << 32 else "I64")
    assert (head["crc32"]["dtype"], head["crc32_missing"]["shape"]) == ("U32", [3, 3])
    assert (head["latent_shapes"]["shape"], head["latent_shape_id"]["dtype"]) == ([2, 4], "U8")
    back = index.decode_unchecked(data)
    for name in ("count", "bytes", "sha256", "text_rule", "keys", "spans", "crc32", "latent_shape"):
        np.testing.assert_array_equal(getattr(back, name), getattr(part, name), err_msg=name)
    assert (back.first, back.names, back.rules) == (7, part.names, part.rules)
    assert [index.sidecar(back, i) for i in (7, 8)] == [index.sidecar(part, i) for i in (7, 8)]
    assert back.crc32[0, part.names.index("txt")] == 0xFFFFFFFF  # a real crc32, not the "none" of a uint32


def test_a_part_of_one_latent_shape_and_full_checksums_holds_neither_ids_nor_a_mask(tmp_path):
    folder = _cache(tmp_path / "c", 2)
    data = (folder / json.loads((folder / cf.MANIFEST).read_text())["shard_index"][0]["path"]).read_bytes()
    head = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert "latent_shape_id" not in head and "crc32_missing" not in head and head["latent_shapes"]["shape"] == [1, 4]


def test_a_cache_whose_parts_are_format_4_as_first_written_still_opens(tmp_path):
    """Parts written wide (int64 spans and crc32, a shape per sample) before the narrow layout read the same."""
    folder = _cache(tmp_path / "c", 3)
    want = members_by_key(cf.CacheReader(folder))
    manifest = json.loads((folder / cf.MANIFEST).read_text())
    for e in manifest["shard_index"]:
        data = _wide(index.decode_unchecked((folder / e["path"]).read_bytes()))
        (folder / e["path"]).write_bytes(data)
        e["bytes"], e["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (folder / cf.MANIFEST).write_text(json.dumps(manifest))
    reader = cf.CacheReader(folder)
    assert members_by_key(reader) == want and reader.checksummed and reader.latent_hw.tolist() == [[2, 2]] * 6
    reader.check_consistency()


def without_candidates(table: bytes) -> bytes:
    """A shard table as written before the held-out candidates: the same object less their tensors and count."""
    head = json.loads(table[8 : 8 + int.from_bytes(table[:8], "little")])
    facts = json.loads(head["__metadata__"]["table"])
    del facts["held_out_candidates"]
    tensors = {k: v for k, v in st_load(table).items() if not k.startswith("held_out_")}
    return st_save(tensors, metadata={"table": json.dumps(facts, sort_keys=True)})


def test_the_shard_table_keeps_each_parts_smallest_key_digests_and_one_written_before_reads_without_them(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(index, "HELD_OUT_CANDIDATES", 3)

    def side(i: int, n: int) -> dict:
        samples = [{"key": f"k{i}-{j}", "members": {"txt": [512, 3]}, "crc32": {"txt": 1}} for j in range(n)]
        return {"count": n, "bytes": 4096, "sha256": f"{i:02x}" * 32, "samples": samples}

    a, b = index.build([side(0, 3), side(1, 2)], 0), index.build([side(2, 2)], 2)  # 5 samples, then 2 (< 3)
    data = index.encode_table([index.Summary.of(a), index.Summary.of(b)])
    path = tmp_path / index.TABLE
    path.write_bytes(data)
    table = index.read_table(path, {"sha256": hashlib.sha256(data).hexdigest()})
    keys = ["k0-0", "k0-1", "k0-2", "k1-0", "k1-1", "k2-0", "k2-1"]
    digest = [hashlib.sha256(k.encode()).digest() for k in keys]
    first = sorted(range(5), key=digest.__getitem__)[:3]  # part a's 3 smallest; part b keeps both of its 2
    want = sorted([*first, 5, 6], key=digest.__getitem__)  # in digest order across the cache
    c = table.held_out
    assert c.per_part == 3 and c.index.tolist() == want and c.index.dtype == np.int64
    assert [bytes(r) for r in c.sha256] == [digest[i] for i in want]  # whole digests: 32 bytes each
    assert c.keys.tolist() == [keys[i].encode() for i in want]
    old = without_candidates(data)
    (tmp_path / "old").write_bytes(old)  # another file: `table` maps this one
    before = index.read_table(tmp_path / "old", {"sha256": hashlib.sha256(old).hexdigest()})
    assert before.held_out is None and before.text_bytes.tolist() == table.text_bytes.tolist()
    assert before.shards.entries() == table.shards.entries() and before.names == table.names
