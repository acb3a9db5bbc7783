"""Folder sources, listed once per process into compact arrays (16 bytes a line, or the path's bytes + 8 a file).

with captions.jsonl: its lines in file order; key = safe_key(image relative path).
without: image files sorted by relative path (POSIX, byte order), caption from the same-stem .txt, and the url/uid
         of a same-stem .json when there is one (img2dataset's output_format=files layout).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

import numpy as np

from precompute.sources import content
from precompute.sources.content import SourceError
from precompute.sources.listing import Entry, Listing, Loaded, find_duplicates, read_json
from theworld import cache_format as cf
from theworld.cache_format import safe_key
from theworld.core import paths
from theworld.core.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_IMAGE_SUFFIXES_B = tuple(x.encode() for x in IMAGE_SUFFIXES)
LISTING_FILE = "folder.json"  # in <output_dir>/source-index/: what a rerun's listing must match


# ----------------------------------------------------------------------------------------------------------------------
# captions.jsonl


def check_image_path(rel: object) -> None:
    """A relative image path as a caption file names it: a non-empty string inside the source folder (absolute paths
    and '..' are refused; a symlink inside the folder is followed wherever it points)."""
    if not isinstance(rel, str) or not rel:
        raise ValueError("'image' must be a non-empty string")
    if "\x00" in rel:
        raise ValueError("'image' holds a NUL character")
    if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
        raise ValueError(f"'image' leaves the source folder: {rel!r}")


def _jsonl_record(root: Path, n: int, line: str | None, default_prompt: str) -> Entry:
    """Line n of captions.jsonl as an entry (an error entry for a bad line; None: the line is not valid UTF-8)."""
    src = f"captions.jsonl:{n}"
    try:
        if line is None:
            raise ValueError("invalid UTF-8")
        rec = content.parse_json(line)
        if not isinstance(rec, dict):
            raise ValueError("not a JSON object")
        rel, caption = rec["image"], rec["caption"]
        prompt = rec.get("prompt", default_prompt)
        if not all(isinstance(v, str) for v in (rel, caption, prompt)) or not rel:
            raise ValueError("'image', 'caption' and 'prompt' must be non-empty strings")
        check_image_path(rel)
    except (ValueError, KeyError) as e:
        reason = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        return Entry(key=safe_key(f"line-{n}"), source=src, error=f"bad caption line: {reason}")
    return Entry(key=safe_key(rel), source=rel, caption=caption, prompt=prompt, loc=(str(root / rel),))


def _split_line(raw: bytes) -> list[str | None]:
    """A line of captions.jsonl as its one text (None when it is not valid UTF-8). JSONL lines end at \\n only: a
    raw U+2028 or \\x85 is part of a JSON string, and a \\r before the \\n is JSON whitespace."""
    try:
        return [content.decode_text(raw.removesuffix(b"\n"))]
    except SourceError:
        return [None]


def _jsonl_lines(path: Path) -> Iterable[tuple[int, int, int, str | None]]:
    """(byte offset of the physical line, sub-line, line number, text) for every line of captions.jsonl.

    Lines end at \\n, as JSONL's do; the sub-line is always 0 (kept so listings index lines the same way).
    """
    n, offset = 0, 0
    with open(path, "rb") as f:
        for raw in f:
            for sub, line in enumerate(_split_line(raw)):
                n += 1
                yield offset, sub, n, line
            offset += len(raw)


class JsonlListing(Listing):
    """captions.jsonl: per non-blank line its byte offset, sub-line and number; lines are parsed again per range."""

    def __init__(self, root: Path, default_prompt: str, path: Path | None = None):
        self.root, self.prompt = root, default_prompt
        self.path = path or root / "captions.jsonl"
        self.offsets, self.subs, self.numbers = array("q"), array("l"), array("q")
        self.duplicates = find_duplicates(self._scan(), lambda i: self._raw(i, i + 1)[0])

    def _scan(self) -> Iterable[str | None]:
        """One pass over the file: fills the arrays and yields each line's key (None: a bad line), never kept."""
        for offset, sub, n, line in _jsonl_lines(self.path):
            if line is not None and not line.strip():
                continue  # blank lines are not samples
            self.offsets.append(offset), self.subs.append(sub), self.numbers.append(n)
            e = self._record(n, line)
            yield e.key if e.error is None else None

    def __len__(self) -> int:
        return len(self.offsets)

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        out = []
        with open(self.path, "rb") as f:
            for i in range(lo, hi):
                f.seek(self.offsets[i])
                line = _split_line(f.readline())[self.subs[i]]
                out.append(self._record(self.numbers[i], line))
        return out

    def _record(self, n: int, line: str | None) -> Entry:
        return _jsonl_record(self.root, n, line, self.prompt)

    def _load(self, entry: Entry) -> Loaded:
        return Loaded(content.read_file(entry.loc[0]), entry.caption, entry.prompt, {})

    def persist(self, index_dir: Path, rank: int) -> None:
        """Refuse to go on with a captions.jsonl that changed since the cache was started (its size and modification
        time are recorded on the first run): the shards already written follow the old lines."""
        st = os.stat(self.path)
        state = {"captions.jsonl": [st.st_size, st.st_mtime_ns], "count": len(self)}
        old = read_json(index_dir / LISTING_FILE)
        if old is None:
            if rank == 0:
                index_dir.mkdir(parents=True, exist_ok=True)
                cf.atomic_write_json(index_dir / LISTING_FILE, state)
        elif old != state:
            raise UserError(
                f"config key 'source.path': {self.path} changed since the cache in {index_dir.parent} was "
                f"started (size or modification time), so its shards follow other lines: restore it, or "
                f"use another output_dir (or delete that one) to start over"
            )


# ----------------------------------------------------------------------------------------------------------------------
# Images with same-stem .txt captions


def _why_not_a_file(path: bytes) -> str:
    """The reason an image-named directory entry that is not a regular file is left out."""
    return f"not a regular file ({paths.path_kind(path) or 'gone'})"


def walk_images(root: Path) -> tuple[list[bytes], dict[bytes, str]]:
    """(relative POSIX paths (raw bytes) of the image files under `root`, recursively, sorted; {relative path: reason}
    for each image-named entry or folder that cannot be used). Symlinked folders are not entered, symlinked files
    count. A bad entry (a symlink loop, a dangling link, a FIFO, a socket, a folder that cannot be listed) is reported
    and the walk goes on with the next one. A directory entry carries its file type, so a regular file costs no stat
    call (Path.rglob + is_file made one per image: on a network file system, a round trip each)."""
    out: list[bytes] = []
    problems: dict[bytes, str] = {}
    stack = [b""]
    base = os.fsencode(root)
    while stack:
        rel = stack.pop()
        try:
            it = os.scandir(os.path.join(base, rel) if rel else base)
        except OSError as err:
            problems[rel or b"."] = f"cannot list folder: {err.strerror}"
            continue
        with it:
            while True:
                try:
                    e = next(it)
                except StopIteration:
                    break
                except OSError as err:  # the listing itself broke off: what was read so far is kept
                    problems[rel or b"."] = f"cannot list folder: {err.strerror}"
                    break
                r = rel + b"/" + e.name if rel else e.name
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(r)
                        continue
                    if os.path.splitext(e.name)[1].lower() not in _IMAGE_SUFFIXES_B:
                        continue
                    if e.is_file():
                        out.append(r)
                        continue
                except OSError:  # e.g. a symlink loop: is_file() raises ELOOP
                    pass
                problems[r] = _why_not_a_file(os.path.join(base, r))
    out.sort()
    return out, problems


def image_paths(root: Path) -> list[bytes]:
    """The usable image files of `walk_images`."""
    return walk_images(root)[0]


class TxtFolderListing(Listing):
    """Images with same-stem .txt captions: sorted relative paths packed into one bytes blob + an offsets array, and
    the walk's problems as error entries in their sorted place. Captions are read when the entry is loaded."""

    def __init__(self, root: Path, default_prompt: str):
        self.root, self.prompt = root, default_prompt
        good, problems = walk_images(root)
        rels = sorted(good + list(problems))
        del good
        self.ends = array("q")
        pos = 0
        self.problems: dict[int, str] = {}
        for i, r in enumerate(rels):
            pos += len(r)
            self.ends.append(pos)
            if r in problems:
                self.problems[i] = problems[r]
        self.blob = b"".join(rels)
        del rels
        self.duplicates = find_duplicates(
            (None if i in self.problems else safe_key(self._rel(i)) for i in range(len(self))),
            lambda i: self._raw(i, i + 1)[0],
        )

    def __len__(self) -> int:
        return len(self.ends)

    def _rel(self, i: int) -> str:
        return self.blob[self.ends[i - 1] if i else 0 : self.ends[i]].decode(errors="surrogateescape")

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        out = []
        for i in range(lo, hi):
            rel = self._rel(i)
            out.append(
                Entry(
                    key=safe_key(rel),
                    source=rel,
                    prompt=self.prompt,
                    loc=(str(self.root / rel),),
                    error=self.problems.get(i),
                )
            )
        return out

    def _load(self, entry: Entry) -> Loaded:
        path = Path(entry.loc[0])
        txt = path.with_suffix(".txt")
        try:
            caption = content.decode_text(content.read_file(str(txt)))
        except FileNotFoundError:
            raise SourceError(f"missing caption file: {txt.relative_to(self.root).as_posix()}") from None
        return Loaded(content.read_file(str(path)), caption, entry.prompt, _sidecar_json(path.with_suffix(".json")))

    def persist(self, index_dir: Path, rank: int) -> None:
        """Record the listing on the first run (the relative paths in order); on a rerun, refuse a folder whose
        listing differs, naming a file added or removed: the shards already written follow the old order."""
        ends = np.frombuffer(self.ends, dtype=np.int64).astype("<i8").tobytes()
        digest = hashlib.sha256(ends + self.blob).hexdigest()
        old = read_json(index_dir / LISTING_FILE)
        if old is None:
            if rank == 0:
                index_dir.mkdir(parents=True, exist_ok=True)
                cf.atomic_write_bytes(index_dir / "folder-paths.bin", self.blob)
                cf.atomic_write_bytes(index_dir / "folder-ends.bin", ends)
                cf.atomic_write_json(index_dir / LISTING_FILE, {"count": len(self), "sha256": digest})
        elif old.get("sha256") != digest:
            raise UserError(
                f"config key 'source.path': the folder changed since the cache in {index_dir.parent} "
                f"was started ({self._change(index_dir)}), so its shards follow another listing: restore "
                "the folder, or use another output_dir (or delete that one) to start over"
            )

    def _change(self, index_dir: Path) -> str:
        """One file added or removed between the recorded listing and this one (the error path only)."""
        try:
            blob = (index_dir / "folder-paths.bin").read_bytes()
            ends = np.frombuffer((index_dir / "folder-ends.bin").read_bytes(), "<i8").tolist()
        except OSError:
            return "the recorded listing is unreadable"
        old = {blob[a:b] for a, b in zip([0] + ends[:-1], ends)}
        new = {self.blob[self.ends[i - 1] if i else 0 : self.ends[i]] for i in range(len(self))}
        added, removed = sorted(new - old), sorted(old - new)
        changes = [f"{os.fsdecode(p)} added" for p in added[:1]] + [f"{os.fsdecode(p)} removed" for p in removed[:1]]
        more = len(added) + len(removed) - len(changes)
        return ", ".join(changes) + (f", and {more} more" if more else "") if changes else "the order changed"


def _sidecar_json(path: Path) -> dict:
    """The url/uid of img2dataset's per-image .json (output_format=files), if there is one."""
    try:
        raw = content.read_file(str(path))
    except (OSError, SourceError):
        return {}
    return content.provenance(raw)


def folder_listing(path: str, default_prompt: str, index_dir: Path, rank: int = 0) -> Listing:
    """The folder's listing, checked against (or recorded as) the one this output_dir was started with."""
    root = Path(path)
    if (root / "captions.jsonl").is_file():
        listing = JsonlListing(root, default_prompt)
    else:
        listing = TxtFolderListing(root, default_prompt)
    listing.persist(Path(index_dir), rank)
    return listing
