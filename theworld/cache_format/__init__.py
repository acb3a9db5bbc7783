"""The latent cache format: the one place that knows it. Writer, reader and inspector use this.

    <cache_dir>/manifest.json            written last, atomically: the cache is complete iff it exists
    <cache_dir>/shards/shard-000000.tar  plain WebDataset shards
    <cache_dir>/shards/shard-000000.json sidecar written after its tar: keys, byte offsets, sha256, count
    <cache_dir>/shard-index/part-000000.safetensors  every shard's and sample's record as arrays, before the manifest
    <cache_dir>/errors.jsonl             one line per input that could not be used
    <cache_dir>/errors/shard-000000.jsonl  per-shard errors, written before the shard's tar, merged at the end
    <cache_dir>/precompute.json          what the cache is being built from: a rerun must match it
    <cache_dir>/source-index/            the webdataset source's per-tar header listings, kept for reruns

`names` holds what everything is called; `layout` the paths and the manifest; `index` the shard index; `writer` the
shard writer; `reader` `CacheReader`; `fingerprint` what a cache was built with and the check against it;
`migrations` the format versions and how older ones read.
Callers use the package: `from theworld import cache_format as cf; cf.CacheReader(...)`.

docs/cache-format.md describes the same for readers without this code; keep the two in step.
"""

from safetensors.torch import load as st_load  # the batch collate decodes members with it

from theworld.cache_format import storage
from theworld.cache_format.fingerprint import (
    check_fingerprint,
    fingerprint_diff,
    fingerprint_for,
    fingerprint_overrides,
)
from theworld.cache_format.index import SHARDS_PER_INDEX
from theworld.cache_format.layout import (
    REBUILD_MANIFEST,
    Sample,
    atomic_write_bytes,
    atomic_write_json,
    error_classes,
    error_path,
    image_bytes_hint,
    latent_shape_counts,
    latents_stored,
    load_manifest,
    member_name,
    read_errors,
    read_sidecar,
    repair_hint,
    safe_key,
    sha256_file,
    shard_is_done,
    shard_stem,
    shard_table,
    sidecar_path,
    split_member,
    tar_path,
    write_manifest,
)
from theworld.cache_format.migrations import CHECKSUMS, FORMAT_VERSION
from theworld.cache_format.names import (
    CAPTION,
    ERRORS,
    ERRORS_DIR,
    IMAGE,
    INDEX_DIR,
    LATENT,
    LATENT_FLIP,
    MANIFEST,
    META,
    RUN_FILE,
    SHARDS,
    SIGLIP,
    TURNS,
)
from theworld.cache_format.reader import CacheReader, decode_sample, load_stacked
from theworld.cache_format.storage import RemoteCache, Settings, is_url, open_cache
from theworld.cache_format.writer import encode_sample, latent_blob, latent_shape_of, write_shard
from theworld.model.encoders import DTYPES  # the cache dtypes: `cache.dtype` names a key of it
