"""The shard index: every shard's record (sample count, tar bytes, sha256, text_rule) and every sample's (key, member
spans, crc32s, latent shape) in the reader's own arrays, in parts of about PART_SAMPLES samples (`part_bounds`), each
part one safetensors object (no pickle). The manifest names the parts (`shard_index`: path, bytes, sha256, shards
[first, end)) and keeps totals only, so opening a cache is a few reads and a concatenation, with no Python loop over
shards or samples.

The sidecar files stay the record precompute and repairs work from; a part is built from them (`build`), and a part
that is missing or stale is built from them again (with a note) where they are at hand."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from theworld.cache_format.migrations import CHECKSUMS, FORMAT_VERSION
from theworld.cache_format.names import CAPTION, MANIFEST, META, SHARD_INDEX, SHARDS
from theworld.core.atomic import write_bytes

# A part holds the shards that start within one span of PART_SAMPLES samples: 4,096 of DataComp's 1,024-sample shards
# (the unit a lazily read cache loads), whatever the shards' size: a part per 4,096 shards would split a cache of small
# shards into parts that a reader in a bucket fetches in a second round of requests (storage.GUESS_BYTES guesses one).
PART_SAMPLES = 4096 * 1024
SUFFIX = ".safetensors"
TABLE = f"shards{SUFFIX}"  # the shard table object, beside the parts
SHAPE_DIMS = 4  # (C, frames, h, w); a sample without a recorded latent shape holds -1
NONE32 = 0xFFFFFFFF  # a narrow part's "absent" span (tars under 4 GiB) and "none recorded" shape id
# Each part's smallest sha256(key)s kept in the shard table (`Candidates`), so a held-out split of up to this many
# samples (held_out.split) reads no part: 16x the shipped configs' train.eval.samples (256), at ~72 bytes each
# (digest, index, a 32-byte key) ~300 kB a full part of 4M samples, under 0.1 byte a sample of the table.
HELD_OUT_CANDIDATES = 4096

# Per shard: count, bytes, sha256, text_rule. Per sample: keys, spans, crc32, latent_shape.
SHARD_ARRAYS = ("count", "bytes", "sha256", "text_rule")


def part_name(part: int) -> str:
    return f"part-{part:06d}{SUFFIX}"


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


@dataclass
class Part:
    """One part's arrays: shards [first, first + len(count)) and their samples in cache order."""

    first: int
    count: np.ndarray  # (S,) int64 samples per shard
    bytes: np.ndarray  # (S,) int64 tar bytes
    sha256: np.ndarray  # (S, 32) uint8
    text_rule: np.ndarray  # (S,) int32: position in `rules`, -1 none recorded
    rules: list[str]
    keys: np.ndarray  # (N,) fixed-width bytes
    names: list[str]  # member names: the columns of spans and crc32
    spans: np.ndarray  # (N, len(names), 2) int64 offset, size; -1 absent
    crc32: np.ndarray  # (N, len(names)) int64; -1 none recorded
    latent_shape: np.ndarray  # (N, SHAPE_DIMS) int32; -1 none recorded

    @property
    def shards(self) -> int:
        return len(self.count)

    def sha_hex(self, i: int) -> str:
        return self.sha256[i].tobytes().hex()


def build(sidecars: list[dict], first: int) -> Part:
    """The arrays of these sidecars (shards first, first + 1, ...): the one per-sample loop, run where sidecars are
    the input (writing the index, or reading a cache written before it). Raises KeyError, TypeError or ValueError on
    a malformed sidecar."""
    names: list[str] = []
    samples = [s for side in sidecars for s in side["samples"]]
    for s in samples:
        names += [n for n in s["members"] if n not in names]
    col = {n: j for j, n in enumerate(names)}
    spans = np.full((len(samples), len(names), 2), -1, dtype=np.int64)
    crc = np.full((len(samples), len(names)), -1, dtype=np.int64)
    shape = np.full((len(samples), SHAPE_DIMS), -1, dtype=np.int32)
    keys = []
    for j, s in enumerate(samples):
        if not isinstance(s["key"], str):
            raise TypeError(f"sample {j}: key is not a string")
        keys.append(s["key"].encode())
        for name, span in s["members"].items():
            spans[j, col[name]] = [int(span[0]), int(span[1])]
        for name, value in (s.get(CHECKSUMS) or {}).items():
            crc[j, col[name]] = int(value)
        if "latent_shape" in s:
            dims = [int(d) for d in s["latent_shape"]][-SHAPE_DIMS:]
            shape[j, SHAPE_DIMS - len(dims) :] = dims
    rules = sorted({side["text_rule"] for side in sidecars if side.get("text_rule") is not None})
    return Part(
        first=first,
        count=np.array([int(side["count"]) for side in sidecars], dtype=np.int64),
        bytes=np.array([int(side["bytes"]) for side in sidecars], dtype=np.int64),
        sha256=np.array([list(bytes.fromhex(side["sha256"])) for side in sidecars], dtype=np.uint8).reshape(-1, 32),
        text_rule=np.array([rules.index(r) if (r := side.get("text_rule")) in rules else -1 for side in sidecars]),
        rules=rules,
        keys=np.array(keys, dtype=bytes) if keys else np.zeros(0, dtype="S1"),
        names=names,
        spans=spans,
        crc32=crc,
        latent_shape=shape,
    )


def encode(part: Part) -> bytes:
    """A part as one safetensors object: the same bytes for the same sidecars (sorted keys, no timestamps). Written
    narrow (`_narrow`): what every training process downloads and holds grows with the samples, ~1.4B at DataComp-1B."""
    tensors = {
        "count": part.count,
        "bytes": part.bytes,
        "sha256": part.sha256,
        "text_rule": part.text_rule.astype(np.int32),
        "keys": key_rows(part.keys),
        **_narrow(part),
    }
    # one metadata entry: safetensors writes several in a hash map's order, which differs between runs
    meta = {"index": json.dumps({"first": part.first, "names": part.names, "rules": part.rules}, sort_keys=True)}
    return st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=meta)


def key_rows(keys: np.ndarray) -> np.ndarray:
    """(N,) fixed-width bytes -> (N, width) uint8 rows, as parts and the shard table store keys."""
    width = max(keys.dtype.itemsize, 1)
    return np.frombuffer(keys.astype(f"S{width}").tobytes(), dtype=np.uint8).reshape(-1, width)


def keys_of(rows: np.ndarray) -> np.ndarray:
    """(N, width) uint8 key rows -> (N,) fixed-width bytes (trailing NULs are not part of a key)."""
    if not rows.shape[1]:
        return np.zeros(len(rows), dtype="S1")
    return np.ascontiguousarray(rows).view(f"S{rows.shape[1]}").reshape(-1)


def _narrow(part: Part) -> dict[str, np.ndarray]:
    """The per-sample arrays in the fewest bytes that hold them exactly: spans as uint32 (NONE32: absent) where every
    tar of the part is under 4 GiB (else int64 as read), crc32 as uint32 with a `crc32_missing` mask only where a
    present member has none recorded (caches written before checksums), and the latent shapes as a table of the
    part's distinct shapes plus a per-sample id, the id left out where the part has one shape."""
    present = part.spans[..., 0] >= 0
    narrow = len(part.bytes) == 0 or int(part.bytes.max()) < NONE32
    spans = np.where(present[..., None], part.spans, NONE32).astype(np.uint32) if narrow else part.spans
    out = {"spans": spans, "crc32": np.where(part.crc32 >= 0, part.crc32, 0).astype(np.uint32)}
    if (missing := present & (part.crc32 < 0)).any():
        out["crc32_missing"] = missing.astype(np.uint8)
    return {**out, **_shapes(part.latent_shape)}


def _shapes(latent_shape: np.ndarray) -> dict[str, np.ndarray]:
    """(N, SHAPE_DIMS) shapes as a table of the distinct ones and each sample's row (no rows where there is one)."""
    if len(latent_shape) and (latent_shape == latent_shape[0]).all():  # one shape: no sort over every sample
        return {"latent_shapes": np.ascontiguousarray(latent_shape[:1], dtype=np.int32)}
    shapes, ids = np.unique(latent_shape, axis=0, return_inverse=True)
    out = {"latent_shapes": shapes.astype(np.int32).reshape(-1, SHAPE_DIMS)}
    if len(shapes) > 1:
        out["latent_shape_id"] = ids.reshape(-1).astype(np.uint8 if len(shapes) <= 256 else np.uint32)
    return out


def shapes_of(t: dict[str, np.ndarray], n: int) -> np.ndarray:
    """(n, SHAPE_DIMS) int32 latent shapes from `_shapes`' tensors: a read-only broadcast of the one row where the
    samples share a shape (no memory per sample)."""
    shapes = t["latent_shapes"]
    if "latent_shape_id" not in t:
        return np.broadcast_to(shapes[:1], (n, SHAPE_DIMS)) if len(shapes) else np.full((n, SHAPE_DIMS), -1, np.int32)
    return shapes[t["latent_shape_id"].astype(np.int64)]


def widen(t: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(spans int64, crc32 int64) with -1 for absent or none recorded, from rows of a narrow part's tensors or a wide
    one's (format 4 as first written: int64 spans and crc32)."""
    spans, crc = t["spans"], t["crc32"]
    if spans.dtype == np.uint32:
        absent = spans[..., 0] == NONE32
        spans = spans.astype(np.int64)
        spans[absent] = -1
    if crc.dtype == np.uint32:
        none = (spans[..., 0] < 0) | t.get("crc32_missing", np.zeros(crc.shape, np.uint8)).astype(bool)
        crc = np.where(none, -1, crc.astype(np.int64))
    return spans, crc.astype(np.int64)


def decode(data: bytes, entry: dict) -> Part:
    """A part's arrays, checked against its manifest entry (ValueError: stale or damaged, saying which)."""
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"sha256 differs from what {MANIFEST} lists")
    part = decode_unchecked(data)
    lo, hi = entry["shards"]
    if part.first != lo or part.shards != hi - lo:
        raise ValueError(f"holds other shards than {MANIFEST} lists")
    return part


def decode_unchecked(data: bytes) -> Part:
    """A part's arrays (ValueError: not a part)."""
    try:
        t = st_load(data)
        meta = json.loads(json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]["index"])
        keys = keys_of(t["keys"])
        spans, crc = widen(t)
        shape = t["latent_shape"] if "latent_shape" in t else np.array(shapes_of(t, len(keys)))
        part = Part(
            first=int(meta["first"]),
            count=t["count"],
            bytes=t["bytes"],
            sha256=t["sha256"],
            text_rule=t["text_rule"],
            rules=list(meta["rules"]),
            keys=keys,
            names=list(meta["names"]),
            spans=spans,
            crc32=crc,
            latent_shape=shape,
        )
    except Exception as e:  # noqa: BLE001 - damaged bytes: safetensors' own error, or a missing or odd field
        raise ValueError(f"is not a shard index part ({type(e).__name__})") from None
    if int(part.count.sum()) != len(part.keys) or len(part.spans) != len(part.keys):
        raise ValueError("its sample arrays do not add up to its shards' counts")
    return part


def parts_of(shards: int, shard_size: int) -> int:
    """How many parts `part_bounds` makes of `shards` shards of `shard_size` samples, in integer arithmetic (a plan of
    any size): a shard's first sample at i x shard_size, and a span skipped only by a shard larger than a span."""
    return min(shards, (shards - 1) * shard_size // PART_SAMPLES + 1) if shards > 0 else 0


HEADER_MAX = 100 << 20  # safetensors' own bound on a header


def first_shard(path: Path) -> int | None:
    """A part file's first shard, from its header alone (None: not a part)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size > HEADER_MAX:  # a damaged length: not read into memory
                return None
            header = f.read(size)
        return int(json.loads(json.loads(header)["__metadata__"]["index"])["first"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def unnamed_parts(names: Iterable[str], named: Iterable[str]) -> list[str]:
    """Of the file names in a cache's shard-index folder, the parts the manifest's paths (`named`) do not name: an
    earlier index of the cache, written in parts of another size (or format), which a rewrite leaves to delete."""
    keep = {Path(n).name for n in named}
    return [n for n in names if n.startswith("part-") and n not in keep]


def write(cache_dir: Path, sidecars: list[dict]) -> dict:
    """Write the index of these sidecars (shard i's at position i): the parts, then the shard table (`encode_table`).
    Returns the manifest's fields naming them: `shard_index` (each part's entry) and `shard_table`."""
    bounds = part_bounds(np.array([int(side["count"]) for side in sidecars], dtype=np.int64))
    return write_parts(cache_dir, (build(sidecars[lo:hi], lo) for lo, hi in itertools.pairwise(bounds)))


def part_bounds(counts: np.ndarray) -> list[int]:
    """[0, ..., len(counts)]: where each part of shards of these sample counts begins, then the end. A part holds the
    shards whose first sample falls in one span of PART_SAMPLES (so at most PART_SAMPLES plus a shard's samples)."""
    if not len(counts):
        return [0]
    span = (np.cumsum(counts) - counts) // PART_SAMPLES  # the span each shard's first sample falls in
    return [*np.flatnonzero(np.diff(span, prepend=-1)).tolist(), len(counts)]


def write_parts(cache_dir: Path, parts: Iterable[Part]) -> dict:
    """`write` of parts in shard order, one at a time (what the shard table needs of each is kept: `Summary`)."""
    (Path(cache_dir) / SHARD_INDEX).mkdir(exist_ok=True)
    entries, kept = [], []
    for i, part in enumerate(parts):
        data = encode(part)
        name = f"{SHARD_INDEX}/{part_name(i)}"
        write_bytes(Path(cache_dir) / name, data)
        entries.append(
            {"path": name, "bytes": len(data), "sha256": _sha(data), "shards": [part.first, part.first + part.shards]}
        )
        kept.append(Summary.of(part))
    data = encode_table(kept)
    name = f"{SHARD_INDEX}/{TABLE}"
    write_bytes(Path(cache_dir) / name, data)
    return {"shard_index": entries, "shard_table": {"path": name, "bytes": len(data), "sha256": _sha(data)}}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key_digests(keys: np.ndarray) -> np.ndarray:
    """(N, 32) uint8: each key's sha256 (what the held-out split ranks by), one hashlib call a key: hashlib has no
    batched form, and this is the whole cost (docs/performance.md)."""
    sha = hashlib.sha256
    return np.frombuffer(b"".join([sha(k).digest() for k in keys.tolist()]), np.uint8).reshape(-1, 32)


def smallest(digests: np.ndarray, n: int) -> np.ndarray:
    """Positions of the n smallest (N, 32) digests in digest order, equal ones in position order: an 8-byte prefix
    narrows them without a sort of all N, the whole digest orders the few left (exact)."""
    if n <= 0:
        return np.zeros(0, np.int64)
    pos = np.arange(len(digests))
    if n < len(digests):
        prefix = np.ascontiguousarray(digests[:, :8]).view(">u8").reshape(-1)
        pos = np.flatnonzero(prefix <= np.partition(prefix, n - 1)[n - 1])
    # S32: bytes order (NUL, the least byte, pads: as a byte-wise compare)
    order = np.argsort(np.ascontiguousarray(digests[pos]).view("S32").reshape(-1), kind="stable")
    return pos[order[:n]].astype(np.int64)


@dataclass
class Candidates:
    """The held-out split's candidates (held_out.split): each part's `per_part` smallest sha256(key), so the cache's
    n smallest for any n <= per_part are among them (each of those is among its own part's n smallest)."""

    per_part: int  # what each part kept (HELD_OUT_CANDIDATES when written); a part of fewer samples keeps them all
    sha256: np.ndarray  # (M, 32) uint8, in digest order
    index: np.ndarray  # (M,) int64 sample index (a part's own in a Summary, the cache's in the table)
    keys: np.ndarray  # (M,) fixed-width bytes

    @classmethod
    def of(cls, keys: np.ndarray, per_part: int) -> Candidates:
        """The `per_part` smallest of these keys (each hashed once)."""
        digests = key_digests(keys)
        pos = smallest(digests, per_part)
        return cls(per_part, digests[pos], pos, keys[pos])

    @classmethod
    def join(cls, parts: list[Candidates], offsets: np.ndarray) -> Candidates:
        """One cache's candidates from its parts' (`offsets`: each part's first sample), in digest order."""
        sha = np.concatenate([c.sha256 for c in parts] or [np.zeros((0, 32), np.uint8)])
        idx = np.concatenate([c.index + off for c, off in zip(parts, offsets.tolist())] or [np.zeros(0, np.int64)])
        keys = np.concatenate([c.keys for c in parts] or [np.zeros(0, "S1")])
        order = smallest(sha, len(sha))
        return cls(min((c.per_part for c in parts), default=HELD_OUT_CANDIDATES), sha[order], idx[order], keys[order])


@dataclass
class Summary:
    """What the shard table keeps of a part."""

    shards: ShardTable
    rules: list[str]
    text_rule: np.ndarray
    names: list[str]
    checksummed: bool
    text_bytes: np.ndarray
    latent_shape: np.ndarray
    held_out: Candidates  # indices within the part

    @classmethod
    def of(cls, p: Part) -> Summary:
        present = p.spans[..., 0] >= 0
        checksummed = bool((p.crc32[present] >= 0).all())
        text = text_bytes(p.names, p.spans)
        held = Candidates.of(p.keys, HELD_OUT_CANDIDATES)
        return cls(ShardTable.of([p]), p.rules, p.text_rule, p.names, checksummed, text, p.latent_shape, held)


def encode_table(parts: list[Summary]) -> bytes:
    """The whole-cache facts a reader needs before it reads any sample, in one object: per shard (52 bytes) its count,
    bytes, sha256 and text_rule; per sample (2 bytes, 3 with several latent shapes) its text bytes (`text_bytes`) and
    latent shape id; per part its held-out candidates (`Candidates`: held_out_sha256, held_out_index, held_out_keys,
    in digest order across the cache); in its metadata every member name, whether every member of every sample has a
    crc32 and how many candidates a part keeps. A reader that has it loads a part only when it reads one of its
    samples (sample_index.Lazy)."""
    names: list[str] = []
    for p in parts:
        names += [n for n in p.names if n not in names]
    rules = sorted({r for p in parts for r in p.rules})
    ids = [np.array([rules.index(r) for r in p.rules] + [-1], dtype=np.int32)[p.text_rule] for p in parts]
    every = np.concatenate([p.latent_shape for p in parts]) if parts else np.zeros((0, SHAPE_DIMS), np.int32)
    shards = ShardTable.of([p.shards for p in parts])  # a ShardTable has the arrays ShardTable.of joins
    tensors = {
        "count": shards.count,
        "bytes": shards.bytes,
        "sha256": shards.sha256,
        "text_rule": np.concatenate(ids) if ids else np.zeros(0, np.int32),
        "text_bytes": np.concatenate([p.text_bytes for p in parts] or [np.zeros(0, np.uint16)]),
        **_shapes(every),
    }
    starts = np.cumsum([0] + [len(p.text_bytes) for p in parts])  # each part's first sample
    held = Candidates.join([p.held_out for p in parts], starts[:-1])
    tensors.update(held_out_sha256=held.sha256, held_out_index=held.index, held_out_keys=key_rows(held.keys))
    checksummed = all(p.checksummed for p in parts)
    facts = {"names": names, "rules": rules, "checksummed": checksummed, "held_out_candidates": held.per_part}
    meta = {"table": json.dumps(facts, sort_keys=True)}
    return st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=meta)


def text_bytes(names: list[str], spans: np.ndarray) -> np.ndarray:
    """(N,) uint16: each sample's caption and json bytes together (65,535 for more): the length that
    train.loader.group_by_length sorts a large cache by without reading any text (docs/training.md)."""
    cols = [names.index(n) for n in (CAPTION, META) if n in names]
    sizes = np.where(spans[:, cols, 0] >= 0, spans[:, cols, 1], 0).sum(1)
    return np.minimum(sizes.reshape(-1), np.iinfo(np.uint16).max).astype(np.uint16)


@dataclass
class Table:
    """The shard table object's contents."""

    shards: ShardTable
    text_rules: np.ndarray  # (S,) object: per shard, its text_rule or None
    names: list[str]
    checksummed: bool
    latent_shape: np.ndarray  # (N, SHAPE_DIMS) int32 (`shapes_of`: a broadcast where the cache has one shape)
    text_bytes: np.ndarray  # (N,) uint16 (`text_bytes`)
    latent_shapes: np.ndarray  # (U, SHAPE_DIMS) int32: the distinct shapes
    held_out: Candidates | None  # None: a table written before the candidates


def read_table(path: Path, entry: dict) -> Table:
    """The shard table file at `path`, checked against its manifest entry (ValueError: stale or damaged, saying
    which), memory-mapped: its per-sample arrays are shared by the processes of a node."""
    with open(path, "rb") as f:
        if hashlib.file_digest(f, "sha256").hexdigest() != entry["sha256"]:
            raise ValueError(f"sha256 differs from what {MANIFEST} lists")
    try:
        t, head = mapped(path)
        meta = json.loads(head["table"])
        rules = np.array([*meta["rules"], None], dtype=object)
        n = int(t["count"].sum())
        return Table(
            ShardTable(np.array(t["count"]), np.array(t["bytes"]), np.array(t["sha256"])),
            rules[t["text_rule"].astype(np.int64)],  # -1: the None at the end
            list(meta["names"]),
            bool(meta["checksummed"]),
            shapes_of(t, n),
            t["text_bytes"],
            np.array(t["latent_shapes"]),
            _candidates(t, meta, n),
        )
    except Exception as e:  # noqa: BLE001 - damaged bytes: a missing or odd field
        raise ValueError(f"is not a shard table ({type(e).__name__})") from None


def _candidates(t: dict[str, np.ndarray], meta: dict, n: int) -> Candidates | None:
    """The table's held-out candidates (memory-mapped), None where it was written before them."""
    if "held_out_sha256" not in t:
        return None
    c = Candidates(int(meta["held_out_candidates"]), t["held_out_sha256"], t["held_out_index"], t["held_out_keys"])
    if not len(c.sha256) == len(c.index) == len(c.keys) or c.sha256.shape[1:] != (32,):
        raise ValueError("held-out candidate arrays of different lengths")
    if len(c.index) and not 0 <= int(c.index.min()) <= int(c.index.max()) < n:
        raise ValueError("a held-out candidate outside the cache")
    c.keys = keys_of(c.keys)
    return c


def mapped(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """A part's or the shard table's tensors as read-only memory maps (pages shared by every process of the node that
    maps the file) and its metadata. safetensors' own loaders copy each tensor, so the header is read here: JSON
    {name: {dtype, shape, data_offsets}} after its u64 length."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(size))
    meta = head.pop("__metadata__")
    dtypes = {"I64": np.int64, "I32": np.int32, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8}
    out = {}
    for name, v in head.items():
        lo, hi = v["data_offsets"]
        if hi == lo:
            out[name] = np.zeros(v["shape"], dtype=dtypes[v["dtype"]])
            continue
        out[name] = np.memmap(path, dtype=dtypes[v["dtype"]], mode="r", offset=8 + size + lo, shape=tuple(v["shape"]))
    return out, meta


def sidecar(part: Part, index: int) -> dict:
    """Shard `index`'s sidecar as written, from a part that holds it (a remote cache's stand-in has no sidecars)."""
    i = index - part.first
    lo = int(part.count[:i].sum())
    samples = []
    for j in range(lo, lo + int(part.count[i])):
        s = {"key": part.keys[j].decode(), "members": {}, CHECKSUMS: {}}
        for c, name in enumerate(part.names):
            if part.spans[j, c, 0] >= 0:
                s["members"][name] = part.spans[j, c].tolist()
            if part.crc32[j, c] >= 0:
                s[CHECKSUMS][name] = int(part.crc32[j, c])
        if (part.latent_shape[j] >= 0).any():
            s["latent_shape"] = [int(d) for d in part.latent_shape[j] if d >= 0]
        samples.append(s)
    rule = int(part.text_rule[i])
    return {
        "format_version": FORMAT_VERSION,
        "shard": shard_name(index),
        "count": int(part.count[i]),
        "bytes": int(part.bytes[i]),
        "sha256": part.sha_hex(i),
        **({"text_rule": part.rules[rule]} if rule >= 0 else {}),
        "samples": samples,
    }


@dataclass
class ShardTable:
    """Every shard's record (count, bytes, sha256) as arrays: what the manifest listed per shard before format 4. The
    one accessor of per-shard records (`layout.shard_table`)."""

    count: np.ndarray  # (S,) int64
    bytes: np.ndarray  # (S,) int64
    sha256: np.ndarray  # (S, 32) uint8

    def __len__(self) -> int:
        return len(self.count)

    def starts(self) -> np.ndarray:
        """(S + 1,) int64: each shard's first sample, then the number of samples (samples are in shard order)."""
        return np.concatenate([[0], np.cumsum(self.count)]).astype(np.int64)

    def entry(self, i: int) -> dict:
        """Shard i's record in the manifest's former terms: {path, num_samples, bytes, sha256}."""
        return {
            "path": f"{SHARDS}/{shard_name(i)}",
            "num_samples": int(self.count[i]),
            "bytes": int(self.bytes[i]),
            "sha256": self.sha256[i].tobytes().hex(),
        }

    def entries(self) -> list[dict]:
        return [self.entry(i) for i in range(len(self))]

    def differs(self, other: ShardTable) -> np.ndarray:
        """(S,) bool: the shards whose count, bytes or sha256 differ between two tables of the same length."""
        return (self.count != other.count) | (self.bytes != other.bytes) | (self.sha256 != other.sha256).any(1)

    @classmethod
    def of(cls, parts: list[Part] | list[ShardTable]) -> ShardTable:
        if not parts:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 32), np.uint8))
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("count", "bytes", "sha256")))

    @classmethod
    def of_entries(cls, entries: list[dict]) -> ShardTable:
        """From a format 1-3 manifest's per-shard list. ValueError: a sha256 that is not 64 hex digits."""
        shas = [e["sha256"] for e in entries]
        if not all(isinstance(s, str) and len(s) == 64 for s in shas):
            raise ValueError("a sha256 is not 64 hex digits")
        # one hex decode of them all: a list of 32 ints a shard takes 13 us, 18 s at DataComp-1B's 1.37M shards
        sha256 = np.frombuffer(bytes.fromhex("".join(shas)), dtype=np.uint8).reshape(-1, 32).copy()
        return cls(
            np.array([e["num_samples"] for e in entries], dtype=np.int64),
            np.array([e["bytes"] for e in entries], dtype=np.int64),
            sha256,
        )


@dataclass
class Joined:
    """Parts concatenated into the reader's arrays (member columns in order of first appearance)."""

    names: list[str]
    keys: np.ndarray
    shard: np.ndarray  # (N,) int32
    spans: np.ndarray
    crc32: np.ndarray
    latent_shape: np.ndarray
    table: ShardTable
    text_rules: np.ndarray  # (S,) object: per shard, the sidecar's text_rule or None


def join(parts: list[Part]) -> Joined:
    """One set of arrays from parts in shard order: a concatenation per array, member columns placed by name."""
    names: list[str] = []
    for p in parts:
        names += [n for n in p.names if n not in names]
    n, width = sum(len(p.keys) for p in parts), len(names)
    spans = np.full((n, width, 2), -1, dtype=np.int64)
    crc = np.full((n, width), -1, dtype=np.int64)
    lo = 0
    for p in parts:  # one slice assignment per part, not per shard or sample
        cols = [names.index(name) for name in p.names]
        spans[lo : lo + len(p.keys), cols] = p.spans
        crc[lo : lo + len(p.keys), cols] = p.crc32
        lo += len(p.keys)
    table = ShardTable.of(parts)
    rules = sorted({r for p in parts for r in p.rules})
    ids = [np.array([rules.index(r) for r in p.rules] + [len(rules)])[p.text_rule] for p in parts]  # -1: None
    text_rules = np.array([*rules, None], dtype=object)[np.concatenate(ids) if ids else np.zeros(0, np.int64)]
    return Joined(
        names=names,
        keys=np.concatenate([p.keys for p in parts]) if parts else np.zeros(0, dtype="S1"),
        shard=np.repeat(np.arange(len(table), dtype=np.int32), table.count),
        spans=spans,
        crc32=crc,
        latent_shape=np.concatenate([p.latent_shape for p in parts]) if parts else np.zeros((0, SHAPE_DIMS), np.int32),
        table=table,
        text_rules=text_rules,
    )
