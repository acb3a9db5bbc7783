"""The precompute command's config: strict, validated before any model is loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from theworld.cache_format.settings import MOVED as STORAGE_MOVED
from theworld.cache_format.settings import READING_KEYS, Settings
from theworld.core import compat, location, paths, run_lock
from theworld.core.config import at_least, check_sizes, check_workers, load_config, require_path
from theworld.core.errors import UserError
from theworld.model import images
from theworld.model.config import DEFAULT_PROMPT, ImageConfig, ModelConfig, WorldSteps


@dataclass
class Img2datasetOptions:
    """source.type=urls: img2dataset's own download options, by its names (img2dataset.download); the rest it is
    called with is set by the source (input and output format, columns, staging folder, incremental mode)."""

    processes_count: int = 1  # download processes (each with thread_count threads)
    thread_count: int = 64
    timeout: int = 10  # seconds per request
    retries: int = 0
    number_sample_per_shard: int = 10000  # rows per staged shard (and per img2dataset task)
    min_image_size: int = 0  # smaller images (shorter side, px) are refused: "failed_to_resize: image too small"
    # "no": the image as served (its bytes kept when they are encode_format already); the others make img2dataset
    # resize to image_size first (smaller staging folder, one more resize)
    resize_mode: Literal["no", "keep_ratio", "keep_ratio_largest", "center_crop", "border"] = "no"
    image_size: int = 512
    encode_format: Literal["jpg", "png", "webp"] = "jpg"  # images not already in it are re-encoded to it
    user_agent_token: str | None = None  # added to the User-Agent (sites' X-Robots-Tag opt-outs are honoured)

    def __post_init__(self) -> None:
        keys = ("processes_count", "thread_count", "timeout", "number_sample_per_shard", "image_size")
        at_least(self, "source.img2dataset", 1, *keys)
        at_least(self, "source.img2dataset", 0, "retries", "min_image_size")


@dataclass
class SourceConfig:
    type: Literal["synthetic", "folder", "webdataset", "llava", "parquet", "urls", "hf"] = "synthetic"
    # folder: a directory of images (+ captions.jsonl or same-stem .txt); webdataset: shard files such as
    # /data/datacomp/{00000..00099}.tar or a folder of tars; parquet: files, a glob or a folder (brace expansion and
    # globs allowed, several patterns separated by "::"); llava: the JSON list (chat.json); urls: url + caption
    # tables, .parquet or .jsonl (a file, a glob or a folder, as parquet).
    path: str | None = None
    # synthetic: the number of scenes (default 4096); urls: the first N rows of the table (whether a row is usable
    # is known only once downloaded; with --plan, a number over the table's rows extrapolates the plan to a table of
    # that size); other sources: the first N entries the listing finds usable, in source order (default: all)
    num_samples: int | None = None
    prompt: str = DEFAULT_PROMPT  # used when a sample carries no prompt of its own
    image_root: str | None = None  # llava: the folder image paths are relative to (default: the JSON's folder)
    image_column: str | None = None  # parquet, hf: {bytes, path} struct or bytes (default: image)
    # parquet, hf (default: the first of caption, text that exists); urls (default: the first of text, TEXT,
    # caption: DataComp's and LAION's names)
    caption_column: str | None = None
    prompt_column: str | None = None  # parquet, hf (optional; default: `prompt` above)
    url_column: str | None = None  # urls (default: the first of url, URL)
    id_column: str | None = None  # urls (default: the first of uid, key, id, SAMPLE_ID; none: "<file stem>-<row>")
    staging_dir: str | None = None  # urls: where img2dataset's shards go (default: <output_dir>/staging)
    name: str | None = None  # hf: a Hub dataset id (user/dataset), read through datasets.load_dataset
    split: str | None = None  # hf (default: train)
    streaming: bool | None = None  # hf: read through datasets' streaming iterator (default: false)
    img2dataset: Img2datasetOptions = field(default_factory=Img2datasetOptions)  # urls: download options

    def __post_init__(self) -> None:
        only = {
            "image_root": ("llava",),
            "image_column": ("parquet", "hf"),
            "caption_column": ("parquet", "urls", "hf"),
            "prompt_column": ("parquet", "hf"),
            "name": ("hf",),
            "split": ("hf",),
            "streaming": ("hf",),
            "url_column": ("urls",),
            "id_column": ("urls",),
            "staging_dir": ("urls",),
        }
        for key, kinds in only.items():
            if getattr(self, key) is not None and self.type not in kinds:
                raise UserError(
                    f"config key 'source.{key}': only used by source.type={'|'.join(kinds)} (this is {self.type})"
                )


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
    MOVED: ClassVar[dict[str, compat.Move]] = compat.moves(5, STORAGE_MOVED)  # earlier releases' keys, still read

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
    world: WorldSteps = field(default_factory=WorldSteps)  # rollouts: seeded by (seed, sample key)
    storage: Settings = field(default_factory=Settings)  # an output_dir that is a URL; the shard cache

    def __post_init__(self) -> None:
        require_path("output_dir", self.output_dir)
        for key in READING_KEYS:  # training's: a precompute writes every shard once
            if getattr(self.storage, key) != getattr(Settings, key):
                raise UserError(f"config key 'storage.{key}': only read by training (train.loop); leave it out here")
        for key in ("shard_size", "batch_size"):
            if getattr(self, key) <= 0:
                raise UserError(f"config key '{key}': must be positive, got {getattr(self, key)}")
        if self.num_workers < 0:
            raise UserError(f"config key 'num_workers': must be >= 0, got {self.num_workers}")
        check_sizes(self)
        check_workers("num_workers", self.num_workers)
        from theworld.model.rollout import check_settings  # (imports torch: not at this module's top)

        check_settings(self.world.num_world_steps, self.world.rollout, self.image.resolution)
        if self.world.num_world_steps and self.cache.flip:
            raise UserError(
                "config key 'cache.flip': not with world.num_world_steps > 0 (a flipped image's rollout is not "
                "cached): set cache.flip: false or world.num_world_steps: 0"
            )
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
        out = location.place(self.output_dir, "config key 'output_dir':")  # a URL's bucket: when the run starts
        if isinstance(out, location.Local):
            run_lock.check_folder(self.output_dir)
        if self.source.type == "synthetic":
            return
        if self.source.type == "hf":
            if not self.source.name or self.source.path:
                raise UserError(
                    "config key 'source.name': source.type=hf reads a Hub dataset id (source.name: user/dataset), "
                    + ("not source.path" if self.source.path else "and none is set")
                )
            return
        if not self.source.path:
            raise UserError(f"config key 'source.path': required for source.type={self.source.type}")
        if self.source.type == "folder":
            _check_path("source.path", self.source.path, folder=True)
        if self.source.type == "llava":
            _check_path("source.path", self.source.path, folder=False)
        if self.source.staging_dir is not None:
            require_path("source.staging_dir", self.source.staging_dir)
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
