"""theworld/cache_format/writer.py: sidecar offsets match what tarfile, webdataset and datasets read back; bytes are
reproducible."""

from __future__ import annotations

import tarfile

import torch

from tests._precompute_helpers import encoded_samples
from theworld import cache_format as cf


def test_sidecar_offsets_match_tarfile_and_webdataset(tmp_path):
    import webdataset as wds

    for long_key in (False, True):
        samples = encoded_samples(5, long_key)
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
    a = cf.write_shard(tmp_path / "a", 3, encoded_samples(4))
    b = cf.write_shard(tmp_path / "b", 3, encoded_samples(4))
    assert a["sha256"] == b["sha256"] and a["samples"] == b["samples"]


def test_datasets_webdataset_loads_a_cache_of_mixed_image_formats(tmp_path, fake_vae):
    """Hugging Face `datasets` infers one schema from a cache's first samples and refuses samples whose member names
    differ: every sample keeps its original image bytes under the one member `image`, whatever the format."""
    import datasets
    from PIL import Image

    from precompute import pipeline
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
    pipeline.run(make_cfg(out, "source.type=folder", f"source.path={src}", "cache.flip=true", shard=3))
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
