"""Where everything of a cache lives (the names are in names.py): shard paths, atomic writes, the manifest (write,
load, the checks every reader relies on), sidecars, the errors listing and the repair hints."""

from __future__ import annotations

import bisect
import functools
import gzip
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from theworld.cache_format import index as index_mod
from theworld.cache_format import migrations
from theworld.cache_format.migrations import FORMAT_VERSION
from theworld.cache_format.names import (
    ERRORS,
    ERRORS_DIR,
    MANIFEST,
    RUN_FILE,
    SHARD_INDEX,
    SHARDS,
    TURNS,
)
from theworld.core import log
from theworld.core.atomic import write_bytes as atomic_write_bytes  # noqa: F401 - the one atomic writer
from theworld.core.atomic import write_json as atomic_write_json
from theworld.core.errors import CacheDamaged, UserError

_log = log.get(__name__)


def shard_stem(index: int) -> str:
    return f"shard-{index:06d}"


def tar_path(cache_dir: Path, index: int) -> Path:
    return Path(cache_dir) / SHARDS / f"{shard_stem(index)}.tar"


def sidecar_path(cache_dir: Path, index: int) -> Path:
    return Path(cache_dir) / SHARDS / f"{shard_stem(index)}.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------------------
# One sample


@dataclass
class Sample:
    key: str
    caption: str
    meta: dict  # prompt, source, original_size, crop_box, flip
    mean: torch.Tensor | None = None
    logvar: torch.Tensor | None = None
    flip_mean: torch.Tensor | None = None
    flip_logvar: torch.Tensor | None = None
    siglip: torch.Tensor | None = None
    image: bytes | None = None  # the original file's bytes (IMAGE)

    @property
    def prompt(self) -> str:
        return self.meta.get("prompt", "")

    @property
    def turns(self) -> list[tuple[str, str]]:
        """The conversation as (user, model) turns: (prompt, caption), then the META field TURNS if present."""
        return [(self.prompt, self.caption)] + [(u, m) for u, m in self.meta.get(TURNS, ())]


# ----------------------------------------------------------------------------------------------------------------------
# Shards


def member_name(key: str, member: str) -> str:
    """A sample's member as a tar entry (webdataset: the key is everything before the first dot)."""
    return f"{key}.{member}"


def split_member(name: str) -> tuple[str, str]:
    key, _, member = name.partition(".")
    return key, member


def error_path(cache_dir: Path, index: int) -> Path:
    return Path(cache_dir) / ERRORS_DIR / f"{shard_stem(index)}.jsonl"


def read_sidecar(cache_dir: Path, index: int) -> dict | None:
    """Shard `index`'s sidecar: its own file, or (a remote cache's stand-in folder, which holds a copy of the shard
    index instead of one file per shard) its record there. A local cache's missing sidecar stays missing: that is
    how a shard is marked to be redone."""
    try:
        side = json.loads(sidecar_path(cache_dir, index).read_bytes())
    except FileNotFoundError:
        side = _indexed_sidecar(Path(cache_dir), index)
    except (OSError, ValueError, RecursionError):
        return None
    return side if isinstance(side, dict) else None


# The shard index (index.py) in its format 1-3 layout: the sidecars of many shards in one gzipped JSON object each.
# Still read where a cache of that format is opened remotely (its stand-in folder holds these objects, not sidecars).
LEGACY_SUFFIX = ".json.gz"
LEGACY_SHARDS = 4096  # shards per part of that layout


def read_index_part(data: bytes, entry: dict) -> list[dict]:
    """The sidecars a format-3 shard-index object holds, checked against its manifest entry (ValueError: stale or
    damaged)."""
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"sha256 differs from what {MANIFEST} lists")
    part = json.loads(gzip.decompress(data))
    lo, hi = entry["shards"]
    if part.get("first") != lo or len(part.get("sidecars") or ()) != hi - lo:
        raise ValueError(f"holds other shards than {MANIFEST} lists")
    return part["sidecars"]


REMOTE_INDEX = ".remote-index"  # a stand-in folder's copy of its remote cache's shard index (storage.py)


def _indexed_sidecar(cache_dir: Path, index: int) -> dict | None:
    """Shard `index`'s sidecar from the stand-in's copy of the shard index part that holds it."""
    folder = Path(cache_dir) / REMOTE_INDEX
    path = folder / f"part-{index // LEGACY_SHARDS:06d}{LEGACY_SUFFIX}"
    if not path.is_file():
        try:
            firsts, paths = _part_files(str(folder), folder.stat().st_mtime_ns)
        except OSError:
            return None
        if not paths or (at := bisect.bisect_right(firsts, index) - 1) < 0:
            return None
        path = paths[at]
    try:
        st = path.stat()
    except OSError:
        return None
    loaded = _load_part(str(path), st.st_mtime_ns, st.st_size)
    if isinstance(loaded, index_mod.Part):
        return index_mod.sidecar(loaded, index) if 0 <= index - loaded.first < loaded.shards else None
    if loaded is not None:
        first, sides = loaded
        return sides[index - first] if 0 <= index - first < len(sides) else None
    return None


@functools.lru_cache(maxsize=4)
def _part_files(folder: str, mtime_ns: int) -> tuple[list[int], list[Path]]:
    """The parts in a stand-in's copy of the shard index (the folder at this mtime): first shards, sorted, and files."""
    found = sorted(
        (first, p)
        for p in Path(folder).glob(f"part-*{index_mod.SUFFIX}")
        if (first := index_mod.first_shard(p)) is not None
    )
    return [f for f, _ in found], [p for _, p in found]


@functools.lru_cache(maxsize=2)  # parts are read in shard order: one parse each
def _load_part(path: str, mtime_ns: int, size: int) -> index_mod.Part | tuple[int, list] | None:
    try:
        data = Path(path).read_bytes()
        if path.endswith(index_mod.SUFFIX):  # checked against the manifest when it was fetched
            return index_mod.decode_unchecked(data)
        part = json.loads(gzip.decompress(data))
        return int(part["first"]), list(part["sidecars"])
    except (OSError, ValueError, KeyError, TypeError, EOFError, RecursionError):
        return None


def shard_is_done(cache_dir: Path, index: int, expected_count: int | None = None) -> bool:
    """A shard is done iff its sidecar exists and matches its tar (size and sha256, and count when given)."""
    side = read_sidecar(cache_dir, index)
    tar = tar_path(cache_dir, index)
    if side is None or not tar.is_file() or side.get("format_version") != FORMAT_VERSION:
        return False
    if expected_count is not None and side.get("count") != expected_count:
        return False
    return os.path.getsize(tar) == side["bytes"] and sha256_file(tar) == side["sha256"]


# ----------------------------------------------------------------------------------------------------------------------
# Manifest


def latent_shape_counts(sidecars: list[dict]) -> list[dict]:
    """[{"shape", "num_samples"}] over the samples of these sidecars, shapes in sorted order."""
    counts = Counter(tuple(e["latent_shape"]) for side in sidecars for e in side["samples"] if "latent_shape" in e)
    return [{"shape": list(k), "num_samples": v} for k, v in sorted(counts.items())]


def write_manifest(
    cache_dir: Path,
    sidecars: list[dict],
    *,
    fingerprint: dict,
    latent_shape: list[int],
    latent_dtype: str,
    num_errors: int,
    contents: dict,
    extra: dict | None = None,
) -> dict:
    """The manifest, from the shards' sidecars; written last and atomically (its presence means complete). It keeps
    totals and lists every shard (design.md's layout, for tools that read the tars); a reader takes the shards'
    records from the shard index it names (index.py), written first, and does not parse the list.

    `latent_shape` (the config's; the sidecars' when they agree on one) is every sample's shape; with several
    (aspect-ratio buckets) it is null and `latent_shapes` lists each shape with its sample count."""
    shapes = latent_shape_counts(sidecars)
    if shapes:
        latent_shape = shapes[0]["shape"] if len(shapes) == 1 else None
    manifest = {
        "format_version": FORMAT_VERSION,
        "num_samples": sum(s["count"] for s in sidecars),
        "num_errors": num_errors,
        "latent_shape": latent_shape,
        "latent_shapes": shapes,
        "latent_dtype": latent_dtype,
        "contents": contents,  # which optional members exist: images, siglip, flip
        "num_shards": len(sidecars),
        "bytes": sum(s["bytes"] for s in sidecars),  # the tars' together
        "shards": [
            {"path": f"{SHARDS}/{shard_stem(i)}.tar", "num_samples": s["count"], "bytes": s["bytes"], "sha256": sha}
            for i, s in enumerate(sidecars)
            for sha in (s["sha256"],)
        ],
        "fingerprint": fingerprint,
        **index_mod.write(cache_dir, sidecars),  # shard_index, shard_table: before the manifest, which names them
    }
    # `extra` adds fields (source, config, ...): what is computed here from the sidecars is never taken from it, so a
    # manifest rewritten from an older one's fields cannot carry that one's shard list or index
    manifest.update({k: v for k, v in (extra or {}).items() if k not in manifest})
    atomic_write_json(Path(cache_dir) / MANIFEST, manifest)
    folder = Path(cache_dir) / SHARD_INDEX
    for name in index_mod.unnamed_parts(os.listdir(folder), [e["path"] for e in manifest["shard_index"]]):
        (folder / name).unlink(missing_ok=True)
    return manifest


def read_from_list(manifest: dict) -> bool:
    """Whether the shards' records are read from the manifest's list: a cache written before format 4 has no shard
    index of arrays. A format-4 manifest lists the shards too, but its index is the record readers use."""
    return manifest.get("written_as", manifest.get("format_version", FORMAT_VERSION)) < migrations.INDEXED


def shard_table(cache_dir: Path | str, manifest: dict) -> index_mod.ShardTable:
    """Every shard's record (count, bytes, sha256): the one accessor of them. A format 1-3 manifest's list; from
    format 4 on, the shard index (its parts are read here: a CacheReader has them as `shard_table`)."""
    if read_from_list(manifest):
        return index_mod.ShardTable.of_entries(manifest["shards"])
    return index_mod.ShardTable.of(index_parts(cache_dir, manifest))


def index_parts(cache_dir: Path | str, manifest: dict) -> list[index_mod.Part]:
    """The shard index's parts, in shard order: read from the cache (or a remote cache's stand-in copy), each checked
    against its manifest entry. A part that is missing or stale is built from its shards' sidecars, with a note; where
    those are missing too, one line naming the part. A cache written before format 4 is built from its sidecars."""
    entries = manifest.get("shard_index")
    if read_from_list(manifest) or not isinstance(entries, list):
        _log.info(
            f"cache {cache_dir}: written as format {manifest.get('written_as', '<4')}, so opening it parses every "
            f"sidecar record ({len(manifest['shards'])} shards, about 2 ms each); a cache written now opens from "
            "its shard index's arrays"
        )
        return _parts_of_sidecars(Path(cache_dir), manifest, 0, len(manifest["shards"]))
    parts = []
    for entry in entries:
        path = Path(cache_dir) / entry["path"]
        if not path.is_file():
            path = Path(cache_dir) / REMOTE_INDEX / Path(entry["path"]).name
        try:
            parts.append(index_mod.decode(path.read_bytes(), entry))
            continue
        except FileNotFoundError:
            problem = "is missing"
        except (OSError, ValueError) as e:
            problem = str(e)
        lo, hi = entry["shards"]
        if not all(sidecar_path(cache_dir, i).is_file() for i in range(lo, hi)):
            raise CacheDamaged(f"cache {cache_dir}: shard index part {entry['path']} {problem}; {REBUILD_MANIFEST}")
        _log.warning(
            f"cache {cache_dir}: shard index part {entry['path']} {problem}; building it from the sidecars of shards "
            f"{lo}-{hi - 1} ({REBUILD_MANIFEST} to write it again)"
        )
        parts += _parts_of_sidecars(Path(cache_dir), manifest, lo, hi)
    return parts


def _parts_of_sidecars(cache_dir: Path, manifest: dict, lo: int, hi: int) -> list[index_mod.Part]:
    """Shards [lo, hi)'s index arrays from their sidecars (one small part each: a sidecar that is missing or malformed
    is named with its repair)."""
    parts = []
    for i in range(lo, hi):
        side = read_sidecar(cache_dir, i)
        if not isinstance(side, dict):
            raise CacheDamaged(
                f"cache {cache_dir}: sidecar {sidecar_path(cache_dir, i)} is missing or not a JSON object; "
                f"{repair_hint(cache_dir, i)}"
            )
        try:
            parts.append(index_mod.build([migrations.sidecar(side, manifest)], i))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as e:
            raise CacheDamaged(
                f"cache {cache_dir}: sidecar {sidecar_path(cache_dir, i)} is malformed "
                f"({type(e).__name__}: {str(e)[:80]}); {repair_hint(cache_dir, i)}"
            ) from None
    return parts


def _every_input_failed(cache_dir: Path) -> bool:
    """A finished precompute run that kept nothing: errors.jsonl (written once every shard is) has a line for each
    entry the run recorded in its precompute.json."""
    try:
        entries = json.loads((cache_dir / RUN_FILE).read_bytes()).get("num_entries")
        return isinstance(entries, int) and entries > 0 and (cache_dir / ERRORS).read_bytes().count(b"\n") == entries
    except (OSError, ValueError, RecursionError, AttributeError):
        return False


def load_manifest(cache_dir: Path | str, parsed: dict | None = None) -> dict:
    """The cache's manifest, checked and migrated to the current format. `parsed`: its file's JSON as the caller
    already parsed it (storage.RemoteCache.take_manifest)."""
    path = Path(cache_dir) / MANIFEST
    if not path.is_file():
        if _every_input_failed(Path(cache_dir)):
            raise UserError(
                f"{cache_dir} holds no samples, so it is not a cache: every input of its precompute run "
                f"failed (the reasons are in its {ERRORS})"
            )
        if (Path(cache_dir) / SHARDS).is_dir():
            raise UserError(
                f"cache {cache_dir} is incomplete (no {MANIFEST}): rerun the precompute command to finish it"
            )
        raise UserError(f"no cache at {cache_dir} (no {MANIFEST})")
    try:
        manifest = parsed if parsed is not None else json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CacheDamaged(
            f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:120]}); {REBUILD_MANIFEST}"
        ) from None
    if not isinstance(manifest, dict):
        raise CacheDamaged(f"{path} holds a JSON {type(manifest).__name__}, not an object; {REBUILD_MANIFEST}")
    migrations.check_version(manifest, cache_dir)
    if problem := _manifest_problem(manifest):
        raise CacheDamaged(f"{path} is malformed: {problem}; {REBUILD_MANIFEST}")
    return migrations.manifest(manifest, cache_dir)


def latents_stored(manifest: dict) -> str:
    """ "posterior" (mean and logvar) or "mean" (cache.latents: mean); caches that do not say hold the posterior
    (migrations.manifest records it for version 1)."""
    return (manifest.get("contents") or {}).get("latents", "posterior")


REBUILD_MANIFEST = "rerun the precompute command that built this cache: it rewrites the manifest from the shards"


def world_steps(manifest: dict) -> int:
    """How many predicted frames follow the observed one in each sample's latents (`contents.world_steps`; a cache
    written before rollouts has none: 0). The latents are then (C, 1 + steps, h, w)."""
    return int((manifest.get("contents") or {}).get("world_steps", 0))


def _is_int(x: Any) -> bool:
    return type(x) is int and x >= 0


def _manifest_problem(m: dict) -> str | None:
    """What is wrong with the fields every reader relies on, or None."""
    if m.get("format_version", FORMAT_VERSION) >= migrations.INDEXED:
        if problem := _index_problem(m):
            return problem
    else:
        shards = m.get("shards")
        if not isinstance(shards, list):
            return "'shards' is not a list"
        for i, s in enumerate(shards):
            if not (
                isinstance(s, dict)
                and isinstance(s.get("path"), str)
                and _is_int(s.get("num_samples"))
                and _is_int(s.get("bytes"))
                and isinstance(s.get("sha256"), str)
                and len(s["sha256"]) == 64
            ):
                return f"shards[{i}] is not {{path, num_samples, bytes, sha256}}"
    for key in ("num_samples", "num_errors"):
        if not _is_int(m.get(key)):
            return f"'{key}' is not a count"
    shape = m.get("latent_shape")  # null when the samples' shapes differ (aspect-ratio buckets): see latent_shapes
    is_shape = lambda s: isinstance(s, list) and all(_is_int(d) for d in s)
    if not (is_shape(shape) or shape is None and isinstance(m.get("latent_shapes"), list)) or not isinstance(
        m.get("latent_dtype"), str
    ):
        return "'latent_shape' / 'latent_dtype' missing or not a shape and a dtype name"
    if not isinstance(m.get("fingerprint"), dict) or not isinstance(m.get("contents", {}), dict):
        return "'fingerprint' / 'contents' is not an object"
    if not _is_int(m.get("contents", {}).get("world_steps", 0)):
        return "'contents.world_steps' is not a count of predicted frames"
    return None


def _index_problem(m: dict) -> str | None:
    """What is wrong with a format-4 manifest's totals and shard index entries (parts in order, covering every
    shard once), or None."""
    for key in ("num_shards", "bytes"):
        if not _is_int(m.get(key)):
            return f"'{key}' is not a count"
    entries, end = m.get("shard_index"), 0
    if not isinstance(entries, list):
        return "'shard_index' is not a list"
    for i, e in enumerate(entries):
        ok = isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("sha256"), str)
        if not ok or not isinstance(e.get("shards"), list) or e["shards"][:1] != [end] or len(e["shards"]) != 2:
            return f"shard_index[{i}] is not {{path, bytes, sha256, shards: [first, end]}} following the one before"
        end = e["shards"][1]
        if not _is_int(end):
            return f"shard_index[{i}].shards is not a shard range"
    if end != m["num_shards"]:
        return f"'shard_index' covers {end} shards, 'num_shards' is {m['num_shards']}"
    t = m.get("shard_table", {"path": "", "sha256": "", "bytes": 0})  # caches written before it have none
    if not (isinstance(t, dict) and isinstance(t.get("path"), str) and isinstance(t.get("sha256"), str)):
        return "'shard_table' is not {path, bytes, sha256}"
    return None


def repair_hint(cache_dir: Path | str, index: int) -> str:
    """How to rebuild shard `index` alone: a shard without its sidecar is not done, so precompute redoes it."""
    return (
        f"to repair: delete {sidecar_path(cache_dir, index)} and rerun the precompute command that built this "
        "cache (it rebuilds that shard alone)"
    )


# ----------------------------------------------------------------------------------------------------------------------
# Errors and names


def read_errors(cache_dir: Path | str) -> list[dict]:
    path = Path(cache_dir) / ERRORS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]  # \n only, as written


def error_classes(cache_dir: Path | str) -> dict[str, int]:
    """How many errors of each class (a reason's text before its first colon), most frequent first."""
    return dict(Counter(e["reason"].split(":")[0] for e in read_errors(cache_dir)).most_common())


def image_bytes_hint(data: bytes) -> str | None:
    """Our extension for encoded image bytes (jpg/png/webp), by magic number; None for anything else."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def safe_key(text: str) -> str:
    """A webdataset-safe sample key: webdataset splits member names at the first '.', so keys keep to [A-Za-z0-9_-]."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in text)
