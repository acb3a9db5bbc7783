"""The latent cache format (design section 3): the one place that knows it. Writer, reader and inspector use this.

    <cache_dir>/manifest.json            written last, atomically: the cache is complete iff it exists
    <cache_dir>/shards/shard-000000.tar  plain WebDataset shards
    <cache_dir>/shards/shard-000000.json sidecar written after its tar: keys, byte offsets, sha256, count
    <cache_dir>/errors.jsonl             one line per input that could not be used
    <cache_dir>/errors/shard-000000.jsonl  per-shard errors, written before the shard's tar, merged at the end
    <cache_dir>/precompute.json          what the cache is being built from: a rerun must match it
    <cache_dir>/source-index/            the webdataset source's per-tar header listings, kept for reruns

docs/cache-format.md describes the same for readers without this code; keep the two in step.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from theworld.encoders import DTYPES
from theworld.errors import CacheDamaged, CacheMismatch, UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARDS = "shards"
ERRORS = "errors.jsonl"
ERRORS_DIR = "errors"
RUN_FILE = "precompute.json"
INDEX_DIR = "source-index"
CHECKSUMS = "crc32"  # sidecar sample field {member: zlib.crc32 of its bytes}; caches written before it lack it
# Member names inside a sample (webdataset: "<key>.<member>").
LATENT = "latent.safetensors"  # tensors "mean", "logvar" (only "mean" with cache.latents: mean): (16, 1, h, w)
LATENT_FLIP = "latent_flip.safetensors"  # the same for the horizontally flipped image
SIGLIP = "siglip.safetensors"  # tensor "features": (mm_tokens, H), the multimodal projector's output
CAPTION = "txt"
META = "json"  # prompt, source, original_size, crop_box, flip
IMAGE_EXTS = ("jpg", "png", "webp")


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same folder, fsync, then rename: readers see all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


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
    image: bytes | None = None
    image_ext: str | None = None

    @property
    def prompt(self) -> str:
        return self.meta.get("prompt", "")


def encode_sample(s: Sample, dtype: str) -> dict[str, bytes]:
    """Sample -> {member name: bytes} (no "__key__"), tensors cast to the cache dtype."""
    dt = DTYPES[dtype]
    out = {CAPTION: s.caption.encode(), META: json.dumps(s.meta, sort_keys=True).encode()}
    out[LATENT] = latent_blob(s.mean, s.logvar, dt)
    if s.flip_mean is not None:
        out[LATENT_FLIP] = latent_blob(s.flip_mean, s.flip_logvar, dt)
    if s.siglip is not None:
        out[SIGLIP] = st_save({"features": s.siglip.to(dt).contiguous()})
    if s.image is not None:
        if s.image_ext not in IMAGE_EXTS:
            raise ValueError(f"image extension must be one of {IMAGE_EXTS}, got {s.image_ext!r}")
        out[s.image_ext] = s.image
    return out


def latent_blob(mean: torch.Tensor, logvar: torch.Tensor | None, dt: torch.dtype) -> bytes:
    """A latent member; logvar None (cache.latents: mean) stores the posterior mean alone."""
    tensors = {"mean": mean.to(dt).contiguous()}
    if logvar is not None:
        tensors["logvar"] = logvar.to(dt).contiguous()
    return st_save(tensors)


def latent_shape_of(blob: bytes) -> list[int]:
    """The shape of a latent member's "mean", from its safetensors header alone."""
    n = int.from_bytes(blob[:8], "little")
    return list(json.loads(blob[8:8 + n])["mean"]["shape"])


def decode_sample(key: str, members: dict[str, bytes], tensors: bool = True) -> Sample:
    """{member name: bytes} -> Sample. Missing optional members stay None; so do the tensors with tensors=False
    (a batch's are decoded together by `load_stacked`)."""
    s = Sample(key=key, caption=members[CAPTION].decode(), meta=json.loads(members[META]))
    for ext in IMAGE_EXTS:
        if ext in members:
            s.image, s.image_ext = members[ext], ext
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
    return {name: rows[:, lo:hi].view(dtype).view(len(blobs), *shape) for name, (dtype, shape, lo, hi) in layout.items()}


def _stackable_layout(header: bytes, data_size: int) -> dict | None:
    """{name: (dtype, shape, first byte, end byte)} when every tensor can be a view of a (samples, data_size) byte
    matrix: little-endian host, a dtype we map, offsets on element boundaries. None: decode one by one."""
    if sys.byteorder != "little":  # safetensors data is little-endian
        return None
    try:
        meta = json.loads(header[8:])
        layout = {name: (_ST_DTYPES[v["dtype"]], tuple(v["shape"]), *v["data_offsets"])
                  for name, v in meta.items() if name != "__metadata__"}
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
            raise ValueError("samples of one batch hold different tensors: "
                             f"{ {k: (tuple(v.shape), v.dtype) for k, v in first.items()} } vs "
                             f"{ {k: (tuple(v.shape), v.dtype) for k, v in t.items()} }")
    return {k: torch.stack([t[k] for t in loaded]) for k in first}


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


def write_shard(cache_dir: Path, index: int, samples: Iterable[tuple[str, dict[str, bytes]]]) -> dict:
    """Write shard `index` from (key, members) pairs: tar to a temporary name, rename, then its sidecar.

    Returns the sidecar. The tar is byte-for-byte reproducible (fixed mtime, owner, member order), so the same
    samples give the same sha256 whichever process or rerun writes them. Member offsets are taken from tarfile's own
    position while writing (no second pass over the tar: this runs on the writer thread beside the encoder).
    """
    tar = tar_path(cache_dir, index)
    tar.parent.mkdir(parents=True, exist_ok=True)
    tmp = tar.with_name(f".{tar.name}.tmp{os.getpid()}")
    entries = []
    with open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode="w") as tf:
            for key, members in samples:
                entry = {"key": key, "members": {}, CHECKSUMS: {}}
                if LATENT in members:  # the trainer groups samples by shape without reading the tar
                    entry["latent_shape"] = latent_shape_of(members[LATENT])
                for name in sorted(members):
                    data = members[name]
                    info = tarfile.TarInfo(member_name(key, name))
                    info.size, info.mode, info.mtime = len(data), 0o444, 0
                    tf.addfile(info, io.BytesIO(data))
                    padded = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                    entry["members"][name] = [tf.offset - padded, len(data)]  # data ends the member, then padding
                    entry[CHECKSUMS][name] = zlib.crc32(data)  # checked on every read (CacheReader.raw)
                entries.append(entry)
        f.flush()
        os.fsync(f.fileno())
    side = {"format_version": FORMAT_VERSION, "shard": tar.name, "count": len(entries),
            "bytes": os.path.getsize(tmp), "sha256": sha256_file(tmp), "samples": entries}
    os.replace(tmp, tar)
    atomic_write_json(sidecar_path(cache_dir, index), side)
    return side


def read_sidecar(cache_dir: Path, index: int) -> dict | None:
    try:
        side = json.loads(sidecar_path(cache_dir, index).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return side if isinstance(side, dict) else None


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
# Manifest and fingerprint


def make_fingerprint(*, vae_model: str, vae, vae_dtype: str, resolution: int, resize: str,
                     gemma_model: str | None = None, gemma=None, image_processor=None) -> dict:
    """Everything that changes the cached numbers. `gemma` and its `image_processor` only when SigLIP features are
    cached.

    `vae` is the loaded AutoencoderKLWan, `gemma` the loaded Gemma3ForConditionalGeneration; their weights are hashed,
    so a changed checkpoint is caught even under the same name. The image processor's settings (size, mean/std,
    resampling) decide what the vision tower sees, so they count too.
    """
    from theworld.encoders import config_digest, weights_hash

    fp = {"format_version": FORMAT_VERSION,
          "vae": {"model": vae_model, "config": config_digest(dict(vae.config)), "weights": weights_hash(vae),
                  "dtype": vae_dtype},
          "image": {"resolution": resolution, "resize": resize, "normalisation": "[-1,1]"},
          "siglip": None}
    if resize == "bucket":  # the set is a function of the resolution in this code; a cache records the one it used
        from theworld.images import buckets

        fp["image"]["buckets"] = [list(b) for b in buckets(resolution)]
    if gemma is not None:
        inner = gemma.model
        vision = torch.nn.ModuleDict({"tower": inner.vision_tower, "projector": inner.multi_modal_projector})
        if image_processor is None:
            raise ValueError("a SigLIP fingerprint needs the image processor")
        fp["siglip"] = {"model": gemma_model, "config": config_digest(gemma.config.vision_config.to_dict()),
                        "weights": weights_hash(vision), "dtype": str(gemma.dtype).removeprefix("torch."),
                        "image_processor": config_digest({k: v for k, v in image_processor.to_dict().items()
                                                          if k not in ("image_processor_type", "processor_class")})}
    return fp


def latent_shape_counts(sidecars: list[dict]) -> list[dict]:
    """[{"shape", "num_samples"}] over the samples of these sidecars, shapes in sorted order."""
    counts = Counter(tuple(e["latent_shape"]) for side in sidecars for e in side["samples"] if "latent_shape" in e)
    return [{"shape": list(k), "num_samples": v} for k, v in sorted(counts.items())]


def write_manifest(cache_dir: Path, sidecars: list[dict], *, fingerprint: dict, latent_shape: list[int],
                   latent_dtype: str, num_errors: int, contents: dict, extra: dict | None = None) -> dict:
    """The manifest, from the shards' sidecars; written last and atomically (its presence means complete).

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
        "shards": [{"path": f"{SHARDS}/{s['shard']}", "num_samples": s["count"], "bytes": s["bytes"],
                    "sha256": s["sha256"]} for s in sidecars],
        "fingerprint": fingerprint,
        **(extra or {}),
    }
    atomic_write_json(Path(cache_dir) / MANIFEST, manifest)
    return manifest


def latents_stored(manifest: dict) -> str:
    """"posterior" (mean and logvar) or "mean" (cache.latents: mean); caches that do not say hold the posterior."""
    return (manifest.get("contents") or {}).get("latents", "posterior")


def fingerprint_diff(expected: dict, actual: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two fingerprints (nested dicts compared leaf by leaf)."""
    out = []
    for k in sorted(set(expected) | set(actual)):
        a, b = expected.get(k), actual.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def check_fingerprint(cache_fp: dict, expected: dict, cache_dir: Path | str, fields: Iterable[str] | None = None) -> None:
    """Raise CacheMismatch naming the first differing field (only top-level `fields` are compared when given)."""
    if fields is not None:
        cache_fp = {k: cache_fp.get(k) for k in fields}
        expected = {k: expected.get(k) for k in fields}
    diff = fingerprint_diff(expected, cache_fp)
    if diff:
        f = diff[0]

        def get(d, dotted):
            for part in dotted.split("."):
                d = d.get(part) if isinstance(d, dict) else None
            return d

        more = f" (and {len(diff) - 1} more: {', '.join(diff[1:4])})" if len(diff) > 1 else ""
        raise CacheMismatch(f"cache {cache_dir} was built with a different {f}: cache has {get(cache_fp, f)!r}, "
                            f"this config gives {get(expected, f)!r}{more}")


def load_manifest(cache_dir: Path | str) -> dict:
    path = Path(cache_dir) / MANIFEST
    if not path.is_file():
        if (Path(cache_dir) / SHARDS).is_dir():
            raise UserError(f"cache {cache_dir} is incomplete (no {MANIFEST}): rerun the precompute command to finish it")
        raise UserError(f"no cache at {cache_dir} (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CacheDamaged(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:120]}); {REBUILD_MANIFEST}") from None
    if not isinstance(manifest, dict):
        raise CacheDamaged(f"{path} holds a JSON {type(manifest).__name__}, not an object; {REBUILD_MANIFEST}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"cache {cache_dir} has format_version {manifest.get('format_version')!r}, "
                        f"this code reads {FORMAT_VERSION}")
    if problem := _manifest_problem(manifest):
        raise CacheDamaged(f"{path} is malformed: {problem}; {REBUILD_MANIFEST}")
    return manifest


REBUILD_MANIFEST = "rerun the precompute command that built this cache: it rewrites the manifest from the shards"


def _is_int(x: Any) -> bool:
    return type(x) is int and x >= 0


def _manifest_problem(m: dict) -> str | None:
    """What is wrong with the fields every reader relies on, or None."""
    shards = m.get("shards")
    if not isinstance(shards, list):
        return "'shards' is not a list"
    for i, s in enumerate(shards):
        if not (isinstance(s, dict) and isinstance(s.get("path"), str) and _is_int(s.get("num_samples"))
                and _is_int(s.get("bytes")) and isinstance(s.get("sha256"), str)):
            return f"shards[{i}] is not {{path, num_samples, bytes, sha256}}"
    for key in ("num_samples", "num_errors"):
        if not _is_int(m.get(key)):
            return f"'{key}' is not a count"
    shape = m.get("latent_shape")  # null when the samples' shapes differ (aspect-ratio buckets): see latent_shapes
    is_shape = lambda s: isinstance(s, list) and all(_is_int(d) for d in s)  # noqa: E731
    if not (is_shape(shape) or shape is None and isinstance(m.get("latent_shapes"), list)) \
            or not isinstance(m.get("latent_dtype"), str):
        return "'latent_shape' / 'latent_dtype' missing or not a shape and a dtype name"
    if not isinstance(m.get("fingerprint"), dict) or not isinstance(m.get("contents", {}), dict):
        return "'fingerprint' / 'contents' is not an object"
    return None


def repair_hint(cache_dir: Path | str, index: int) -> str:
    """How to rebuild shard `index` alone: a shard without its sidecar is not done, so precompute redoes it."""
    return (f"to repair: delete {sidecar_path(cache_dir, index)} and rerun the precompute command that built this "
            "cache (it rebuilds that shard alone)")


# ----------------------------------------------------------------------------------------------------------------------
# Random access reading


@dataclass
class CacheReader:
    """Random access to a complete cache by global sample index, via the sidecars' byte offsets (no tar scan).

    The index is kept in numpy arrays (keys as fixed-width bytes, member spans as int64), not per-sample Python
    objects: ~100 bytes per sample, and forked DataLoader workers share it without copying (no refcounts to touch).
    Picklable (file descriptors are opened lazily per process). `members` limits what is read, e.g. skip the image
    bytes when every latent comes from the cache; the caption and json are always read.
    """

    cache_dir: Path
    members: tuple[str, ...] | None = None
    manifest: dict = field(init=False)
    _names: list[str] = field(init=False, repr=False)  # member names, the columns of _spans
    _keys: np.ndarray = field(init=False, repr=False)  # (N,) bytes
    _shard: np.ndarray = field(init=False, repr=False)  # (N,) int32: which tar
    _spans: np.ndarray = field(init=False, repr=False)  # (N, len(_names), 2) int64 offset, size; -1: absent
    latent_hw: np.ndarray = field(init=False, repr=False)  # (N, 2) int32: each sample's latent (h, w)
    _crc: np.ndarray = field(init=False, repr=False)  # (N, len(_names)) int64 crc32 of each member; -1: none recorded
    _sides: list = field(init=False, repr=False)  # per shard: the sidecar's (count, bytes, sha256)
    _files: dict = field(init=False, repr=False, default_factory=dict)
    # Members closer than this are read with one pread, tar headers and skipped members included: a system call
    # costs more than copying a few kB (docs/performance.md)
    READ_GAP = 16 << 10

    def __post_init__(self) -> None:
        self.cache_dir = Path(self.cache_dir)
        self.manifest = load_manifest(self.cache_dir)
        self._names, keys, shards, spans, crcs, hw, self._sides = [], [], [], [], [], [], []
        square = self.manifest.get("latent_shape")  # caches written before per-sample shapes: every sample's
        for i, _ in enumerate(self.manifest["shards"]):
            side = read_sidecar(self.cache_dir, i)
            if not isinstance(side, dict):
                raise CacheDamaged(f"cache {self.cache_dir}: sidecar {sidecar_path(self.cache_dir, i)} is missing or "
                                   f"not a JSON object; {repair_hint(self.cache_dir, i)}")
            try:
                block, crc = self._index_sidecar(side, keys)
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
                raise CacheDamaged(f"cache {self.cache_dir}: sidecar {sidecar_path(self.cache_dir, i)} is malformed "
                                   f"({type(e).__name__}: {str(e)[:80]}); {repair_hint(self.cache_dir, i)}") from None
            try:
                hw += [(s.get("latent_shape") or square)[-2:] for s in side["samples"]]
            except TypeError:
                raise UserError(f"cache {self.cache_dir}: shard {i}'s sidecar lacks per-sample latent shapes and the "
                                "manifest has no common latent_shape") from None
            spans.append(block)
            crcs.append(crc)
            self._sides.append((side.get("count"), side.get("bytes"), side.get("sha256")))
            shards.append(np.full(len(block), i, dtype=np.int32))
        width = len(self._names)
        pad = lambda b: np.pad(b, ((0, 0), (0, width - b.shape[1])) + ((0, 0),) * (b.ndim - 2), constant_values=-1)  # noqa: E731
        self._spans = np.concatenate([pad(b) for b in spans]) if spans else np.zeros((0, width, 2), dtype=np.int64)
        self._crc = np.concatenate([pad(c) for c in crcs]) if crcs else np.zeros((0, width), dtype=np.int64)
        self._keys = np.array(keys, dtype=bytes) if keys else np.zeros(0, dtype="S1")
        self._shard = np.concatenate(shards) if shards else np.zeros(0, dtype=np.int32)
        self.latent_hw = np.array(hw, dtype=np.int32).reshape(-1, 2)

    def _index_sidecar(self, side: dict, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """One sidecar's (spans, crc32s) blocks; appends its keys and any new member names."""
        samples = side["samples"]
        for s in samples:
            for name in s["members"]:
                if name not in self._names:
                    self._names.append(name)
        block = np.full((len(samples), len(self._names), 2), -1, dtype=np.int64)
        crc = np.full((len(samples), len(self._names)), -1, dtype=np.int64)  # -1: no checksum recorded
        for j, s in enumerate(samples):
            if not isinstance(s["key"], str):
                raise TypeError(f"sample {j}: key is not a string")
            keys.append(s["key"].encode())
            for name, span in s["members"].items():
                block[j, self._names.index(name)] = [int(span[0]), int(span[1])]
            for name, value in (s.get(CHECKSUMS) or {}).items():
                crc[j, self._names.index(name)] = int(value)
        return block, crc

    @property
    def checksummed(self) -> bool:
        """Whether every member of every sample has a recorded crc32 (caches written before them have none)."""
        return bool((self._crc[self._spans[..., 0] >= 0] >= 0).all())

    def check_consistency(self) -> None:
        """Cheap start-of-run checks (no data read): manifest, sidecars and tars agree on shards, counts and sizes,
        every member lies inside its tar, no key occurs twice. Raises CacheDamaged naming the shard and the repair."""
        d = self.cache_dir
        entries = self.manifest["shards"]
        listed = {f"{shard_stem(i)}.tar" for i in range(len(entries))}
        found = {p.name for p in (d / SHARDS).glob("shard-*.tar")}
        if extra := sorted(found - listed):
            raise CacheDamaged(f"cache {d}: {MANIFEST} lists {len(entries)} shards but {SHARDS}/ also holds "
                               f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}; {REBUILD_MANIFEST}")
        counts = np.bincount(self._shard, minlength=len(entries))
        for i, e in enumerate(entries):
            side, tar = self._sides[i], tar_path(d, i)
            where = f"cache {d}: shard {tar.name}"
            if e["path"] != f"{SHARDS}/{tar.name}":
                raise CacheDamaged(f"cache {d}: {MANIFEST} shards[{i}] is {e['path']!r}, expected "
                                   f"'{SHARDS}/{tar.name}'; {REBUILD_MANIFEST}")
            if not tar.is_file():
                raise CacheDamaged(f"{where} is missing; {repair_hint(d, i)}")
            size = tar.stat().st_size
            if side != (e["num_samples"], e["bytes"], e["sha256"]):
                raise CacheDamaged(f"{where}: its sidecar (count {side[0]}, {side[1]} bytes) does "
                                   f"not match {MANIFEST} ({e['num_samples']}, {e['bytes']} bytes): the shard changed "
                                   f"after the cache was built; {repair_hint(d, i)}")
            if counts[i] != e["num_samples"] or size != e["bytes"]:
                raise CacheDamaged(f"{where}: {counts[i]} samples in the sidecar and {size} bytes on disk, "
                                   f"{MANIFEST} says {e['num_samples']} and {e['bytes']}; {repair_hint(d, i)}")
        if int(counts.sum()) != self.manifest["num_samples"]:
            raise CacheDamaged(f"cache {d}: shards hold {int(counts.sum())} samples, {MANIFEST} says "
                               f"{self.manifest['num_samples']}; {REBUILD_MANIFEST}")
        ends = self._spans[..., 0] + self._spans[..., 1]
        sizes = np.array([e["bytes"] for e in entries], dtype=np.int64)[self._shard]
        bad = (self._spans[..., 0] >= 0) & ((self._spans[..., 1] < 0) | (ends > sizes[:, None]))
        if bad.any():
            j = int(np.argwhere(bad)[0][0])
            raise CacheDamaged(f"cache {d}: shard {tar_path(d, int(self._shard[j])).name}, sample {self.key(j)}: its "
                               f"sidecar places a member outside the tar; {repair_hint(d, int(self._shard[j]))}")
        self._check_unique_keys()

    def _check_unique_keys(self) -> None:
        order = np.argsort(self._keys, kind="stable")
        same = np.flatnonzero(self._keys[order][1:] == self._keys[order][:-1])
        if len(same):
            a, b = int(order[same[0]]), int(order[same[0] + 1])
            sa, sb = int(self._shard[a]), int(self._shard[b])
            d = self.cache_dir
            raise CacheDamaged(f"cache {d}: key {self.key(a)} occurs twice (shards {tar_path(d, sa).name} and "
                               f"{tar_path(d, sb).name}): one shard was replaced by a copy; to repair: delete "
                               f"{sidecar_path(d, sb).name}" + (f" and {sidecar_path(d, sa).name}" if sa != sb else "")
                               + f" in {d / SHARDS} and rerun the precompute command that built this cache "
                               "(it rebuilds those shards alone)")

    def damaged(self, index: int, what: str) -> CacheDamaged:
        """The one-line error for sample `index` whose data is not what the cache says."""
        shard = int(self._shard[index])
        return CacheDamaged(f"cache {self.cache_dir}: shard {tar_path(self.cache_dir, shard).name}, sample "
                            f"{self.key(index)}: {what}; {repair_hint(self.cache_dir, shard)}")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}}

    def __len__(self) -> int:
        return len(self._keys)

    def key(self, index: int) -> str:
        return self._keys[index].decode()

    def keys(self) -> list[str]:
        return [k.decode() for k in self._keys]

    def member_names(self) -> list[str]:
        """Every member name some sample in the cache has."""
        return list(self._names)

    def raw(self, index: int) -> dict[str, bytes]:
        """The sample's wanted members' bytes, each checked against its recorded crc32 (raises CacheDamaged)."""
        shard = int(self._shard[index])
        fd = self._files.get(shard)
        if fd is None:
            try:
                fd = self._files[shard] = os.open(tar_path(self.cache_dir, shard), os.O_RDONLY)
            except OSError as e:
                raise self.damaged(index, f"cannot open the tar ({e.strerror})") from None
        spans = self._spans[index].tolist()
        crcs = self._crc[index].tolist()
        wanted = sorted((*span, name, crc) for name, span, crc in zip(self._names, spans, crcs)
                        if span[0] >= 0 and (self.members is None or name in self.members or name in (CAPTION, META)))
        out = {}
        for run in _runs(wanted, self.READ_GAP):
            lo, hi = run[0][0], run[-1][0] + run[-1][1]
            # pread: no shared file offset, so forked DataLoader workers and threads can share the descriptor
            try:
                data = os.pread(fd, hi - lo, lo)
            except OSError as e:
                raise self.damaged(index, f"cannot read the tar ({e.strerror})") from None
            if len(data) != hi - lo:
                raise self.damaged(index, "the tar ends before this sample (truncated)")
            for offset, size, name, crc in run:
                out[name] = data[offset - lo:offset - lo + size]
                if crc >= 0 and zlib.crc32(out[name]) != crc:
                    raise self.damaged(index, f"member {name} fails its crc32 check (the tar changed after it was "
                                              "written)")
        return out

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


def _runs(spans: list[tuple[int, int, str]], gap: int) -> list[list[tuple[int, int, str]]]:
    """(offset, size, name) sorted by offset -> runs in which each member starts within `gap` of the previous end."""
    runs: list[list[tuple[int, int, str]]] = []
    for span in spans:
        if runs and span[0] - (runs[-1][-1][0] + runs[-1][-1][1]) <= gap:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


def read_errors(cache_dir: Path | str) -> list[dict]:
    path = Path(cache_dir) / ERRORS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
