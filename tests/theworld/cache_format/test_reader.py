"""theworld/cache_format/reader.py: batched reads return each member exactly as written."""

from __future__ import annotations

import zlib
from contextlib import closing

import pytest
import torch

from tests._precompute_helpers import (
    encoded_samples,
    flip_byte,
    make_cfg,
    sidecar_json,
    strip_checksums,
)
from theworld import cache_format as cf
from theworld.core.errors import CacheDamaged


def test_load_stacked_matches_safetensors_sample_by_sample():
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        blobs = [
            st_save(
                {
                    "mean": torch.randn(16, 1, 4, 4, generator=g).to(dtype),
                    "logvar": torch.randn(16, 1, 4, 4, generator=g).to(dtype),
                }
            )
            for _ in range(5)
        ]
        # a header that differs (metadata) takes the one-by-one path; the values must not care which
        blobs.append(
            st_save(
                {
                    "mean": torch.randn(16, 1, 4, 4, generator=g).to(dtype),
                    "logvar": torch.randn(16, 1, 4, 4, generator=g).to(dtype),
                },
                metadata={"x": "y"},
            )
        )
        for batch in (blobs[:5], blobs):
            out = cf.load_stacked(batch)
            assert out.keys() == {"mean", "logvar"}
            for k, t in out.items():
                ref = torch.stack([st_load(b)[k] for b in batch])
                assert t.dtype == dtype and t.shape == (len(batch), 16, 1, 4, 4) and torch.equal(t, ref)
    other = st_save({"mean": torch.zeros(16, 1, 2, 2), "logvar": torch.zeros(16, 1, 2, 2)})
    with pytest.raises(ValueError, match="different tensors"):
        cf.load_stacked([blobs[0], other])


def test_reader_returns_each_member_exactly_whatever_reads_are_merged(tmp_path):
    samples = encoded_samples(6)
    sides = [cf.write_shard(tmp_path, i, samples[3 * i : 3 * i + 3]) for i in range(2)]
    cf.write_manifest(
        tmp_path,
        sides,
        fingerprint={},
        latent_shape=[16, 1, 4, 4],
        latent_dtype="float32",
        num_errors=0,
        contents={"images": True},
    )
    for members in (None, (cf.LATENT,)):
        for gap in (-1, 0, 512, 1 << 20):  # never merge, ..., one read per sample
            reader = cf.CacheReader(tmp_path, members=members)
            reader.READ_GAP = gap
            for i, (key, expected) in enumerate(samples):
                want = {k: v for k, v in expected.items() if members is None or k in members + (cf.CAPTION, cf.META)}
                assert reader.key(i) == key and reader.raw(i) == want
            reader.close()


def test_the_writer_records_a_crc32_per_member_and_every_read_checks_it(small_cache):
    side = sidecar_json(small_cache, 1)
    tar = cf.tar_path(small_cache, 1).read_bytes()
    for s in side["samples"]:
        assert s[cf.CHECKSUMS].keys() == s["members"].keys()
        for name, (offset, size) in s["members"].items():
            assert s[cf.CHECKSUMS][name] == zlib.crc32(tar[offset : offset + size])
    reader = cf.CacheReader(small_cache)
    reader.check_consistency()
    assert reader.checksummed and len(reader) == 10
    key = flip_byte(small_cache, 1, 2, cf.LATENT, at=200)  # tensor data: safetensors would load it without complaint
    index = reader.keys().index(key)
    reader.check_consistency()  # same size: only reading the member shows it
    with pytest.raises(CacheDamaged) as e:
        reader.raw(index)
    msg = str(e.value)
    assert "shard-000001.tar" in msg and key in msg and "latent.safetensors" in msg and "crc32" in msg
    assert f"delete {cf.sidecar_path(small_cache, 1)}" in msg and "rerun the precompute command" in msg
    reader.raw(reader.keys().index(sidecar_json(small_cache, 0)["samples"][0]["key"]))  # other shards still read
    # the reader that skips the damaged member does not see it
    with closing(cf.CacheReader(small_cache, members=(cf.CAPTION,))) as captions_only:
        assert captions_only.raw(index)[cf.CAPTION]


def test_a_cache_without_checksums_still_reads(small_cache):
    strip_checksums(small_cache)
    reader = cf.CacheReader(small_cache)
    reader.check_consistency()
    assert not reader.checksummed
    assert all(reader[i].mean is not None for i in range(len(reader)))


def test_undecodable_bytes_in_a_cache_without_checksums_name_shard_and_key(small_cache):
    strip_checksums(small_cache)
    key = sidecar_json(small_cache, 2)["samples"][0]["key"]
    offset, size = sidecar_json(small_cache, 2)["samples"][0]["members"][cf.CAPTION]
    tar = cf.tar_path(small_cache, 2)
    data = bytearray(tar.read_bytes())
    data[offset] = 0xFF  # not UTF-8
    tar.write_bytes(bytes(data))
    reader = cf.CacheReader(small_cache)
    with pytest.raises(CacheDamaged) as e:
        reader.sample(reader.keys().index(key))
    assert "shard-000002.tar" in str(e.value) and key in str(e.value) and "does not decode" in str(e.value)


def test_a_cache_without_per_sample_shapes_reads_as_square(tmp_path, fake_vae):
    """Version-1 caches written before the sidecar recorded latent shapes: every sample has the manifest's."""
    from precompute.pipeline import run
    from theworld import cache_format as cf

    out = tmp_path / "cache"
    run(make_cfg(out, n=10, shard=4))
    for i in range(3):
        side = cf.read_sidecar(out, i)
        for e in side["samples"]:
            del e["latent_shape"]
        cf.atomic_write_json(cf.sidecar_path(out, i), side)
    reader = cf.CacheReader(out)
    assert reader.latent_hw.tolist() == [[4, 4]] * 10
    assert cf.shard_is_done(out, 0)
