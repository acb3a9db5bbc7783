"""Writing a cache: a sample's members as bytes (`encode_sample`, `latent_blob`) and a shard's reproducible tar plus
its sidecar (`write_shard`)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from theworld.cache_format.layout import (
    Sample,
    atomic_write_json,
    member_name,
    sha256_file,
    sidecar_path,
    tar_path,
)
from theworld.cache_format.migrations import CHECKSUMS, FORMAT_VERSION
from theworld.cache_format.names import CAPTION, IMAGE, LATENT, LATENT_FLIP, META, SIGLIP, TURNS
from theworld.core import atomic
from theworld.model.control_text import TEXT_RULE, find_control_string
from theworld.model.encoders import DTYPES


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
        out[IMAGE] = s.image
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
    return list(json.loads(blob[8 : 8 + n])["mean"]["shape"])


def text_passes(members: dict[str, bytes]) -> bool:
    """Whether a sample's texts (caption, prompt, a conversation's later turns) hold no Gemma control string (the rule
    a sidecar's `text_rule` names)."""
    try:
        caption, meta = members[CAPTION].decode(), json.loads(members[META])
    except (KeyError, ValueError, RecursionError):
        return False
    if not isinstance(meta, dict):
        return find_control_string(caption) is None
    texts = [caption, meta.get("prompt", "")] + [t for turn in meta.get(TURNS, ()) for t in turn]
    return all(isinstance(t, str) and find_control_string(t) is None for t in texts)


def write_shard(cache_dir: Path, index: int, samples: Iterable[tuple[str, dict[str, bytes]]]) -> dict:
    """Write shard `index` from (key, members) pairs: tar to a temporary name, rename, then its sidecar. The sidecar
    records `text_rule` when every sample's caption and prompt pass it (`text_passes`), so a reader need not check
    them again.

    Returns the sidecar. The tar is byte-for-byte reproducible (fixed mtime, owner, member order), so the same
    samples give the same sha256 whichever process or rerun writes them. Member offsets are taken from tarfile's own
    position while writing (no second pass over the tar: this runs on the writer thread beside the encoder).
    """
    tar = tar_path(cache_dir, index)
    tar.parent.mkdir(parents=True, exist_ok=True)
    entries = []
    clean = True
    with atomic.file(tar, fsync=False) as tmp:  # fsynced here, before its sha256 is taken
        with open(tmp, "wb") as f:
            with tarfile.open(fileobj=f, mode="w") as tf:
                for key, members in samples:
                    entry = {"key": key, "members": {}, CHECKSUMS: {}}
                    clean = clean and text_passes(members)
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
        side = {
            "format_version": FORMAT_VERSION,
            "shard": tar.name,
            "count": len(entries),
            "bytes": os.path.getsize(tmp),
            "sha256": sha256_file(tmp),
            **({"text_rule": TEXT_RULE} if clean else {}),
            "samples": entries,
        }
    atomic_write_json(sidecar_path(cache_dir, index), side)
    return side
