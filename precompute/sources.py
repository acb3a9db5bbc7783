"""Sources: a fixed, documented order of entries, each with a stable key taken from the source (never a position).

Order (shard i of the cache = entries [i*S, (i+1)*S) of this list, so it must never depend on the machine):
  synthetic:  index 0..num_samples-1; key "synthetic-<seed>-<index:08d>" (the index *is* the sample's identity).
  folder:     with captions.jsonl: its lines in file order; key = safe_key(image relative path).
              without: image files sorted by relative path (POSIX, byte order), caption from the same-stem .txt.
  webdataset: shard files in pattern order (each brace/glob expanded and sorted), samples in tar order;
              key = safe_key(the tar's __key__).
An entry that is already known to be unusable (bad caption line, missing image or caption, duplicate key) stays in
the order as an error entry, so each shard's errors are a deterministic function of the source.

Listing is cheap (paths and tar headers, no image bytes); `load_bytes` runs in DataLoader workers.
"""
from __future__ import annotations

import glob
import io
import json
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from theworld import synthetic
from theworld.cache_format import safe_key
from theworld.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
WDS_IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")


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
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise OSError(f"truncated tar member ({len(data)} of {size} bytes)")
    return data


def _mark_duplicates(entries: list[Entry]) -> list[Entry]:
    first: dict[str, str] = {}
    for e in entries:
        if e.error is None:
            if e.key in first:
                e.error = f"duplicate key: {e.key!r} (first used by {first[e.key]})"
            else:
                first[e.key] = e.source
    return entries


def synthetic_entries(seed: int, num_samples: int) -> list[Entry]:
    return [Entry(key=f"synthetic-{seed}-{i:08d}", source=f"synthetic:{i}", caption="", prompt=synthetic.PROMPT,
                  loc=("synthetic", seed, i)) for i in range(num_samples)]


def _folder_from_jsonl(root: Path, default_prompt: str) -> list[Entry]:
    entries = []
    for n, line in enumerate((root / "captions.jsonl").read_text(errors="replace").splitlines(), start=1):
        src = f"captions.jsonl:{n}"
        if not line.strip():
            continue  # blank lines are not samples
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
            rel, caption = rec["image"], rec["caption"]
            prompt = rec.get("prompt", default_prompt)
            if not all(isinstance(v, str) for v in (rel, caption, prompt)) or not rel:
                raise ValueError("'image', 'caption' and 'prompt' must be non-empty strings")
        except (ValueError, KeyError) as e:
            reason = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            entries.append(Entry(key=safe_key(f"line-{n}"), source=src, error=f"bad caption line: {reason}"))
            continue
        path = root / rel
        entries.append(Entry(key=safe_key(rel), source=rel, caption=caption, prompt=prompt, loc=("file", str(path)),
                             extra={"line": n}))
    return entries


def _folder_from_txt(root: Path, default_prompt: str) -> list[Entry]:
    files = sorted((p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES),
                   key=lambda p: p.relative_to(root).as_posix().encode())
    entries = []
    for p in files:
        rel = p.relative_to(root).as_posix()
        e = Entry(key=safe_key(rel), source=rel, prompt=default_prompt, loc=("file", str(p)))
        txt = p.with_suffix(".txt")
        if not txt.is_file():
            e.error = f"missing caption file {txt.relative_to(root).as_posix()}"
        else:
            e.caption = txt.read_text(errors="replace").strip()
            if not e.caption:
                e.error = f"empty caption file {txt.relative_to(root).as_posix()}"
        entries.append(e)
    return entries


def folder_entries(path: str, default_prompt: str) -> list[Entry]:
    root = Path(path)
    if (root / "captions.jsonl").is_file():
        return _mark_duplicates(_folder_from_jsonl(root, default_prompt))
    return _mark_duplicates(_folder_from_txt(root, default_prompt))


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


def _tar_samples(path: str) -> tuple[list[tuple[str, dict]], str | None]:
    """[(key, {member: (offset, size)})] in tar order, plus an error if the tar is broken part-way."""
    samples: dict[str, dict] = {}
    error = None
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                name = m.name.rsplit("/", 1)[-1]
                key, _, member = name.partition(".")
                prefix = m.name[: len(m.name) - len(name)]
                samples.setdefault(prefix + key, {})[member.lower()] = (m.offset_data, m.size)
    except (tarfile.TarError, OSError, EOFError) as e:
        error = f"broken tar after {len(samples)} samples: {type(e).__name__}: {e}"
    return list(samples.items()), error


def webdataset_entries(pattern: str, default_prompt: str) -> list[Entry]:
    entries = []
    for path in shard_files(pattern):
        name = Path(path).name
        samples, broken = _tar_samples(path)
        for key, members in samples:
            e = Entry(key=safe_key(key), source=f"{name}:{key}", prompt=default_prompt)
            img = next((m for m in WDS_IMAGE_MEMBERS if m in members), None)
            if img is None:
                e.error = "missing image (no jpg/png/webp member)"
            elif "txt" not in members:
                e.error = "missing caption (no txt member)"
            else:
                e.loc = ("tar", path, *members[img])
                e.extra = {"txt": members["txt"], "json": members.get("json")}  # read in the worker
            entries.append(e)
        if broken:
            entries.append(Entry(key=safe_key(f"{name}-broken"), source=name, error=broken))
    return _mark_duplicates(entries)


def list_entries(source_type: str, path: str | None, num_samples: int, seed: int, prompt: str) -> list[Entry]:
    if source_type == "synthetic":
        return synthetic_entries(seed, num_samples)
    if source_type == "folder":
        return folder_entries(path, prompt)
    return webdataset_entries(path, prompt)


def read_member(path: str, loc: tuple[int, int] | None) -> bytes | None:
    if loc is None:
        return None
    with open(path, "rb") as f:
        f.seek(loc[0])
        return f.read(loc[1])
