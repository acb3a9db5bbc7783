"""Caches of an older format_version, read as the current one: every "written before ..." rule of the cache format
lives here, applied as the manifest and the sidecars are loaded (and, by `member`, to names read from a tar), so the
reader sees one layout.

- 4 (what this code writes): the manifest keeps totals (`num_shards`, `bytes`) and names the shard index's parts
  (index.py: safetensors arrays of every shard's and sample's record); it no longer lists every shard.
- 3: the manifest lists every shard (`shards`: path, num_samples, bytes, sha256) and its shard index, where it has
  one, is gzipped JSON of whole sidecars. Read through the per-shard list and the sidecars (or, remotely, those JSON
  parts): opening parses every sidecar record in Python (about 2 ms per shard on a loaded 2-core VM), with a note.
  Every sample's original image is the member IMAGE, whatever its format.
- 2: the image member was named by its format (`jpg`, `png` or `webp`), so one cache could hold samples with different
  member names (which `datasets`' webdataset builder refuses); read as IMAGE.
- 1: besides, any of these may be missing (caches written before they existed): a sample's `latent_shape` (then it
  has the manifest's common `latent_shape`), its `crc32` (read unchecked: `CacheReader.checksummed` is then False and
  training prints a note), the manifest's `contents.latents` (then it holds the posterior: mean and logvar).

Precompute resumes and extends only caches of the current version: rerunning it on an older cache's output_dir is
refused naming `fingerprint.format_version` (build into another output_dir).
"""

from __future__ import annotations

from pathlib import Path

from theworld.cache_format.names import IMAGE
from theworld.core.errors import UserError

FORMAT_VERSION = 4
READABLE = (1, 2, 3, 4)
INDEXED = 4  # from this version on the shard index holds the per-shard records
CHECKSUMS = "crc32"  # a sidecar sample's field {member: zlib.crc32 of its bytes}
FORMAT_NAMED_IMAGES = ("jpg", "png", "webp")  # versions 1-2: the image member, named by the image's format


def check_version(m: dict, cache_dir: Path | str) -> int:
    version = m.get("format_version")
    if version not in READABLE:
        raise UserError(
            f"cache {cache_dir} has format_version {version!r}, this code reads "
            f"{', '.join(map(str, READABLE[:-1]))} and {READABLE[-1]}"
        )
    return version


def manifest(m: dict, cache_dir: Path | str) -> dict:
    """`m` read as FORMAT_VERSION (in place), or a one-line refusal of a version this code does not read. Keeps the
    version it was written as under `written_as`."""
    version = check_version(m, cache_dir)
    if version == FORMAT_VERSION:
        return m
    contents = m.setdefault("contents", {})
    if isinstance(contents, dict):
        contents.setdefault("latents", "posterior")
    if isinstance(m.get("shards"), list):  # the totals a format-4 manifest keeps (the list stays: layout.shard_table)
        m.setdefault("num_shards", len(m["shards"]))
        m.setdefault("bytes", sum(s.get("bytes", 0) for s in m["shards"] if isinstance(s, dict)))
    if isinstance(m.get("fingerprint"), dict):  # what a reader compares: the layout it now reads
        m["fingerprint"]["format_version"] = FORMAT_VERSION
    m["written_as"], m["format_version"] = version, FORMAT_VERSION
    return m


def member(name: str) -> str:
    """A sample's member name as FORMAT_VERSION calls it."""
    return IMAGE if name in FORMAT_NAMED_IMAGES else name


def sidecar(side: dict, m: dict) -> dict:
    """A shard's sidecar read as FORMAT_VERSION (in place), given its cache's migrated manifest `m`. Filled by what is
    missing rather than by its version field, which version-1 caches carried through every addition."""
    square = m.get("latent_shape")  # every sample's shape when the cache has one
    for s in side["samples"]:
        if square is not None:
            s.setdefault("latent_shape", square)
        s.setdefault(CHECKSUMS, {})
        for field in ("members", CHECKSUMS):
            if isinstance(s[field], dict) and any(name in FORMAT_NAMED_IMAGES for name in s[field]):
                s[field] = {member(name): value for name, value in s[field].items()}
    return side
