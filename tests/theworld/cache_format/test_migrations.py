"""Caches of format_versions 1 and 2 read as the current version (theworld/cache_format/migrations.py); a version
this code does not know is one line naming it."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from precompute import inspect
from tests.theworld.cache_format.conftest import as_format_3
from theworld import cache_format as cf
from theworld.cache_format import migrations
from theworld.core.errors import CacheDamaged, UserError


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
    as_format_3(cache)
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
    assert cf.FORMAT_VERSION == 4 and cf.read_sidecar(tmp_path, 0)["format_version"] == 4
    m = cf.load_manifest(tmp_path)
    assert m["format_version"] == 4 and "written_as" not in m and not cf.layout.read_from_list(m)


def test_a_version_1_cache_reads_as_the_current_one(tmp_path):
    samples = _cache(tmp_path)
    _as_version_1(tmp_path)
    m = cf.load_manifest(tmp_path)
    assert (m["format_version"], m["written_as"], m["fingerprint"]["format_version"]) == (4, 1, 4)
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


@pytest.mark.parametrize("version", [0, 5, "2", None])
def test_an_unknown_version_is_refused_naming_it(tmp_path, version):
    _cache(tmp_path)
    m = json.loads((tmp_path / cf.MANIFEST).read_text())
    m["format_version"] = version
    cf.atomic_write_json(tmp_path / cf.MANIFEST, m)
    with pytest.raises(UserError, match=f"format_version {version!r}, this code reads 1, 2, 3 and 4"):
        cf.load_manifest(tmp_path)


def test_only_current_shards_count_as_done_for_precompute(tmp_path):
    """A rerun of precompute rebuilds a version-1 shard rather than mixing versions in one cache."""
    _cache(tmp_path)
    assert cf.shard_is_done(tmp_path, 0)
    _as_version_1(tmp_path)
    assert not cf.shard_is_done(tmp_path, 0)
    assert migrations.READABLE == (1, 2, 3, 4)


# A cache written by the format-2 code (commit 05a2319): `python -m precompute.cosmos_latents --config
# configs/precompute.yaml --set source.type=folder --set source.path=SRC --set source.num_samples=null --set
# shard_size=3 --set image.resolution=32 --set cache.siglip=false --set model.dtype=float32 --set cache.dtype=float32`
# over six images im0..im5 saved as jpg, png, webp in turn; its image members are named jpg / png / webp.
FORMAT_2 = Path(__file__).resolve().parents[2] / "data" / "cache_v2"


def _tar_members(cache: Path) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for tar in sorted((cache / "shards").glob("*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf:
                key, member = cf.split_member(m.name)
                out.setdefault(key, {})[member] = tf.extractfile(m).read()
    return out


def test_a_format_2_cache_reads_with_one_image_member(tmp_path):
    cache = shutil.copytree(FORMAT_2, tmp_path / "c")
    stored = _tar_members(cache)
    assert {k: sorted(set(v) & {"jpg", "png", "webp"}) for k, v in stored.items()} == {
        f"im{i}_{ext}": [ext] for i, ext in enumerate(["jpg", "png", "webp"] * 2)
    }
    m = cf.load_manifest(cache)
    assert (m["format_version"], m["written_as"]) == (4, 2)
    reader = cf.CacheReader(cache)
    assert sorted(reader.member_names()) == sorted([cf.CAPTION, cf.META, cf.LATENT, cf.IMAGE]) and reader.checksummed
    for i in range(len(reader)):
        key = reader.key(i)
        ext = key.rsplit("_", 1)[1]
        s = reader.sample(i)
        assert s.image == stored[key][ext] and cf.image_bytes_hint(s.image) == ext
        assert reader.raw(i)[cf.LATENT] == stored[key][cf.LATENT]
    # only the image when asked for it (a live-encoding run's reader), checked against its crc32
    images_only = cf.CacheReader(cache, members=(cf.IMAGE,))
    assert set(images_only.raw(4)) == {cf.CAPTION, cf.META, cf.IMAGE}
    assert inspect.main(["verify", str(cache)]) == 0


def test_a_format_2_cache_with_a_changed_image_fails_verify_naming_the_member(tmp_path, capsys):
    cache = shutil.copytree(FORMAT_2, tmp_path / "c")
    offset, _ = cf.read_sidecar(cache, 0)["samples"][1]["members"]["png"]
    tar = cf.tar_path(cache, 0)
    data = bytearray(tar.read_bytes())
    data[offset + 20] ^= 0xFF
    tar.write_bytes(bytes(data))
    assert inspect.main(["verify", str(cache)]) == 1
    assert "im1_png: image fails its crc32 check" in capsys.readouterr().out
    with pytest.raises(CacheDamaged, match="member image fails its crc32 check"):
        cf.CacheReader(cache).raw(1)


def test_a_run_encoding_live_reads_a_format_2_caches_images(tmp_path):
    """freeze.vae: false encodes the stored images live: those of a format-2 cache are found under their old names."""
    from tests.conftest import base_args
    from train.loop import main

    cache = shutil.copytree(FORMAT_2, tmp_path / "c")
    small = {"freeze.vae": "false", "image.resolution": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2}
    assert main(base_args(cache, tmp_path / "run", steps=2, **small, **{"train.eval.samples": 2})) == 0
    assert (tmp_path / "run" / "final" / "trainable.safetensors").is_file()
