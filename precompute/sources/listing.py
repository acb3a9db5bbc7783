"""The shared part of every source: the entry, the listing (an order whose entries are built per range), and the
duplicate-key rule (a later use of a key is an error entry that names the first use)."""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from precompute.sources import content
from theworld.cache_format import atomic_write_json
from theworld.core.errors import UserError
from theworld.model import images


@dataclass
class Entry:
    key: str
    source: str  # a human-readable id: relative path, "shard.tar:key", "synthetic:<index>", "captions.jsonl:<line>"
    caption: str = ""
    prompt: str = ""
    error: str | None = None  # set: the entry is recorded in errors.jsonl instead of being encoded
    loc: tuple = ()  # where the source finds the image (its own layout: a path, a tar span, a row...)
    extra: dict = field(default_factory=dict)  # what the source needs besides `loc` to load the entry


class Loaded(NamedTuple):
    """One entry's content: encoded image bytes, caption and prompt (checked by `content.check_text`), and the
    source metadata kept in the sample's json member (url, uid...)."""

    image: bytes
    caption: str
    prompt: str
    meta: dict


class Listing:
    """The source order. Subclasses give `__len__`, `_raw(lo, hi)` (entries before duplicate marking) and
    `_load(entry)`; `entries` and `load` add what every source shares."""

    duplicates: dict[int, str]  # global index -> "duplicate key ..." error, for entries that are otherwise usable

    def __len__(self) -> int:
        raise NotImplementedError

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        raise NotImplementedError

    def _load(self, entry: Entry) -> Loaded:
        raise NotImplementedError

    def entries(self, lo: int, hi: int) -> list[Entry]:
        """Entries [lo, hi) of the order, duplicates already marked as errors."""
        out = self._raw(lo, min(hi, len(self)))
        for i, e in enumerate(out, start=lo):
            if e.error is None and i in self.duplicates:
                e.error = self.duplicates[i]
        return out

    def load(self, entry: Entry) -> Loaded:
        """The entry's content. Raises content.SourceError (or OSError) with the reason recorded in errors.jsonl."""
        image, caption, prompt, meta = self._load(entry)
        return Loaded(image, content.check_text(caption, "caption"), content.check_text(prompt, "prompt"), meta)

    def failure_hint(self) -> str:
        """What to add to "every input failed" for this source (where it looked for images...); "" for nothing."""
        return ""

    def usable(self, entry: Entry) -> bool:
        """Whether an entry the listing finds no error in loads, and its image header reads (pixels not decoded)."""
        try:
            images.check_header(self.load(entry).image)
        except (content.SourceError, images.BadImage, OSError, UnicodeDecodeError):
            return False
        return True


def key_hash(key: str) -> int:
    """A 64-bit hash of a key that is the same in every process and run (unlike hash(), which is salted)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def find_duplicates(keys: Iterable[str | None], entry_at: Callable[[int], Entry]) -> dict[int, str]:
    """{index: error} for every later use of a key, exactly as one pass with a dict of keys would mark them.

    Holds 16 bytes per entry instead of the keys (None = a known error, never a duplicate).
    """
    index, hashes = array("q"), array("q")
    for i, k in enumerate(keys):
        if k is not None:
            index.append(i)
            hashes.append(key_hash(k))
    return duplicates_from_hashes(np.frombuffer(index, dtype=np.int64), np.frombuffer(hashes, dtype=np.int64), entry_at)


def duplicates_from_hashes(index: np.ndarray, hashes: np.ndarray, entry_at: Callable[[int], Entry]) -> dict[int, str]:
    """`find_duplicates` from (global index, key hash) of the possibly usable entries. Only entries whose hash occurs
    twice are built again (`entry_at`) and compared by their real key, so a hash collision costs a look-up, never a
    wrong answer."""
    order = np.argsort(hashes, kind="stable")
    same = np.zeros(len(hashes), dtype=bool)
    eq = hashes[order][1:] == hashes[order][:-1]
    same[1:] |= eq
    same[:-1] |= eq
    first: dict[str, str] = {}
    dups: dict[int, str] = {}
    for i in np.sort(index[order[same]]).tolist():
        e = entry_at(i)
        if e.error is not None:
            continue
        if e.key in first:
            dups[i] = duplicate_error(e.key, first[e.key])
        else:
            first[e.key] = e.source
    return dups


def duplicate_error(key: str, first_source: str) -> str:
    return f"duplicate key: {key!r} (first used by {first_source})"


class Truncated(Listing):
    """`source.num_samples` on a listed source: the inner order up to and including its n-th usable entry (entries
    found unusable before it stay, in place, and become errors when encoded).

    Usable: the listing finds no error, and `usable` loads the entry: image bytes present and within the size limit,
    caption and prompt pass `content.check_text`, the image header readable with a picture that is neither empty nor
    oversized. Only decoding the pixels is left to encoding (an image cut short after its header still counts), so
    the cut is known before encoding and is the same on any number of processes. Rank 0 finds it (reading up to the
    cut's entries once) and records it in `index_dir`; the other processes and reruns read the record."""

    RECORD = "num_samples.json"

    def __init__(
        self,
        inner: Listing,
        n: int,
        index_dir: Path | None = None,
        rank: int = 0,
        barrier: Callable[[], None] = lambda: None,
        chunk: int = 4096,
    ):
        self.inner, self.duplicates = inner, inner.duplicates
        if n >= len(inner):  # every entry: nothing to find
            self.n = len(inner)
            return
        record = Path(index_dir) / self.RECORD if index_dir is not None else None
        if rank == 0:  # only rank 0 looks for the record: another rank could find the one rank 0 has just written
            found = read_json(record) if record is not None else None
            fresh = isinstance(found, dict) and found.get("num_samples") == n and found.get("of") == len(inner)
            self.n = found["length"] if fresh else self._cut(n, chunk)
            if record is not None and not fresh:
                record.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(record, {"num_samples": n, "of": len(inner), "length": self.n})
        barrier()  # every rank, every time: so the barriers after this one pair up across ranks
        if rank != 0:
            self.n = read_json(record)["length"]

    def _cut(self, n: int, chunk: int) -> int:
        """The length of the order up to and including its n-th usable entry (all of it if it has fewer)."""
        usable = 0
        for lo in range(0, len(self.inner), chunk):
            for i, e in enumerate(self.inner.entries(lo, lo + chunk), start=lo):
                usable += e.error is None and self.inner.usable(e)
                if usable == n:
                    return i + 1
        return len(self.inner)

    def __len__(self) -> int:
        return self.n

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        return self.inner._raw(lo, min(hi, self.n))

    def _load(self, entry: Entry) -> Loaded:
        return self.inner._load(entry)

    def failure_hint(self) -> str:
        return self.inner.failure_hint()


def read_json(path: Path) -> dict | None:
    """A listing file written by `cf.atomic_write_json`, or None when missing or unreadable (it is rebuilt)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None


def file_identity(path: str) -> list:
    """What a listing of a source file stays valid for: the same file (absolute path), size and modification time."""
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def check_unchanged(old: list | None, new: list, index_dir: Path, what: str) -> None:
    """Refuse to go on when the source files recorded in `index_dir` (`file_identity` lists, possibly followed by an
    index version, which is not compared) are not the ones listed now: the shards already written follow the old
    `what` (rows, samples). Names the first file added, removed or changed, and how."""
    if not isinstance(old, list) or not all(isinstance(o, list) and len(o) >= 3 for o in old):
        return  # no record (or an unreadable one, rebuilt): nothing to compare with
    before, now = {o[0]: o[1:3] for o in old}, {n[0]: n[1:3] for n in new}
    changes = (
        [f"{p} was added" for p in now if p not in before]
        + [f"{p} was removed" for p in before if p not in now]
        + [
            (
                f"{p} changed size ({before[p][0]} -> {now[p][0]} bytes)"
                if before[p][0] != now[p][0]
                else f"{p} changed (modification time)"
            )
            for p in now
            if p in before and before[p] != now[p]
        ]
    )
    if not changes and list(before) != list(now):
        changes = ["the files' order changed"]
    if changes:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        raise UserError(
            f"config key 'source.path': {changes[0]}{more} since the cache in {Path(index_dir).parent} "
            f"was started, so its shards follow other {what}: restore it, or use another output_dir (or "
            "delete that one) to start over"
        )
