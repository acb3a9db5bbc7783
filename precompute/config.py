"""The precompute command's config: strict, validated before any model is loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from theworld import images, paths, run_lock
from theworld.cache_format import storage
from theworld.config import ImageConfig, ModelConfig, check_workers, load_config, require_path
from theworld.errors import UserError
from theworld.text import DEFAULT_PROMPT


@dataclass
class SourceConfig:
    type: Literal["synthetic", "folder", "webdataset", "llava", "parquet"] = "synthetic"
    # folder: a directory of images (+ captions.jsonl or same-stem .txt); webdataset: shard files such as
    # /data/datacomp/{00000..00099}.tar or a folder of tars; parquet: files, a glob or a folder (brace expansion and
    # globs allowed, several patterns separated by "::"); llava: the JSON list (chat.json).
    path: str | None = None
    # synthetic: the number of scenes (default 4096); other sources: the first N entries the listing finds usable,
    # in source order (default: all)
    num_samples: int | None = None
    prompt: str = DEFAULT_PROMPT  # used when a sample carries no prompt of its own
    image_root: str | None = None  # llava: the folder image paths are relative to (default: the JSON's folder)
    image_column: str | None = None  # parquet: {bytes, path} struct or bytes (default: image)
    caption_column: str | None = None  # parquet (default: the first of caption, text that exists)
    prompt_column: str | None = None  # parquet (optional; default: `prompt` above)

    def __post_init__(self) -> None:
        only = {
            "image_root": "llava",
            "image_column": "parquet",
            "caption_column": "parquet",
            "prompt_column": "parquet",
        }
        for key, kind in only.items():
            if getattr(self, key) is not None and self.type != kind:
                raise UserError(f"config key 'source.{key}': only used by source.type={kind} (this is {self.type})")


@dataclass
class CacheOptions:
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    siglip: bool = False  # also cache Gemma's multimodal-projector output (the image-token features)
    flip: bool = False  # also cache latents of the horizontally flipped image
    images: bool = True  # keep the original image bytes (needed for live fallback and compare-live/decode)
    latents: Literal["posterior", "mean"] = "posterior"  # mean: the posterior mean alone (half the latent bytes;
    # training with world.latent: sample refuses such a cache)


@dataclass
class PrecomputeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    seed: int = 0  # synthetic scenes are a pure function of (seed, index)
    output_dir: str = "cache/latents"  # the cache directory
    source: SourceConfig = field(default_factory=SourceConfig)
    shard_size: int = 512
    batch_size: int = 32
    num_workers: int = 2
    compile: bool = False  # torch.compile the VAE encoder (GPU; its speed-up and compile time: docs/performance.md)
    cache: CacheOptions = field(default_factory=CacheOptions)
    # an output_dir that is a URL (docs/cache-format.md, "Object storage")
    storage_options: dict = field(default_factory=dict)
    cache_local_dir: str = storage.DEFAULT_LOCAL_DIR
    cache_local_max_gb: float = storage.DEFAULT_MAX_GB

    def __post_init__(self) -> None:
        require_path("output_dir", self.output_dir)
        storage.Settings.of(self).check()
        for key in ("shard_size", "batch_size"):
            if getattr(self, key) <= 0:
                raise UserError(f"config key '{key}': must be positive, got {getattr(self, key)}")
        if self.num_workers < 0:
            raise UserError(f"config key 'num_workers': must be >= 0, got {self.num_workers}")
        check_workers("num_workers", self.num_workers)
        if self.source.type == "synthetic" and self.source.num_samples is None:
            self.source.num_samples = 4096
        if self.source.num_samples is not None and self.source.num_samples <= 0:
            raise UserError(f"config key 'source.num_samples': must be positive, got {self.source.num_samples}")
        if self.source.type == "synthetic" and self.image.resolution**2 > images.MAX_PIXELS:
            raise UserError(
                f"config key 'image.resolution': synthetic scenes are drawn at {self.image.resolution} px, "
                f"over the {images.MAX_PIXELS}-pixel image limit every source is held to (at most "
                f"{math.isqrt(images.MAX_PIXELS) // 8 * 8} with source.type=synthetic)"
            )

    def validate_paths(self) -> None:
        """Checks that touch the filesystem (kept out of __post_init__ so configs can be built anywhere)."""
        if not storage.is_url(self.output_dir):  # a URL's bucket is checked when the run starts
            run_lock.check_folder(self.output_dir)
        if self.source.type == "synthetic":
            return
        if not self.source.path:
            raise UserError(f"config key 'source.path': required for source.type={self.source.type}")
        if self.source.type == "folder":
            _check_path("source.path", self.source.path, folder=True)
        if self.source.type == "llava":
            _check_path("source.path", self.source.path, folder=False)
        if self.source.image_root is not None:
            _check_path("source.image_root", self.source.image_root, folder=True)


def _check_path(key: str, path: str, folder: bool) -> None:
    """A source path that must be a folder (or a file), refused naming what it is instead."""
    p = Path(path)
    try:
        ok, exists = (p.is_dir() if folder else p.is_file()), p.exists()
    except OSError as e:  # a name too long, a symlink loop
        raise UserError(f"config key '{key}': cannot use {path} ({e.strerror})") from None
    if not ok and exists:
        raise UserError(
            f"config key '{key}': {path} is " + ("a file, not a folder" if folder else "a folder, not a file")
        )
    if not ok:
        what = paths.path_kind(p)
        raise UserError(
            f"config key '{key}': {'folder' if folder else 'file'} not found: {path}" + (f" ({what})" if what else "")
        )


def load(path: str | None, overrides: list[str] = ()) -> PrecomputeConfig:
    cfg = load_config(PrecomputeConfig, path, overrides)
    cfg.validate_paths()
    return cfg
