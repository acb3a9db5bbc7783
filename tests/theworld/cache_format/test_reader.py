"""theworld/cache_format/reader.py: batched reads return each member exactly as written."""

from __future__ import annotations

import pytest
import torch

from tests._precompute_helpers import encoded_samples
from theworld import cache_format as cf


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
