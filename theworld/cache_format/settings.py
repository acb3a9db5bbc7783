"""The `storage:` config section that precompute and training share: where a node keeps what it reads from a cache at a
URL, and how training reads it (theworld/cache_format/storage.py does the reading and writing). A module of its own
so that the configs are checked before torch loads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from theworld.core.errors import UserError
from theworld.core.location import is_url

DEFAULT_LOCAL_DIR = "~/.cache/theworld/object-store"
DEFAULT_MAX_GB = 100.0


# The section's keys as the top-level keys of earlier releases named them (read through the config's moved keys)
MOVED = {
    "storage_options": "storage.options",
    "cache_local_dir": "storage.local_dir",
    "cache_local_max_gb": "storage.local_max_gb",
    "cache_prefetch_shards": "storage.prefetch_shards",
    "cache_shuffle_window": "storage.shuffle_window",
}
# how training reads a cache; precompute leaves them unset
READING_KEYS = ("prefetch_shards", "shuffle_window", "node_groups")


@dataclass
class Settings:
    """The `storage:` config section of both commands (precompute's and training's): a cache at a URL and this
    node's shard cache (docs/cache-format.md, "Object storage")."""

    options: dict = field(default_factory=dict)  # passed to the fsspec filesystem
    local_dir: str = DEFAULT_LOCAL_DIR  # per node: stand-in folders and the shard cache
    local_max_gb: float = DEFAULT_MAX_GB  # the shard cache's bound
    prefetch_shards: int = 2  # training: shards each loader worker downloads ahead of the one it reads
    # training: shards per shuffle window (train/data/order.py): 0 is one global order, which suits a cache that fits
    # the node's shard cache; a larger cache reads W shards at a time and is downloaded about once per epoch
    shuffle_window: int = 0
    # training, with shuffle_window: each global batch is this many equal parts, each from its own shards of the
    # window, so N nodes dividing it each download 1/N of the cache per epoch; the order depends on it, not on N
    node_groups: int = 1

    def __post_init__(self) -> None:  # what the config loader cannot check by type
        if not self.local_max_gb > 0:
            raise UserError(f"config key 'storage.local_max_gb': must be positive, got {self.local_max_gb}")
        if not self.local_dir.strip():
            raise UserError("config key 'storage.local_dir': empty; give a folder path")
        if is_url(self.local_dir):
            raise UserError(f"config key 'storage.local_dir': {self.local_dir} is a URL; give a local folder")
        for key in READING_KEYS:
            if getattr(self, key) < 0:
                raise UserError(f"config key 'storage.{key}': must be >= 0, got {getattr(self, key)}")
        if self.node_groups < 1:
            raise UserError(f"config key 'storage.node_groups': must be >= 1, got {self.node_groups}")
        if self.node_groups > 1 and (not self.shuffle_window or self.shuffle_window % self.node_groups):
            raise UserError(
                f"config key 'storage.node_groups': {self.node_groups} splits each window's shards between the "
                f"nodes, so storage.shuffle_window ({self.shuffle_window}) must be a positive multiple of it"
            )

    @property
    def folder(self) -> Path:
        return Path(os.path.expanduser(self.local_dir))

    @property
    def budget(self) -> float:
        """The shard cache's bound in bytes, as a float: any finite local_max_gb, however large, compares as it is."""
        return self.local_max_gb * 1e9
