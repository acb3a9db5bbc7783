"""Webdataset sources (img2dataset shards): one header scan per tar, persisted.

Order: shard files in pattern order (braces expanded in order, each glob sorted; a folder means every *.tar in it,
sorted), samples in tar order; key = safe_key(the tar's __key__). Members are grouped into samples as webdataset
groups them: consecutive members with the same key, a new sample when the key changes or a member repeats. A key
that comes back later in the same tar is a `duplicate key` error entry; the first sample keeps it.
"""

from __future__ import annotations

import base64
import glob
import os
import re
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from precompute.sources import content
from precompute.sources.listing import (
    Entry,
    Listing,
    Loaded,
    check_unchanged,
    duplicate_error,
    duplicates_from_hashes,
    file_identity,
    key_hash,
    read_json,
)
from theworld import cache_format as cf
from theworld.cache_format import safe_key
from theworld.core.errors import UserError, one_line

WDS_IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp", cf.IMAGE)  # the last: a cache of ours as a source
INDEX_VERSION = 3  # bump when the per-tar listing's content changes, so old listings are rebuilt


def expand_braces(pattern: str) -> list[str]:
    """'a{00..02}b' -> ['a00b', 'a01b', 'a02b']; 'x{a,b}' -> ['xa', 'xb'] (the first brace group, recursively)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    body, head, tail = m.group(1), pattern[: m.start()], pattern[m.end() :]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        a, b = rng.groups()
        width = len(a) if a.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(a), int(b) + 1)]
    else:
        items = body.split(",")
    return [out for item in items for out in expand_braces(head + item + tail)]


def shard_files(pattern: str, suffix: str = ".tar") -> list[str]:
    """The files a `source.path` names: patterns separated by "::", braces expanded in order, each glob sorted, a
    folder meaning every `*<suffix>` in it, sorted."""
    files: list[str] = []
    for part in pattern.split("::"):
        for p in expand_braces(part):
            if os.path.isdir(p):
                files += sorted(glob.glob(os.path.join(glob.escape(p), "*" + suffix)))
            else:
                files += sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
    if not files:
        raise UserError(f"config key 'source.path': no {suffix} files match {pattern!r}")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise UserError(
            f"config key 'source.path': shard not found: {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return files


def _sample_key(full_name: str) -> tuple[str, str]:
    """(sample key, member) of a tar member name: the key keeps the folder part, the member is the lower-cased text
    after the first '.' of the file name."""
    name = full_name.rsplit("/", 1)[-1]
    key, member = cf.split_member(name)
    return full_name[: len(full_name) - len(name)] + key, member.lower()


def _tar_samples(path: str) -> tuple[list[tuple[str, dict]], list[int], str | None]:
    """([(key, {member: (offset, size)})] in tar order, positions of samples whose key was used earlier in the tar,
    an error if the tar is broken part-way)."""
    samples: list[tuple[str, dict]] = []
    seen: set[str] = set()
    dups: list[int] = []
    error = None
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                key, member = _sample_key(m.name)
                if not samples or samples[-1][0] != key or member in samples[-1][1]:
                    if key in seen:
                        dups.append(len(samples))
                    seen.add(key)
                    samples.append((key, {}))
                samples[-1][1][member] = (m.offset_data, m.size)
    except (tarfile.TarError, OSError, EOFError) as e:
        error = f"broken tar: after {len(samples)} samples: {type(e).__name__}: {one_line(e)}"
    # a tar cut short can list a last member whose data runs past the end: its sample is damaged, not short
    end = os.path.getsize(path)
    whole = [i for i, (_, members) in enumerate(samples) if all(o + n <= end for o, n in members.values())]
    if len(whole) < len(samples):
        error = f"broken tar: truncated after {len(whole)} whole samples" + (f" ({error})" if error else "")
    return [samples[i] for i in whole], [d for d in dups if d < len(whole)], error


def _tar_identity(path: str) -> list:
    """What a per-tar listing is valid for: the same file (absolute path), size and modification time."""
    return file_identity(path) + [INDEX_VERSION]


def index_tar(path: str, index_file: Path) -> dict:
    """The tar's header listing, from `index_file` when it matches the tar, else scanned and written atomically."""
    ident = _tar_identity(path)
    cached = read_json(index_file)
    if cached is not None and cached.get("identity") == ident:
        return cached
    samples, dups, broken = _tar_samples(path)
    listing = {
        "identity": ident,
        "samples": [[k, {m: list(v) for m, v in ms.items()}] for k, ms in samples],
        "duplicates": dups,
        "broken": broken,
        "count": len(samples) + (1 if broken else 0),
    }
    cf.atomic_write_json(index_file, listing)
    return listing


def tar_entries(path: str, listing: dict, default_prompt: str) -> list[Entry]:
    """One tar's entries in tar order (plus a final error entry if the tar is broken part-way)."""
    name = Path(path).name
    entries = []
    dups = set(listing["duplicates"])
    for pos, (key, members) in enumerate(listing["samples"]):
        e = Entry(key=safe_key(key), source=f"{name}:{key}", prompt=default_prompt)
        img = next((m for m in WDS_IMAGE_MEMBERS if m in members), None)
        if pos in dups:
            e.error = duplicate_error(e.key, f"{name}:{key}")
        elif img is None:
            e.error = f"missing image (no {'/'.join(WDS_IMAGE_MEMBERS)} member)"
        elif "txt" not in members:
            e.error = "missing caption (no txt member)"
        else:
            e.loc = (path, *members[img])
            e.extra = {"txt": tuple(members["txt"]), "json": tuple(members["json"]) if "json" in members else None}
        entries.append(e)
    if listing["broken"]:
        entries.append(Entry(key=safe_key(f"{name}-broken"), source=name, error=listing["broken"]))
    return entries


def load_sample(entry: Entry) -> Loaded:
    """A tar sample listed by `tar_entries`: image, caption (txt) and provenance (json) read at their offsets."""
    path = entry.loc[0]
    caption = content.decode_text(content.read_span(path, *entry.extra["txt"]))
    json_loc = entry.extra["json"]
    meta = content.provenance(content.read_span(path, *json_loc) if json_loc else None)
    return Loaded(content.read_image_span(*entry.loc), caption, entry.prompt, meta)


class WebdatasetListing(Listing):
    """Tars listed into `index_dir` once: `tar-<j>.json` (keys, member offsets, broken-tar error), `tar-<j>.keys.json`
    (usable positions + key hashes) and `listing.json` (every tar's identity and count, the duplicate errors).

    Start-up on every process: stat each tar; if listing.json matches them all, that is the whole cost. Otherwise
    rank r scans (or re-validates) tars j with j % world == r, everyone waits, rank 0 runs the duplicate check from
    the hash files and writes listing.json, everyone waits and reads it. `entries(lo, hi)` loads only the per-tar
    listings that overlap [lo, hi).
    """

    def __init__(
        self,
        pattern: str,
        default_prompt: str,
        index_dir: Path,
        rank: int = 0,
        world: int = 1,
        barrier: Callable[[], None] = lambda: None,
    ):
        self.files, self.prompt, self.index_dir = shard_files(pattern), default_prompt, Path(index_dir)
        self._cache: dict[int, list[Entry]] = {}
        summary_file = self.index_dir / "listing.json"
        idents = [_tar_identity(p) for p in self.files]
        recorded = (read_json(summary_file) or {}).get("identities")
        check_unchanged(recorded, idents, self.index_dir, "samples")  # the shards written follow the recorded tars
        fresh = recorded == idents
        if not fresh:  # decided before anyone writes, so every rank takes the same branch and meets the barriers
            self.index_dir.mkdir(parents=True, exist_ok=True)
            for j in range(rank, len(self.files), world):
                self._tar_keys(j)  # scans the tar (or checks its listing) and hashes its keys, in parallel
        barrier()
        if not fresh and rank == 0:
            self._write_summary(summary_file, idents)
        barrier()
        summary = read_json(summary_file)
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
        cf.atomic_write_json(
            summary_file,
            {"identities": idents, "counts": counts, "duplicates": {str(i): m for i, m in sorted(dups.items())}},
        )

    def _index_file(self, j: int) -> Path:
        return self.index_dir / f"tar-{j:06d}.json"

    def _tar_keys(self, j: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(entries, positions of the usable ones, their key hashes) of tar j, from tar-<j>.keys.json when it matches
        the tar, else from the tar's listing; kept apart from the listing so rank 0 reads 16 bytes per entry."""
        path, keys_file = self.files[j], self.index_dir / f"tar-{j:06d}.keys.json"
        cached = read_json(keys_file)
        if cached is None or cached.get("identity") != _tar_identity(path):
            entries = tar_entries(path, index_tar(path, self._index_file(j)), "")
            pos = [p for p, e in enumerate(entries) if e.error is None]
            hashes = [key_hash(entries[p].key) for p in pos]
            cached = {
                "identity": _tar_identity(path),
                "count": len(entries),
                "positions": base64.b64encode(np.array(pos, "<i8").tobytes()).decode(),
                "hashes": base64.b64encode(np.array(hashes, "<i8").tobytes()).decode(),
            }
            cf.atomic_write_json(keys_file, cached)
        pos, hashes = (
            np.frombuffer(base64.b64decode(cached[k]), "<i8").astype(np.int64) for k in ("positions", "hashes")
        )
        return cached["count"], pos, hashes

    def _tar(self, j: int) -> list[Entry]:
        if j not in self._cache:
            if len(self._cache) >= 2:  # consecutive shards of one process usually fall in the same tar
                self._cache.pop(next(iter(self._cache)))
            self._cache[j] = tar_entries(self.files[j], index_tar(self.files[j], self._index_file(j)), self.prompt)
        return self._cache[j]

    def __len__(self) -> int:
        return self.starts[-1]

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        out: list[Entry] = []
        j = max(0, int(np.searchsorted(self.starts, lo, side="right")) - 1)
        while lo < hi:
            a = self.starts[j]
            take = self._tar(j)[lo - a : hi - a]
            out += [Entry(**vars(e)) for e in take]  # copies: duplicate marking must not touch the cached list
            lo += len(take)
            j += 1
        return out

    def _load(self, entry: Entry) -> Loaded:
        return load_sample(entry)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": {}}  # DataLoader workers start with an empty cache
