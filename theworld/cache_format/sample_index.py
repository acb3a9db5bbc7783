"""The shard index as a reader holds it (`CacheReader`), in one of two forms with the same methods:

- `Whole`: every part's arrays joined at open (index.join), ~60-130 bytes a sample in memory: caches written before
  the shard table, and those whose parts together are under LAZY_BYTES;
- `Lazy`: the shard table (index.encode_table: per shard count, bytes, sha256, text_rule; per sample a uint8 latent
  shape id where the cache has several shapes) at open, and a part's per-sample arrays only when one of its samples is
  read, memory-mapped from a local file (the cache's own part, or the node's one copy of a remote part,
  storage.RemoteCache.index_part) so the processes of a node share its pages. A sample's shard comes from the
  cumulative counts (8 bytes a shard), so nothing at open grows with the samples but the shape ids.

What `Lazy` checks when a part is first loaded rather than at open: its sha256 against the manifest, its counts
against the shard table, every member inside its tar, no key twice within the part. Keys repeated across shards (a
shard replaced by a copy of another) are caught at open by equal sha256s in the shard table.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from theworld.cache_format import index
from theworld.cache_format.migrations import FORMAT_VERSION

LAZY_BYTES = 256 << 20  # parts (together) above this are loaded a part at a time: ~4M samples at ~60 bytes each
ROW_TENSORS = ("spans", "crc32", "crc32_missing")  # what index.widen reads of a sample's row


def is_lazy(manifest: dict) -> bool:
    """Whether a cache's index is read a part at a time: it has a shard table and its parts exceed LAZY_BYTES."""
    entries, written = manifest.get("shard_index"), manifest.get("written_as", manifest.get("format_version"))
    if written != FORMAT_VERSION or not isinstance(entries, list) or not isinstance(manifest.get("shard_table"), dict):
        return False
    return sum(e["bytes"] for e in entries) > LAZY_BYTES


class Whole:
    """Every sample's record in memory (index.Joined)."""

    def __init__(self, j: index.Joined, checksummed: bool):
        self.j, self.names, self.sides, self.text_rules = j, j.names, j.table, j.text_rules
        self.checksummed = checksummed
        self.latent_hw = np.ascontiguousarray(j.latent_shape[:, -2:])
        self.starts = self.sides.starts()

    def text_bytes(self) -> np.ndarray:
        return index.text_bytes(self.names, self.j.spans)

    def __len__(self) -> int:
        return len(self.j.keys)

    def shapeless(self) -> np.ndarray:
        return np.flatnonzero((self.latent_hw < 0).any(axis=1))

    def shard(self, i: int) -> int:
        return int(self.j.shard[i])

    def key(self, i: int) -> bytes:
        return self.j.keys[i]

    def members(self, i: int) -> list[tuple[int, int, str, int]]:
        """(offset, size, name, crc32 or -1) of sample i's members."""
        spans, crcs = self.j.spans[i].tolist(), self.j.crc32[i].tolist()
        return [(*span, name, crc) for name, span, crc in zip(self.names, spans, crcs) if span[0] >= 0]

    def shards(self) -> np.ndarray:
        return self.j.shard

    def keys(self) -> np.ndarray:
        return self.j.keys

    def samples_in(self, shards: list[int]) -> np.ndarray:
        return np.flatnonzero(np.isin(self.j.shard, shards))


class Lazy:
    """Per-shard arrays in memory, per-sample ones a part at a time. `path(entry)`: a local file holding that part;
    `problem(shard, key or None, what)`: the error to raise for a part that does not hold what the cache lists."""

    def __init__(self, table: index.Table, entries: list[dict], path: Callable[[dict], Path], problem: Callable):
        self.sides = table.shards
        self.text_rules, self.names, self.checksummed = table.text_rules, table.names, table.checksummed
        self.latent_hw, self._text_bytes = table.latent_shape[:, -2:], table.text_bytes
        self._unrecorded = bool((table.latent_shapes < 0).any())
        self.held_out = table.held_out  # held_out.split reads these, not the parts' keys
        self.entries, self.path, self.problem = entries, path, problem
        self.starts = self.sides.starts()
        self.firsts = np.array([e["shards"][0] for e in entries], dtype=np.int64)
        self._parts: dict[int, tuple[dict, list[str]]] = {}  # part -> (tensors, member names); per process

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_parts": {}}  # memory maps are opened again in each process, not pickled

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard(self, i: int) -> int:
        return int(np.searchsorted(self.starts, i, side="right")) - 1

    def _row(self, i: int) -> tuple[dict, list[str], int]:
        p = int(np.searchsorted(self.firsts, self.shard(i), side="right")) - 1
        if p not in self._parts:
            self._parts[p] = self._load(p)
        t, names = self._parts[p]
        return t, names, i - int(self.starts[self.firsts[p]])

    def key(self, i: int) -> bytes:
        t, _, j = self._row(i)
        return t["keys"][j].tobytes().rstrip(b"\0")

    def members(self, i: int) -> list[tuple[int, int, str, int]]:
        t, names, j = self._row(i)
        spans, crc = index.widen({k: v[j : j + 1] for k, v in t.items() if k in ROW_TENSORS})
        return [(*span, n, c) for n, span, c in zip(names, spans[0].tolist(), crc[0].tolist()) if span[0] >= 0]

    def text_bytes(self) -> np.ndarray:
        return self._text_bytes

    def shapeless(self) -> np.ndarray:
        """The samples without a recorded latent shape (none in a cache written now: no pass over the samples)."""
        return np.flatnonzero((self.latent_hw < 0).any(axis=1)) if self._unrecorded else np.zeros(0, np.int64)

    def shards(self) -> np.ndarray:
        """(N,) int32, made on each call (4 bytes a sample): the windowed order's input, not held here."""
        return np.repeat(np.arange(len(self.sides), dtype=np.int32), self.sides.count)

    def keys(self) -> np.ndarray:
        """Every key: reads every part (a tool's pass, not a training start)."""
        out = []
        for p in range(len(self.entries)):
            t, _ = self._parts.get(p) or self._load(p)
            out.append(index.keys_of(t["keys"]))
        return np.concatenate(out) if out else np.zeros(0, dtype="S1")

    def samples_in(self, shards: list[int]) -> np.ndarray:
        s = np.unique(np.asarray(shards, dtype=np.int64))  # in cache order, as Whole's
        lo, hi = self.starts[s], self.starts[s + 1]
        return np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())] or [np.zeros(0, np.int64)])

    def digest(self) -> str:
        """What the keys digest is for a lazily read cache: the parts' sha256s in order (they hold the keys), so
        naming the samples reads no part."""
        return hashlib.sha256("\n".join(e["sha256"] for e in self.entries).encode()).hexdigest()[:16]

    def _load(self, p: int) -> tuple[dict, list[str]]:
        entry = self.entries[p]
        lo, hi = entry["shards"]
        path = self.path(entry)
        try:
            with open(path, "rb") as f:
                sha = hashlib.file_digest(f, "sha256").hexdigest()
            t, meta = index.mapped(path)
            meta = json.loads(meta["index"])
        except (OSError, ValueError) as e:
            raise self.problem(lo, None, f"shard index part {entry['path']} cannot be read ({e})") from None
        if sha != entry["sha256"]:
            raise self.problem(
                lo, None, f"shard index part {entry['path']} sha256 differs from what the manifest lists"
            )
        if meta["first"] != lo or not np.array_equal(t["count"], self.sides.count[lo:hi]):
            raise self.problem(lo, None, f"shard index part {entry['path']} holds other shards than the shard table")
        self._check(t, meta["names"], lo)
        return t, meta["names"]

    def _check(self, t: dict, names: list[str], first: int, chunk: int = 1 << 20) -> None:
        """Every member inside its tar and no key twice within the part (a chunk of rows at a time: bounded
        memory)."""
        shard = np.repeat(np.arange(len(t["count"])), t["count"])
        for lo in range(0, len(shard), chunk):
            spans, _ = index.widen({k: t[k][lo : lo + chunk] for k in ("spans", "crc32")})
            ends = spans[..., 0] + spans[..., 1]
            limit = self.sides.bytes[first + shard[lo : lo + chunk]][:, None]
            if (bad := np.argwhere((spans[..., 0] >= 0) & (ends > limit))).size:
                j = lo + int(bad[0][0])
                what = "its sidecar places a member outside the tar"
                raise self.problem(first + int(shard[j]), t["keys"][j].tobytes().rstrip(b"\0").decode(), what)
        keys = index.keys_of(t["keys"])
        order = np.argsort(keys, kind="stable")
        if len(same := np.flatnonzero(keys[order][1:] == keys[order][:-1])):
            j = int(order[same[0]])
            raise self.problem(first + int(shard[j]), keys[j].decode(), "its key occurs twice in the cache")
