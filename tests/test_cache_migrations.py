"""Caches of format_version 1 read as the current version (theworld/cache_format/migrations.py); a version this code
does not know is one line naming it."""

from __future__ import annotations

import json

import pytest
import torch

from theworld import cache_format as cf
from theworld.cache_format import migrations
from theworld.errors import UserError


def _cache(tmp_path, n: int = 6):
    """A two-shard cache as the writer makes it, then its manifest."""
    g = torch.Generator().manual_seed(0)
    samples = [
        (
            f"s{i:04d}",
            cf.encode_sample(
                cf.Sample(
                    key=f"s{i:04d}",
                    caption=f"caption {i}",
                    meta={"prompt": "p"},
                    mean=torch.randn(16, 1, 4, 4, generator=g),
                    logvar=torch.randn(16, 1, 4, 4, generator=g),
                ),
                "float32",
            ),
        )
        for i in range(n)
    ]
    sides = [cf.write_shard(tmp_path, 0, samples[: n // 2]), cf.write_shard(tmp_path, 1, samples[n // 2 :])]
    fp = {"format_version": cf.FORMAT_VERSION, "vae": {"model": "tiny", "dtype": "float32"}}
    cf.write_manifest(
        tmp_path,
        sides,
        fingerprint=fp,
        latent_shape=[16, 1, 4, 4],
        latent_dtype="float32",
        num_errors=0,
        contents={"images": False, "siglip": False, "flip": False, "latents": "posterior"},
    )
    return samples


def _as_version_1(cache) -> None:
    """What a version-1 cache could look like: no per-sample shapes or checksums, no contents.latents."""
    m = json.loads((cache / cf.MANIFEST).read_text())
    m["format_version"] = m["fingerprint"]["format_version"] = 1
    del m["contents"]["latents"]
    cf.atomic_write_json(cache / cf.MANIFEST, m)
    for i in range(2):
        side = cf.read_sidecar(cache, i)
        side["format_version"] = 1
        for s in side["samples"]:
            del s["latent_shape"], s[cf.CHECKSUMS]
        cf.atomic_write_json(cf.sidecar_path(cache, i), side)


def test_the_writer_writes_the_current_version(tmp_path):
    _cache(tmp_path)
    assert cf.FORMAT_VERSION == 2 and cf.read_sidecar(tmp_path, 0)["format_version"] == 2
    m = cf.load_manifest(tmp_path)
    assert m["format_version"] == 2 and "written_as" not in m


def test_a_version_1_cache_reads_as_the_current_one(tmp_path):
    samples = _cache(tmp_path)
    _as_version_1(tmp_path)
    m = cf.load_manifest(tmp_path)
    assert (m["format_version"], m["written_as"], m["fingerprint"]["format_version"]) == (2, 1, 2)
    assert cf.latents_stored(m) == "posterior"
    reader = cf.CacheReader(tmp_path)
    assert reader.latent_hw.tolist() == [[4, 4]] * 6 and not reader.checksummed
    for i, (key, members) in enumerate(samples):
        assert reader.key(i) == key and reader.raw(i)[cf.LATENT] == members[cf.LATENT]
    # the fingerprint check a training run makes: a version-1 cache matches the current config
    cf.check_fingerprint(m["fingerprint"], {"format_version": cf.FORMAT_VERSION}, tmp_path, fields=["format_version"])


def test_a_version_1_cache_without_a_common_shape_names_what_it_lacks(tmp_path):
    _cache(tmp_path)
    _as_version_1(tmp_path)
    m = json.loads((tmp_path / cf.MANIFEST).read_text())
    m["latent_shape"] = None
    cf.atomic_write_json(tmp_path / cf.MANIFEST, m)
    with pytest.raises(UserError, match="lacks per-sample latent shapes"):
        cf.CacheReader(tmp_path)


@pytest.mark.parametrize("version", [0, 3, "2", None])
def test_an_unknown_version_is_refused_naming_it(tmp_path, version):
    _cache(tmp_path)
    m = json.loads((tmp_path / cf.MANIFEST).read_text())
    m["format_version"] = version
    cf.atomic_write_json(tmp_path / cf.MANIFEST, m)
    with pytest.raises(UserError, match=f"format_version {version!r}, this code reads 1 and 2"):
        cf.load_manifest(tmp_path)


def test_only_current_shards_count_as_done_for_precompute(tmp_path):
    """A rerun of precompute rebuilds a version-1 shard rather than mixing versions in one cache."""
    _cache(tmp_path)
    assert cf.shard_is_done(tmp_path, 0)
    _as_version_1(tmp_path)
    assert not cf.shard_is_done(tmp_path, 0)
    assert migrations.READABLE == (1, 2)
