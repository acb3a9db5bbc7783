"""Reading a cache: `CacheReader` (random access by global sample index through the sidecars' byte offsets),
`decode_sample`, and `load_stacked` (one tensor member of a batch's samples in one copy)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load

from theworld.cache_format import index, sample_index, storage
from theworld.cache_format.layout import (
    REBUILD_MANIFEST,
    Sample,
    index_parts,
    load_manifest,
    read_from_list,
    repair_hint,
    shard_stem,
    shard_table,
    sidecar_path,
    tar_path,
)
from theworld.cache_format.names import CAPTION, IMAGE, LATENT, LATENT_FLIP, MANIFEST, META, SHARDS, SIGLIP
from theworld.core.errors import CacheDamaged, UserError

# ----------------------------------------------------------------------------------------------------------------------
# One sample


def decode_sample(key: str, members: dict[str, bytes], tensors: bool = True) -> Sample:
    """{member name: bytes} -> Sample. Missing optional members stay None; so do the tensors with tensors=False
    (a batch's are decoded together by `load_stacked`)."""
    s = Sample(key=key, caption=members[CAPTION].decode(), meta=json.loads(members[META]), image=members.get(IMAGE))
    if not tensors:
        return s
    if LATENT in members:
        t = st_load(members[LATENT])
        s.mean, s.logvar = t["mean"], t.get("logvar")
    if LATENT_FLIP in members:
        t = st_load(members[LATENT_FLIP])
        s.flip_mean, s.flip_logvar = t["mean"], t.get("logvar")
    if SIGLIP in members:
        s.siglip = st_load(members[SIGLIP])["features"]
    return s


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # what DTYPES writes


def load_stacked(blobs: list[bytes]) -> dict[str, torch.Tensor]:
    """The same tensor member (e.g. LATENT) of many samples -> {tensor name: (len(blobs), *shape)}.

    The samples of a cache share that member's safetensors header byte for byte (same names, dtypes and shapes, and
    `st_save` is deterministic), so the header is parsed once and every sample's data is sliced at the same offsets:
    one copy for the whole batch instead of a parse, a tensor and a stack per sample, which were a loader worker's
    largest CPU cost (docs/performance.md). Blobs whose headers differ go through safetensors one by one.
    """
    first = blobs[0]
    start = 8 + int.from_bytes(first[:8], "little")  # safetensors: u64 header size, JSON header, then the data
    head = first[:start]
    layout = _stackable_layout(head, len(first) - start)
    if layout is None or any(len(b) != len(first) or not b.startswith(head) for b in blobs):
        return _load_each_and_stack(blobs)
    data = bytearray().join(memoryview(b)[start:] for b in blobs)
    rows = torch.frombuffer(data, dtype=torch.uint8).view(len(blobs), -1)
    return {
        name: rows[:, lo:hi].view(dtype).view(len(blobs), *shape) for name, (dtype, shape, lo, hi) in layout.items()
    }


def _stackable_layout(header: bytes, data_size: int) -> dict | None:
    """{name: (dtype, shape, first byte, end byte)} when every tensor can be a view of a (samples, data_size) byte
    matrix: little-endian host, a dtype we map, offsets on element boundaries. None: decode one by one."""
    if sys.byteorder != "little":  # safetensors data is little-endian
        return None
    try:
        meta = json.loads(header[8:])
        layout = {
            name: (_ST_DTYPES[v["dtype"]], tuple(v["shape"]), *v["data_offsets"])
            for name, v in meta.items()
            if name != "__metadata__"
        }
    except (ValueError, KeyError, TypeError):
        return None
    for dtype, _, lo, hi in layout.values():
        size = dtype.itemsize
        if lo % size or hi % size or data_size % size or hi > data_size or hi <= lo:
            return None
    return layout


def _load_each_and_stack(blobs: list[bytes]) -> dict[str, torch.Tensor]:
    loaded = [st_load(b) for b in blobs]
    first = loaded[0]
    for t in loaded[1:]:
        if t.keys() != first.keys() or any(t[k].shape != first[k].shape or t[k].dtype != first[k].dtype for k in t):
            raise ValueError(
                "samples of one batch hold different tensors: "
                f"{ {k: (tuple(v.shape), v.dtype) for k, v in first.items()} } vs "
                f"{ {k: (tuple(v.shape), v.dtype) for k, v in t.items()} }"
            )
    return {k: torch.stack([t[k] for t in loaded]) for k in first}


# ----------------------------------------------------------------------------------------------------------------------
# Random access reading


def _sidecar_mismatch(sides: index.ShardTable, table: index.ShardTable, i: int) -> str:
    """What differs between shard i's sidecar (count, bytes, sha256) and the manifest's record: a pair that is another
    shard's (copied or swapped files) is named as such."""
    side, e = sides.entry(i), table.entry(i)
    same = np.flatnonzero((table.sha256 == sides.sha256[i]).all(1))
    j = next((int(j) for j in same if j != i), None)
    if j is not None:
        swapped = sides.entry(j)["sha256"] == e["sha256"]
        return (
            f"it and its sidecar hold what {MANIFEST} lists for {shard_stem(j)}.tar (sha256 {side['sha256'][:12]}...), "
            f"not this shard's (sha256 {e['sha256'][:12]}...)"
            + (
                f", and {shard_stem(j)}.tar holds this shard's: the two were swapped"
                if swapped
                else ": the files were copied over it"
            )
            + "; put each shard's .tar and .json back under its own name"
        )
    fields = [
        f"{name} {got} vs {want}"
        for name, got, want in (
            ("count", side["num_samples"], e["num_samples"]),
            ("bytes", side["bytes"], e["bytes"]),
            ("sha256", f"{side['sha256'][:12]}...", f"{e['sha256'][:12]}..."),
        )
        if got != want
    ]
    return (
        f"its sidecar does not match {MANIFEST} ({'; '.join(fields)}, sidecar vs manifest): the shard changed "
        "after the cache was built"
    )


@dataclass
class CacheReader:
    """Random access to a complete cache by global sample index, via the sidecars' byte offsets (no tar scan).

    The index is kept in numpy arrays (keys as fixed-width bytes, member spans), not per-sample Python objects, and
    forked DataLoader workers share it without copying (no refcounts to touch): whole in memory, or a part at a time
    for a large cache (sample_index.py).
    Picklable (file descriptors are opened lazily per process). `members` limits what is read, e.g. skip the image
    bytes when every latent comes from the cache; the caption and json are always read.

    `cache_dir` may be a URL (storage.py): the index is read from its local stand-in folder (which `cache_dir` then
    is) and each shard's tar from the per-node shard cache, by the same preads. `remote`: the handle of a remote cache
    opened before (`storage.open_cache`), whose stand-in folder `cache_dir` is; not fetched again.
    """

    cache_dir: Path
    members: tuple[str, ...] | None = None
    settings: storage.Settings | None = None  # for a URL: storage.options and the shard cache
    manifest: dict = field(init=False)
    _index: sample_index.Whole | sample_index.Lazy = field(init=False, repr=False)  # per sample: key, shard, spans
    _sides: index.ShardTable = field(init=False, repr=False)  # per shard: the sidecars' (count, bytes, sha256)
    shard_table: index.ShardTable = field(
        init=False, repr=False
    )  # per shard: what the cache lists (layout.shard_table)
    text_rules: np.ndarray = field(init=False, repr=False)  # per shard: the sidecar's "text_rule" (None: not recorded)
    _files: dict = field(init=False, repr=False, default_factory=dict)
    _list_problem: str | None = field(init=False, repr=False, default=None)  # the shard list's (check_consistency)
    remote: storage.RemoteCache | None = field(repr=False, default=None)
    # accepted as callers of the earlier releases pass it, and ignored: a remote cache's shards are not listed (see
    # check_consistency), so there is no listing to ask for early
    list_shards: bool = field(repr=False, default=False)
    # Members closer than this are read with one pread, tar headers and skipped members included: a system call
    # costs more than copying a few kB (docs/performance.md)
    READ_GAP = 16 << 10

    # A remote cache keeps this many shards open per process, so evicted ones give their space back
    REMOTE_OPEN = 4

    def __post_init__(self) -> None:
        self.cache_dir, self.remote = storage.open_cache(self.cache_dir, self.settings, self.remote)
        self.manifest = load_manifest(self.cache_dir, self.remote.take_manifest() if self.remote else None)
        if sample_index.is_lazy(self.manifest):
            self._index = self._lazy_index()
        else:
            j = index.join(index_parts(self.cache_dir, self.manifest))
            self._index = sample_index.Whole(j, bool((j.crc32[j.spans[..., 0] >= 0] >= 0).all()))
        self._sides, self.text_rules = self._index.sides, self._index.text_rules
        # the manifest's per-shard records (format 1-3); from format 4 on the index is that record
        listed = read_from_list(self.manifest)
        self.shard_table = shard_table(self.cache_dir, self.manifest) if listed else self._sides
        # From format 4 on the manifest's shard list is for tools that read the tars: it is compared with the index
        # here, once, and not kept (1.37M dicts at DataComp-1B, 570 MB a process for the whole run)
        entries = self.manifest["shards"] if listed else self.manifest.pop("shards", None)
        self._list_problem = _list_problem(entries, self.shard_table, not listed)
        if len(missing := self._index.shapeless()):
            raise UserError(
                f"cache {self.cache_dir}: shard {self.shard_of(int(missing[0]))}'s sidecar lacks per-sample latent "
                "shapes and the manifest has no common latent_shape"
            )

    def _lazy_index(self) -> sample_index.Lazy:
        entry = self.manifest["shard_table"]
        try:
            table = index.read_table(self.cache_dir / entry["path"], entry)
        except (OSError, ValueError) as e:
            what = "is missing" if isinstance(e, FileNotFoundError) else str(e)
            raise CacheDamaged(
                f"cache {self.cache_dir}: shard table {entry['path']} {what}; {REBUILD_MANIFEST}"
            ) from None

        return sample_index.Lazy(table, self.manifest["shard_index"], self._part_path, self._part_problem)

    def _part_path(self, part: dict) -> Path:
        """A local file of a shard index part: the cache's own, or the node's copy of a remote one."""
        return self.cache_dir / part["path"] if self.remote is None else self.remote.index_part(part)

    def _part_problem(self, shard: int, key: str | None, what: str) -> CacheDamaged:
        where = f"shard {tar_path(self.cache_dir, shard).name}" + (f", sample {key}" if key else "")
        hint = REBUILD_MANIFEST if key is None else repair_hint(self.cache_dir, shard)
        return CacheDamaged(f"cache {self.cache_dir}: {where}: {what}; {hint}")

    @property
    def lazy(self) -> bool:
        """Whether the index is read a part at a time (a large cache): start-of-run passes then read no text."""
        return isinstance(self._index, sample_index.Lazy)

    def text_bytes(self) -> np.ndarray:
        """(N,) uint16: each sample's caption and json bytes together (index.text_bytes), read from no tar."""
        return self._index.text_bytes()

    @property
    def latent_hw(self) -> np.ndarray:
        """(N, 2) int32: each sample's latent (h, w) (a read-only broadcast where a lazily read cache has one)."""
        return self._index.latent_hw

    @property
    def checksummed(self) -> bool:
        """Whether every member of every sample has a recorded crc32 (caches written before them have none)."""
        return self._index.checksummed

    def check_consistency(self) -> None:
        """Cheap start-of-run checks (no data read): manifest, sidecars (or the index) and tars agree on shards,
        counts and sizes, every member lies inside its tar, no key occurs twice. Raises CacheDamaged naming the shard
        and the repair. A remote cache's objects are not listed: that is a request per 1,000 objects, one after
        another (minutes a process at DataComp size); its manifest is written once precompute has checked every
        shard against the bucket, and each shard is checked against its size and sha256 as it is downloaded."""
        d = self.cache_dir
        table, n = self.shard_table, len(self.shard_table)
        on_disk = self._tar_sizes() if self.remote is None else None
        if on_disk is not None and (extra := sorted(set(on_disk) - {f"{shard_stem(i)}.tar" for i in range(n)})):
            raise CacheDamaged(
                f"cache {d}: {MANIFEST} lists {n} shards but {SHARDS}/ also holds "
                f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}; {REBUILD_MANIFEST}"
            )
        if self._list_problem:
            raise CacheDamaged(f"cache {d}: {self._list_problem}; {REBUILD_MANIFEST}")
        if on_disk is not None and len(missing := [i for i in range(n) if f"{shard_stem(i)}.tar" not in on_disk]):
            raise CacheDamaged(
                f"cache {d}: shard {tar_path(d, missing[0]).name} is missing; {repair_hint(d, missing[0])}"
            )
        sizes = table.bytes if on_disk is None else [on_disk[f"{shard_stem(i)}.tar"] for i in range(n)]
        sizes = np.asarray(sizes, dtype=np.int64)
        sides = self._sides
        if len(bad := np.flatnonzero(sides.differs(table))):
            i = int(bad[0])
            raise CacheDamaged(
                f"cache {d}: shard {tar_path(d, i).name}: {_sidecar_mismatch(sides, table, i)}; {repair_hint(d, i)}"
            )
        counts = sides.count
        if len(bad := np.flatnonzero((counts != table.count) | (sizes != table.bytes))):
            i = int(bad[0])
            raise CacheDamaged(
                f"cache {d}: shard {tar_path(d, i).name}: {counts[i]} samples in the sidecar and {sizes[i]} bytes "
                f"on disk, {MANIFEST} says {table.count[i]} and {table.bytes[i]}; {repair_hint(d, i)}"
            )
        if int(counts.sum()) != self.manifest["num_samples"]:
            raise CacheDamaged(
                f"cache {d}: shards hold {int(counts.sum())} samples, {MANIFEST} says "
                f"{self.manifest['num_samples']}; {REBUILD_MANIFEST}"
            )
        if self.lazy:  # each part's spans and keys are checked as it loads
            self._check_unique_shards()
            return
        spans, shard = self._index.j.spans, self._index.j.shard
        ends = spans[..., 0] + spans[..., 1]
        bad = (spans[..., 0] >= 0) & ((spans[..., 1] < 0) | (ends > table.bytes[shard][:, None]))
        if bad.any():
            j = int(np.argwhere(bad)[0][0])
            raise CacheDamaged(
                f"cache {d}: shard {tar_path(d, int(shard[j])).name}, sample {self.key(j)}: its "
                f"sidecar places a member outside the tar; {repair_hint(d, int(shard[j]))}"
            )
        self._check_unique_keys()

    def _check_unique_shards(self) -> None:
        """A shard replaced by a copy of another (its keys twice in the cache), told by equal sha256s: what
        `_check_unique_keys` finds without every key in memory."""
        sha = self._sides.sha256
        order = np.lexsort(sha.T[::-1])
        if len(same := np.flatnonzero((sha[order][1:] == sha[order][:-1]).all(1))):
            a, b = sorted((int(order[same[0]]), int(order[same[0] + 1])))
            d = self.cache_dir
            raise CacheDamaged(
                f"cache {d}: shards {tar_path(d, a).name} and {tar_path(d, b).name} are the same bytes: one shard was "
                f"replaced by a copy; to repair: delete {sidecar_path(d, b).name} and {sidecar_path(d, a).name} in "
                f"{d / SHARDS} and rerun the precompute command that built this cache (it rebuilds those shards alone)"
            )

    def _tar_sizes(self) -> dict[str, int]:
        """{tar name: bytes} of the shards folder."""
        out = {}
        for p in (self.cache_dir / SHARDS).glob("shard-*.tar"):
            try:
                if p.is_file():
                    out[p.name] = p.stat().st_size
            except OSError:
                continue
        return out

    def _check_unique_keys(self) -> None:
        keys = self._index.keys()
        order = np.argsort(keys, kind="stable")
        same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
        if len(same):
            a, b = int(order[same[0]]), int(order[same[0] + 1])
            sa, sb = self.shard_of(a), self.shard_of(b)
            d = self.cache_dir
            raise CacheDamaged(
                f"cache {d}: key {self.key(a)} occurs twice (shards {tar_path(d, sa).name} and "
                f"{tar_path(d, sb).name}): one shard was replaced by a copy; to repair: delete "
                f"{sidecar_path(d, sb).name}"
                + (f" and {sidecar_path(d, sa).name}" if sa != sb else "")
                + f" in {d / SHARDS} and rerun the precompute command that built this cache "
                "(it rebuilds those shards alone)"
            )

    def damaged(self, index: int, what: str) -> CacheDamaged:
        """The one-line error for sample `index` whose data is not what the cache says."""
        shard = self.shard_of(index)
        return CacheDamaged(
            f"cache {self.cache_dir}: shard {tar_path(self.cache_dir, shard).name}, sample "
            f"{self.key(index)}: {what}; {repair_hint(self.cache_dir, shard)}"
        )

    def _staged_copy_damaged(self, index: int, name: str) -> CacheDamaged:
        """A remote shard's member fails its crc32 in the node's shard cache, where its sha256 was checked: the local
        copy changed (a disk problem on this node), not the object in the bucket. The copy is dropped."""
        shard = self.shard_of(index)
        staged = self.remote.shard_dir / f"{self.shard_table.entry(shard)['sha256']}.tar"
        staged.unlink(missing_ok=True)
        if (fd := self._files.pop(shard, None)) is not None:
            os.close(fd)
        return CacheDamaged(
            f"cache {self.cache_dir}: shard {tar_path(self.cache_dir, shard).name}, sample {self.key(index)}: member "
            f"{name} fails its crc32 check in this node's staged copy {staged} (checked when it was staged, so this "
            "node's disk changed it; the object in the bucket is not affected): the copy is removed, rerun the same "
            "command to download it again"
        )

    def shard_of(self, index: int) -> int:
        return self._index.shard(index)

    @property
    def shards(self) -> np.ndarray:
        """(N,) int32: each sample's shard."""
        return self._index.shards()

    @property
    def shard_starts(self) -> np.ndarray:
        """(S + 1,) int64: the first sample of each shard, then the number of samples (index.ShardTable.starts)."""
        return self._index.starts

    def samples_in(self, shards: list[int]) -> np.ndarray:
        """Global indices of the samples of these shards, in cache order."""
        return self._index.samples_in(shards)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}}

    def __len__(self) -> int:
        return len(self._index)

    def key(self, index: int) -> str:
        return self._index.key(index).decode()

    def keys(self) -> list[str]:
        return [k.decode() for k in self._index.keys()]

    def key_array(self) -> np.ndarray:
        """Every key as (N,) fixed-width UTF-8 bytes, no str a sample (reads every part of a lazily read cache)."""
        return self._index.keys()

    def held_out_candidates(self) -> index.Candidates | None:
        """The shard table's held-out candidates (index.Candidates, read by held_out.split). None where there are
        none to trust: a cache written before them or before the shard table, a remote cache read whole (its
        stand-in has no table), a table that lists other shards than the index this reader holds."""
        if self.lazy:
            return self._index.held_out
        entry = self.manifest.get("shard_table")
        if read_from_list(self.manifest) or not isinstance(entry, dict):
            return None
        try:
            table = index.read_table(self.cache_dir / entry["path"], entry)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if len(table.shards) != len(self._sides) or table.shards.differs(self._sides).any():
            return None
        return table.held_out

    def keys_digest(self) -> str:
        """sha256 (16 hex digits) of the sample keys in cache order: what the indices of a data order refer to. A
        cache read a part at a time: of its parts' sha256s, which hold the keys (sample_index.Lazy.digest)."""
        if self.lazy:
            return self._index.digest()
        return hashlib.sha256(b"\n".join(self._index.keys().tolist())).hexdigest()[:16]

    def member_names(self) -> list[str]:
        """Every member name some sample in the cache has."""
        return list(self._index.names)

    def raw(self, index: int) -> dict[str, bytes]:
        """The sample's wanted members' bytes, each checked against its recorded crc32 (raises CacheDamaged)."""
        return self._raw(index, self.members)

    def text(self, index: int) -> Sample:
        """The sample's caption and json alone, whatever `members` says (safe beside other reads of this reader)."""
        return self.decode(index, self._raw(index, ()), tensors=False)

    def _raw(self, index: int, members: tuple[str, ...] | None) -> dict[str, bytes]:
        shard = self.shard_of(index)
        wanted = sorted(
            m for m in self._index.members(index) if members is None or m[2] in members or m[2] in (CAPTION, META)
        )
        runs = _runs(wanted, self.READ_GAP)
        fd = self._files.get(shard)
        if fd is None and members == () and self.remote is not None:
            entry = self.shard_table.entry(shard)
            if not self.remote.holds(entry["sha256"]):  # text alone: its byte ranges, not the whole shard
                name = f"{SHARDS}/{tar_path(self.cache_dir, shard).name}"
                lo, hi = [r[0][0] for r in runs], [r[-1][0] + r[-1][1] for r in runs]
                return self._members(index, runs, self.remote.read_ranges(name, lo, hi, entry["bytes"]), staged=False)
        if fd is None:
            fd = self._files[shard] = self._open(index, shard)
        blocks = []
        for run in runs:
            lo, hi = run[0][0], run[-1][0] + run[-1][1]
            # pread: no shared file offset, so forked DataLoader workers and threads can share the descriptor
            try:
                blocks.append(os.pread(fd, hi - lo, lo))
            except OSError as e:
                raise self.damaged(index, f"cannot read the tar ({e.strerror})") from None
        return self._members(index, runs, blocks, staged=self.remote is not None)

    def _members(self, index: int, runs: list, blocks: list[bytes], staged: bool) -> dict[str, bytes]:
        """The members of `runs` cut from their blocks, each checked against its crc32 (`staged`: read from this
        node's shard cache, whose sha256 was checked when staged, so a mismatch blames the node's copy)."""
        out = {}
        for run, data in zip(runs, blocks):
            lo, hi = run[0][0], run[-1][0] + run[-1][1]
            if len(data) != hi - lo:
                raise self.damaged(index, "the tar ends before this sample (truncated)")
            for offset, size, name, crc in run:
                out[name] = data[offset - lo : offset - lo + size]
                if crc >= 0 and zlib.crc32(out[name]) != crc:
                    if staged:
                        raise self._staged_copy_damaged(index, name)
                    raise self.damaged(
                        index, f"member {name} fails its crc32 check (the tar changed after it was written)"
                    )
        return out

    def _open(self, index: int, shard: int) -> int:
        """A descriptor of shard `shard`'s tar: the local file, or the remote one staged in the shard cache."""
        if self.remote is None:
            try:
                return os.open(tar_path(self.cache_dir, shard), os.O_RDONLY)
            except OSError as e:
                raise self.damaged(index, f"cannot open the tar ({e.strerror})") from None
        entry = self.shard_table.entry(shard)
        fd = self.remote.open_tar(shard, entry["bytes"], entry["sha256"])
        # shards evicted from the shard cache (by this or another process) give their space back once closed
        for other in [i for i, f in self._files.items() if os.fstat(f).st_nlink == 0]:
            os.close(self._files.pop(other))
        while len(self._files) >= self.REMOTE_OPEN:  # the oldest first (dicts keep insertion order)
            os.close(self._files.pop(next(iter(self._files))))
        return fd

    def stage(self, shard: int, ahead: bool = False) -> None:
        """Download shard `shard` of a remote cache into the node's shard cache (a local cache: nothing). `ahead`
        (read-ahead): storage.NoRoomAhead rather than evict a shard read ahead and not read yet."""
        if self.remote is not None:
            entry = self.shard_table.entry(shard)
            self.remote.stage(shard, entry["bytes"], entry["sha256"], ahead)

    def sample(self, index: int, tensors: bool = True) -> Sample:
        """`decode_sample` of `raw(index)`; bytes that do not decode raise CacheDamaged naming shard and key."""
        return self.decode(index, self.raw(index), tensors)

    def decode(self, index: int, members: dict[str, bytes], tensors: bool = True) -> Sample:
        try:
            return decode_sample(self.key(index), members, tensors)
        except (ValueError, KeyError, RecursionError, RuntimeError) as e:  # UnicodeDecodeError, JSON, safetensors
            raise self.damaged(index, f"does not decode ({type(e).__name__})") from None

    def __getitem__(self, index: int) -> Sample:
        return self.sample(index)

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


def _list_problem(entries: list | None, table: index.ShardTable, indexed: bool) -> str | None:
    """What is wrong with the manifest's shard list: its paths, and from format 4 on (`indexed`: a format 1-3
    manifest's list was checked as it loaded and is the table) where it departs from the shard index."""
    if indexed and (problem := _list_vs_index(entries, table)):
        return problem
    for i, e in enumerate(entries or ()):
        if (path := e.get("path")) != f"{SHARDS}/{shard_stem(i)}.tar":
            return f"{MANIFEST} shards[{i}] is {path!r}, expected '{SHARDS}/{shard_stem(i)}.tar'"
    return None


def _list_vs_index(entries: list | None, table: index.ShardTable) -> str | None:
    """Where a format-4 manifest's shard list (what tools read) departs from its shard index (what readers use)."""
    if entries is None:
        return None
    if not isinstance(entries, list):
        return f"{MANIFEST}'s 'shards' is not a list"
    if not all(isinstance(e, dict) for e in entries):
        return f"{MANIFEST}'s shard list is not [{{path, num_samples, bytes, sha256}}]"
    if len(entries) != len(table):
        return f"{MANIFEST} lists {len(entries)} shards, its shard index {len(table)}"
    try:
        listed = index.ShardTable.of_entries(entries)
    except (KeyError, TypeError, ValueError):
        return f"{MANIFEST}'s shard list is not [{{path, num_samples, bytes, sha256}}]"
    if len(bad := np.flatnonzero(listed.differs(table))):
        return f"{MANIFEST} shards[{int(bad[0])}] differs from the shard index's record of that shard"
    return None


def _runs(spans: list[tuple[int, int, str]], gap: int) -> list[list[tuple[int, int, str]]]:
    """(offset, size, name) sorted by offset -> runs in which each member starts within `gap` of the previous end."""
    runs: list[list[tuple[int, int, str]]] = []
    for span in spans:
        if runs and span[0] - (runs[-1][-1][0] + runs[-1][-1][1]) <= gap:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs
