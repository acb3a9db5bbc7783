"""Sources: a fixed, documented order of entries, each with a stable key taken from the source (never a position).

Order (shard i of the cache = entries [i*S, (i+1)*S) of this order, so it must never depend on the machine):
  synthetic:  index 0..num_samples-1; key "synthetic-<seed>-<index:08d>" (the index *is* the sample's identity).
  folder:     with captions.jsonl: its lines in file order; key = safe_key(image relative path).
              without: image files sorted by relative path (POSIX, byte order), caption from the same-stem .txt.
  webdataset: shard files in pattern order (braces expanded in order, each glob sorted), samples in tar order;
              key = safe_key(the tar's __key__).
An entry that is already known to be unusable (bad caption line, missing image or caption, duplicate key) stays in
the order as an error entry, so each shard's errors are a deterministic function of the source.

A `Listing` knows the order without holding it as objects: `len(listing)` entries, and `listing.entries(lo, hi)`
builds the `Entry` objects of one range (one cache shard) on demand, so memory follows shard_size, not dataset size.
Webdataset tars are header-scanned once into `<output_dir>/source-index/` (tar j by rank j % world) and reused on a
rerun; folders are listed once per process into compact arrays. `load_bytes` runs in DataLoader workers.
"""
from __future__ import annotations

import base64
import glob
import hashlib
import io
import json
import os
import re
import sys
import tarfile
import tempfile
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from theworld import cache_format as cf
from theworld import synthetic
from theworld.cache_format import safe_key
from theworld.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
WDS_IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")
INDEX_VERSION = 2  # bump when the per-tar listing's content changes, so old listings are rebuilt


@dataclass
class Entry:
    key: str
    source: str  # a human-readable id: relative path, "shard.tar:key", "synthetic:<index>", "captions.jsonl:<line>"
    caption: str = ""
    prompt: str = ""
    error: str | None = None  # set: the entry is recorded in errors.jsonl instead of being encoded
    # How to get the image bytes: ("synthetic", seed, index) | ("file", path) | ("tar", path, offset, size)
    loc: tuple = ()
    extra: dict = field(default_factory=dict)  # source metadata kept in the sample's json (webdataset json member)


def load_bytes(entry: Entry, resolution: int) -> bytes:
    """The entry's encoded image bytes. Raises OSError for a missing/unreadable file."""
    kind = entry.loc[0]
    if kind == "synthetic":
        img, _ = synthetic.scene(entry.loc[1], entry.loc[2], size=resolution)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()
    if kind == "file":
        return Path(entry.loc[1]).read_bytes()
    _, path, offset, size = entry.loc
    return read_member(path, (offset, size))


def read_member(path: str, loc: tuple[int, int] | None) -> bytes | None:
    if loc is None:
        return None
    with open(path, "rb") as f:
        f.seek(loc[0])
        data = f.read(loc[1])
    if len(data) != loc[1]:  # the tar changed since it was listed
        raise OSError(f"truncated tar member ({len(data)} of {loc[1]} bytes)")
    return data


# ----------------------------------------------------------------------------------------------------------------------
# Listings: the order, with entries built per range


class Listing:
    """The source order. Subclasses give `__len__` and `_raw(lo, hi)` (entries before duplicate marking)."""

    duplicates: dict[int, str]  # global index -> "duplicate key ..." error, for entries that are otherwise usable

    def __len__(self) -> int:
        raise NotImplementedError

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        raise NotImplementedError

    def entries(self, lo: int, hi: int) -> list[Entry]:
        """Entries [lo, hi) of the order, duplicates already marked as errors."""
        out = self._raw(lo, min(hi, len(self)))
        for i, e in enumerate(out, start=lo):
            if e.error is None and i in self.duplicates:
                e.error = self.duplicates[i]
        return out


class MemoryListing(Listing):
    """An already materialised list (benchmarks, small tests)."""

    def __init__(self, entries: list[Entry]):
        self._entries, self.duplicates = entries, {}

    def __len__(self) -> int:
        return len(self._entries)

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        return self._entries[lo:hi]


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
    return duplicates_from_hashes(np.frombuffer(index, dtype=np.int64), np.frombuffer(hashes, dtype=np.int64),
                                  entry_at)


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
            dups[i] = f"duplicate key: {e.key!r} (first used by {first[e.key]})"
        else:
            first[e.key] = e.source
    return dups


class SyntheticListing(Listing):
    def __init__(self, seed: int, num_samples: int):
        self.seed, self.n, self.duplicates = seed, num_samples, {}

    def __len__(self) -> int:
        return self.n

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        return [Entry(key=f"synthetic-{self.seed}-{i:08d}", source=f"synthetic:{i}", caption="",
                      prompt=synthetic.PROMPT, loc=("synthetic", self.seed, i)) for i in range(lo, hi)]


# ----------------------------------------------------------------------------------------------------------------------
# Folder sources: listed once per process into arrays (16 bytes a line, or the path's bytes + 8 a file)


def _jsonl_record(root: Path, n: int, line: str, default_prompt: str) -> Entry:
    src = f"captions.jsonl:{n}"
    try:
        rec = json.loads(line)
        if not isinstance(rec, dict):
            raise ValueError("not a JSON object")
        rel, caption = rec["image"], rec["caption"]
        prompt = rec.get("prompt", default_prompt)
        if not all(isinstance(v, str) for v in (rel, caption, prompt)) or not rel:
            raise ValueError("'image', 'caption' and 'prompt' must be non-empty strings")
        if "\x00" in rel:
            raise ValueError("'image' holds a NUL character")
    except (ValueError, KeyError) as e:
        reason = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        return Entry(key=safe_key(f"line-{n}"), source=src, error=f"bad caption line: {reason}")
    return Entry(key=safe_key(rel), source=rel, caption=caption, prompt=prompt, loc=("file", str(root / rel)),
                 extra={"line": n})


def _jsonl_lines(path: Path) -> Iterable[tuple[int, int, int, str]]:
    """(byte offset of the physical line, sub-line, line number, text) for every line of captions.jsonl.

    Line numbers follow str.splitlines() of the whole decoded file, as documented; reading bytes line by line and
    splitting each one again gives the same lines (\\r, \\x85, \\u2028 also break lines) without holding the file.
    """
    n, offset = 0, 0
    with open(path, "rb") as f:
        for raw in f:
            for sub, line in enumerate(raw.decode(errors="replace").splitlines()):
                n += 1
                yield offset, sub, n, line
            offset += len(raw)


class JsonlListing(Listing):
    """captions.jsonl: per non-blank line its byte offset, sub-line and number; lines are parsed again per range."""

    def __init__(self, root: Path, default_prompt: str):
        self.root, self.prompt = root, default_prompt
        self.path = root / "captions.jsonl"
        self.offsets, self.subs, self.numbers = array("q"), array("l"), array("q")
        self.duplicates = find_duplicates(self._scan(), lambda i: self._raw(i, i + 1)[0])

    def _scan(self) -> Iterable[str | None]:
        """One pass over the file: fills the arrays and yields each line's key (None: a bad line), never kept."""
        for offset, sub, n, line in _jsonl_lines(self.path):
            if not line.strip():
                continue  # blank lines are not samples
            self.offsets.append(offset), self.subs.append(sub), self.numbers.append(n)
            e = _jsonl_record(self.root, n, line, self.prompt)
            yield e.key if e.error is None else None

    def __len__(self) -> int:
        return len(self.offsets)

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        out = []
        with open(self.path, "rb") as f:
            for i in range(lo, hi):
                f.seek(self.offsets[i])
                line = f.readline().decode(errors="replace").splitlines()[self.subs[i]]
                out.append(_jsonl_record(self.root, self.numbers[i], line, self.prompt))
        return out


class TxtFolderListing(Listing):
    """Images with same-stem .txt captions: sorted relative paths packed into one bytes blob + an offsets array.

    The .txt files are read per range (when the shard is encoded), not at start-up.
    """

    def __init__(self, root: Path, default_prompt: str):
        self.root, self.prompt = root, default_prompt
        rels = image_paths(root)
        self.ends = array("q")
        pos = 0
        for r in rels:
            pos += len(r)
            self.ends.append(pos)
        self.blob = b"".join(rels)
        del rels
        self.duplicates = find_duplicates((safe_key(self._rel(i)) for i in range(len(self))),
                                          lambda i: self._raw(i, i + 1)[0])

    def __len__(self) -> int:
        return len(self.ends)

    def _rel(self, i: int) -> str:
        return self.blob[self.ends[i - 1] if i else 0:self.ends[i]].decode(errors="surrogateescape")

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        out = []
        for i in range(lo, hi):
            rel = self._rel(i)
            p = self.root / rel
            e = Entry(key=safe_key(rel), source=rel, prompt=self.prompt, loc=("file", str(p)))
            txt = p.with_suffix(".txt")
            if not txt.is_file():
                e.error = f"missing caption file: {txt.relative_to(self.root).as_posix()}"
            else:
                e.caption = txt.read_text(errors="replace").strip()
                if not e.caption:
                    e.error = f"empty caption file: {txt.relative_to(self.root).as_posix()}"
            out.append(e)
        return out


_IMAGE_SUFFIXES_B = tuple(x.encode() for x in IMAGE_SUFFIXES)


def image_paths(root: Path) -> list[bytes]:
    """Relative POSIX paths (raw bytes) of the image files under `root`, recursively, sorted; symlinked folders are
    not entered, symlinked files count. A directory entry carries its file type, so a regular file costs no stat
    call (Path.rglob + is_file made one per image: on a network file system, a round trip each)."""
    out: list[bytes] = []
    stack = [b""]
    base = os.fsencode(root)
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(os.path.join(base, rel) if rel else base) as it:
                for e in it:
                    r = rel + b"/" + e.name if rel else e.name
                    if e.is_dir(follow_symlinks=False):
                        stack.append(r)
                    elif os.path.splitext(e.name)[1].lower() in _IMAGE_SUFFIXES_B and e.is_file():
                        out.append(r)
        except OSError as err:  # an unreadable folder: say so rather than drop its images silently
            print(f"warning: cannot list {os.fsdecode(os.path.join(base, rel))} ({err.strerror}): its images are "
                  "left out", file=sys.stderr)
    out.sort()
    return out


def folder_listing(path: str, default_prompt: str) -> Listing:
    root = Path(path)
    if (root / "captions.jsonl").is_file():
        return JsonlListing(root, default_prompt)
    return TxtFolderListing(root, default_prompt)


# ----------------------------------------------------------------------------------------------------------------------
# Webdataset sources: one header scan per tar, persisted


def expand_braces(pattern: str) -> list[str]:
    """'a{00..02}b' -> ['a00b', 'a01b', 'a02b']; 'x{a,b}' -> ['xa', 'xb'] (the first brace group, recursively)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    body, head, tail = m.group(1), pattern[:m.start()], pattern[m.end():]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        a, b = rng.groups()
        width = len(a) if a.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(a), int(b) + 1)]
    else:
        items = body.split(",")
    return [out for item in items for out in expand_braces(head + item + tail)]


def shard_files(pattern: str) -> list[str]:
    files: list[str] = []
    for part in pattern.split("::"):
        for p in expand_braces(part):
            files += sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
    if not files:
        raise UserError(f"config key 'source.path': no shards match {pattern!r}")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise UserError(f"config key 'source.path': shard not found: {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return files


def _add_member(samples: dict[str, dict], full_name: str, offset: int, size: int) -> None:
    name = full_name.rsplit("/", 1)[-1]
    key, _, member = name.partition(".")
    prefix = full_name[: len(full_name) - len(name)]
    samples.setdefault(prefix + key, {})[member.lower()] = (offset, size)


def _tar_samples(path: str) -> tuple[list[tuple[str, dict]], str | None]:
    """[(key, {member: (offset, size)})] in tar order, plus an error if the tar is broken part-way."""
    samples: dict[str, dict] = {}
    error = None
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if m.isfile():
                    _add_member(samples, m.name, m.offset_data, m.size)
    except (tarfile.TarError, OSError, EOFError) as e:
        error = f"broken tar: after {len(samples)} samples: {type(e).__name__}: {e}"
    # a tar cut short can list a last member whose data runs past the end: its sample is damaged, not short
    end = os.path.getsize(path)
    whole = [(key, members) for key, members in samples.items() if all(o + n <= end for o, n in members.values())]
    if len(whole) < len(samples):
        error = f"broken tar: truncated after {len(whole)} whole samples" + (f" ({error})" if error else "")
    return whole, error


def _tar_identity(path: str) -> list:
    """What a per-tar listing is valid for: the same file (absolute path), size and modification time."""
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns, INDEX_VERSION]


def index_tar(path: str, index_file: Path) -> dict:
    """The tar's header listing, from `index_file` when it matches the tar, else scanned and written atomically."""
    ident = _tar_identity(path)
    try:
        cached = json.loads(index_file.read_text())
        if cached.get("identity") == ident:
            return cached
    except (OSError, ValueError):
        pass  # missing, or a hand-edited file: scan again
    samples, broken = _tar_samples(path)
    listing = {"identity": ident, "samples": [[k, {m: list(v) for m, v in ms.items()}] for k, ms in samples],
               "broken": broken, "count": len(samples) + (1 if broken else 0)}
    cf.atomic_write_json(index_file, listing)
    return listing


def _tar_entries(path: str, listing: dict, default_prompt: str) -> list[Entry]:
    """One tar's entries in tar order (plus a final error entry if the tar is broken part-way)."""
    name = Path(path).name
    entries = []
    for key, members in listing["samples"]:
        e = Entry(key=safe_key(key), source=f"{name}:{key}", prompt=default_prompt)
        img = next((m for m in WDS_IMAGE_MEMBERS if m in members), None)
        if img is None:
            e.error = "missing image (no jpg/png/webp member)"
        elif "txt" not in members:
            e.error = "missing caption (no txt member)"
        else:
            e.loc = ("tar", path, *members[img])
            e.extra = {"txt": tuple(members["txt"]), "json": tuple(members["json"]) if "json" in members else None}
        entries.append(e)
    if listing["broken"]:
        entries.append(Entry(key=safe_key(f"{name}-broken"), source=name, error=listing["broken"]))
    return entries


class WebdatasetListing(Listing):
    """Tars listed into `index_dir` once: `tar-<j>.json` (keys, member offsets, broken-tar error), `tar-<j>.keys.json`
    (usable positions + key hashes) and `listing.json` (every tar's identity and count, the duplicate errors).

    Start-up on every process: stat each tar; if listing.json matches them all, that is the whole cost. Otherwise
    rank r scans (or re-validates) tars j with j % world == r, everyone waits, rank 0 runs the duplicate check from
    the hash files and writes listing.json, everyone waits and reads it. `entries(lo, hi)` loads only the per-tar
    listings that overlap [lo, hi).
    """

    def __init__(self, pattern: str, default_prompt: str, index_dir: Path, rank: int = 0, world: int = 1,
                 barrier: Callable[[], None] = lambda: None):
        self.files, self.prompt, self.index_dir = shard_files(pattern), default_prompt, Path(index_dir)
        self._cache: dict[int, list[Entry]] = {}
        summary_file = self.index_dir / "listing.json"
        idents = [_tar_identity(p) for p in self.files]
        fresh = (_read_json(summary_file) or {}).get("identities") == idents
        if not fresh:  # decided before anyone writes, so every rank takes the same branch and meets the barriers
            self.index_dir.mkdir(parents=True, exist_ok=True)
            for j in range(rank, len(self.files), world):
                self._tar_keys(j)  # scans the tar (or checks its listing) and hashes its keys, in parallel
        barrier()
        if not fresh and rank == 0:
            self._write_summary(summary_file, idents)
        barrier()
        summary = _read_json(summary_file)
        self.starts = [0] + list(np.cumsum(summary["counts"]).tolist())
        self.duplicates = {int(i): m for i, m in summary["duplicates"].items()}
        self._cache = {}

    def _write_summary(self, summary_file: Path, idents: list) -> None:
        """The one serial step (rank 0): counts and duplicates from the hash files, 16 bytes per entry."""
        keys = [self._tar_keys(j) for j in range(len(self.files))]
        counts = [k[0] for k in keys]
        self.starts = [0] + list(np.cumsum(counts).tolist())
        index = np.concatenate([np.zeros(0, np.int64)] + [a + pos for a, (_, pos, _) in zip(self.starts, keys)])
        hashes = np.concatenate([np.zeros(0, np.int64)] + [h for _, _, h in keys])
        dups = duplicates_from_hashes(index, hashes, lambda i: self._raw(i, i + 1)[0])
        cf.atomic_write_json(summary_file, {"identities": idents, "counts": counts,
                                            "duplicates": {str(i): m for i, m in sorted(dups.items())}})

    def _index_file(self, j: int) -> Path:
        return self.index_dir / f"tar-{j:06d}.json"

    def _tar_keys(self, j: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(entries, positions of the usable ones, their key hashes) of tar j, from tar-<j>.keys.json when it matches
        the tar, else from the tar's listing; kept apart from the listing so rank 0 reads 16 bytes per entry."""
        path, keys_file = self.files[j], self.index_dir / f"tar-{j:06d}.keys.json"
        cached = _read_json(keys_file)
        if cached is None or cached.get("identity") != _tar_identity(path):
            entries = _tar_entries(path, index_tar(path, self._index_file(j)), "")
            pos = [p for p, e in enumerate(entries) if e.error is None]
            hashes = [key_hash(entries[p].key) for p in pos]
            cached = {"identity": _tar_identity(path), "count": len(entries),
                      "positions": base64.b64encode(np.array(pos, "<i8").tobytes()).decode(),
                      "hashes": base64.b64encode(np.array(hashes, "<i8").tobytes()).decode()}
            cf.atomic_write_json(keys_file, cached)
        pos, hashes = (np.frombuffer(base64.b64decode(cached[k]), "<i8").astype(np.int64)
                       for k in ("positions", "hashes"))
        return cached["count"], pos, hashes

    def _tar(self, j: int) -> list[Entry]:
        if j not in self._cache:
            if len(self._cache) >= 2:  # consecutive shards of one process usually fall in the same tar
                self._cache.pop(next(iter(self._cache)))
            self._cache[j] = _tar_entries(self.files[j], index_tar(self.files[j], self._index_file(j)), self.prompt)
        return self._cache[j]

    def __len__(self) -> int:
        return self.starts[-1]

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        out: list[Entry] = []
        j = max(0, int(np.searchsorted(self.starts, lo, side="right")) - 1)
        while lo < hi:
            a = self.starts[j]
            take = self._tar(j)[lo - a:hi - a]
            out += [Entry(**vars(e)) for e in take]  # copies: duplicate marking must not touch the cached list
            lo += len(take)
            j += 1
        return out

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": {}}  # DataLoader workers start with an empty cache


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def open_listing(source_type: str, path: str | None, num_samples: int, seed: int, prompt: str, *,
                 index_dir: Path, rank: int = 0, world: int = 1,
                 barrier: Callable[[], None] = lambda: None) -> Listing:
    """The source's order; for webdataset, indexed into `index_dir` by all processes together (collective call)."""
    if source_type == "synthetic":
        return SyntheticListing(seed, num_samples)
    if source_type == "folder":
        return folder_listing(path, prompt)
    return WebdatasetListing(path, prompt, index_dir, rank, world, barrier)


def list_entries(source_type: str, path: str | None, num_samples: int, seed: int, prompt: str) -> list[Entry]:
    """Every entry of the source at once (benchmarks, small sources); precompute itself uses `open_listing`.
    A webdataset source is indexed into a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        listing = open_listing(source_type, path, num_samples, seed, prompt, index_dir=Path(tmp))
        return listing.entries(0, len(listing))
