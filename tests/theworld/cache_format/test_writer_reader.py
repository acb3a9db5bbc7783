"""Shard writing: sidecar offsets match what tarfile and webdataset read back; bytes are reproducible. Fingerprints."""

from __future__ import annotations

import tarfile

import pytest
import torch

from theworld import cache_format as cf


def _samples(n: int, long_key: bool = False):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        key = f"{'k' * 150}-{i}" if long_key else f"s{i:04d}"  # a key too long for a plain ustar name
        s = cf.Sample(
            key=key,
            caption=f"caption {i}",
            meta={"prompt": "p", "i": i},
            mean=torch.randn(16, 1, 4, 4, generator=g),
            logvar=torch.randn(16, 1, 4, 4, generator=g),
            image=b"\x89PNG\r\n\x1a\n" + bytes(range(i % 7 + 1)),
        )
        out.append((key, cf.encode_sample(s, "float32")))
    return out


def test_sidecar_offsets_match_tarfile_and_webdataset(tmp_path):
    import webdataset as wds

    for long_key in (False, True):
        samples = _samples(5, long_key)
        side = cf.write_shard(tmp_path / str(long_key), 0, samples)
        tar = cf.tar_path(tmp_path / str(long_key), 0)
        with tarfile.open(tar) as tf:
            read = {m.name: (m.offset_data, m.size) for m in tf if m.isfile()}
        assert side["count"] == 5 and side["sha256"] == cf.sha256_file(tar) and side["bytes"] == tar.stat().st_size
        for (key, members), entry in zip(samples, side["samples"]):
            assert entry["key"] == key
            for name, (offset, size) in entry["members"].items():
                assert read[f"{key}.{name}"] == (offset, size)
                assert tar.read_bytes()[offset : offset + size] == members[name]
        ds = wds.WebDataset(str(tar), shardshuffle=False, nodesplitter=wds.split_by_node)
        assert [s["__key__"] for s in ds] == [k for k, _ in samples]
        assert cf.shard_is_done(tmp_path / str(long_key), 0, expected_count=5)


def test_shards_are_byte_reproducible(tmp_path):
    a = cf.write_shard(tmp_path / "a", 3, _samples(4))
    b = cf.write_shard(tmp_path / "b", 3, _samples(4))
    assert a["sha256"] == b["sha256"] and a["samples"] == b["samples"]


def test_load_stacked_matches_safetensors_sample_by_sample():
    import pytest
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
    samples = _samples(6)
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


def test_siglip_fingerprint_covers_the_image_processor_settings():
    from theworld.model import encoders
    from theworld.model.config import ImageConfig, ModelConfig

    gemma, processor = encoders.load_gemma("tiny", "float32")
    vae = encoders.load_vae("tiny", "float32")

    def fp():
        return cf.fingerprint_for(
            ModelConfig(gemma="tiny", vae="tiny", dtype="float32"),
            ImageConfig(resolution=64, resize="crop"),
            siglip=True,
            vae=vae,
            gemma=gemma,
            processor=processor,
        )

    before = fp()
    assert before == fp()
    processor.image_processor.image_mean = [0.0, 0.0, 0.0]  # what the vision tower sees changes
    assert cf.fingerprint_diff(before, fp()) == ["siglip.image_processor"]


@pytest.mark.parametrize("resize,siglip", [("crop", False), ("bucket", True)])
def test_the_config_fingerprint_is_the_full_one_cut_to_the_config_values(resize, siglip, tmp_path):
    """fingerprint_for without models (checked before anything loads) agrees with the full one wherever it has a
    field, and fingerprint_overrides maps a cache's fingerprint back to a config giving the same values."""
    from precompute.config import PrecomputeConfig
    from theworld.core.config import load_config
    from theworld.core.errors import CacheMismatch
    from theworld.model import encoders
    from theworld.model.config import ImageConfig, ModelConfig

    model, image = ModelConfig(gemma="tiny", vae="tiny", dtype="float32"), ImageConfig(resolution=128, resize=resize)
    gemma, processor = encoders.load_gemma("tiny", "float32") if siglip else (None, None)
    full = cf.fingerprint_for(
        model, image, siglip=siglip, vae=encoders.load_vae("tiny", "float32"), gemma=gemma, processor=processor
    )
    cheap = cf.fingerprint_for(model, image, siglip=siglip)
    assert cheap == {
        "format_version": cf.FORMAT_VERSION,
        "vae": {"model": "tiny", "dtype": "float32"},
        "image": {"resolution": 128, "resize": resize},
        "siglip": {"model": "tiny"} if siglip else None,
    }
    cf.check_fingerprint(full, cheap, tmp_path, partial=True)
    with pytest.raises(CacheMismatch, match="different image.resolution: cache has 128, this config gives 64"):
        cf.check_fingerprint(
            full,
            cf.fingerprint_for(model, ImageConfig(resolution=64, resize=resize), siglip=siglip),
            tmp_path,
            partial=True,
        )
    with pytest.raises(CacheMismatch, match=r"different image\.(buckets|normalisation)"):  # the full check: every field
        cf.check_fingerprint(full, cheap, tmp_path)
    cfg = load_config(PrecomputeConfig, None, cf.fingerprint_overrides(full))
    assert cf.fingerprint_for(cfg.model, cfg.image, siglip=cfg.cache.siglip) == cheap


def test_datasets_webdataset_loads_a_cache_of_mixed_image_formats(tmp_path, fake_vae):
    """Hugging Face `datasets` infers one schema from a cache's first samples and refuses samples whose member names
    differ: every sample keeps its original image bytes under the one member `image`, whatever the format."""
    import datasets
    from PIL import Image

    from precompute import cosmos_latents
    from tests._precompute_helpers import make_cfg

    src = tmp_path / "src"
    src.mkdir()
    sizes, lines = {}, []
    for i, fmt in enumerate(["jpg", "png", "webp", "bmp", "png", "jpg", "webp"]):
        name = f"im{i}.{fmt}"
        Image.new("RGB", (40 + 4 * i, 36), (30 * i, 90, 200)).save(src / name)
        sizes[cf.safe_key(name)] = (40 + 4 * i, 36)
        lines.append(f'{{"image": "{name}", "caption": "picture {i}"}}')
    (src / "captions.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "c"
    cosmos_latents.run(make_cfg(out, "source.type=folder", f"source.path={src}", "cache.flip=true", shard=3))
    tars = [str(out / s["path"]) for s in cf.shard_table(out, cf.load_manifest(out)).entries()]
    ds = datasets.load_dataset("webdataset", data_files={"train": tars}, split="train", cache_dir=str(tmp_path / "hf"))
    reader = cf.CacheReader(out)
    assert ds.num_rows == len(reader) == 7
    assert set(ds.column_names) == {"__key__", "__url__", "image", "json", "latent.safetensors",
                                    "latent_flip.safetensors", "txt"}  # fmt: skip
    for i, row in enumerate(ds):
        s = reader.sample(i)
        assert row["__key__"] == s.key and row["txt"] == s.caption and row["json"]["crop_box"] == s.meta["crop_box"]
        assert row["image"] == s.image  # the original file's bytes (bmp: kept as PNG)
        assert torch.equal(cf.st_load(row["latent.safetensors"])["mean"], s.mean)
    decoded = ds.cast_column("image", datasets.Image())
    assert [img.size for img in decoded["image"]] == [sizes[k] for k in ds["__key__"]]
    assert [cf.image_bytes_hint(b) for b in ds["image"]] == ["jpg", "png", "webp", "png", "png", "jpg", "webp"]
