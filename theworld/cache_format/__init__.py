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

import importlib
from typing import Any

# Each name, with the module that holds it: imported on first use, so that a module needing one light fact of the
# format (the training config's storage keys, read before anything heavy loads) does not import torch through the
# reader and the writer.
_HOLDERS = {
    "fingerprint": "check_fingerprint fingerprint_diff fingerprint_for fingerprint_overrides",
    "index": "PART_SAMPLES",
    "layout": (
        "REBUILD_MANIFEST Sample atomic_write_bytes atomic_write_json error_classes error_path image_bytes_hint "
        "latent_shape_counts latents_stored load_manifest member_name read_errors read_sidecar repair_hint safe_key "
        "sha256_file shard_is_done shard_stem shard_table sidecar_path split_member tar_path write_manifest"
    ),
    "migrations": "CHECKSUMS FORMAT_VERSION",
    "names": "CAPTION ERRORS ERRORS_DIR IMAGE INDEX_DIR LATENT LATENT_FLIP MANIFEST META RUN_FILE SHARDS SIGLIP TURNS",
    "reader": "CacheReader decode_sample load_stacked",
    "settings": "Settings",
    "storage": "RemoteCache is_url open_cache",
    "writer": "encode_sample latent_blob latent_shape_of write_shard",
}
_EXPORTS = {name: (f"{__name__}.{module}", name) for module, names in _HOLDERS.items() for name in names.split()}
_EXPORTS["st_load"] = ("safetensors.torch", "load")  # the batch collate decodes members with it
_EXPORTS["DTYPES"] = ("theworld.model.encoders", "DTYPES")  # the cache dtypes: `cache.dtype` names a key of it
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """A name of the format (`cf.CacheReader`) or one of its modules (`cf.storage`), imported on first use."""
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attr)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
