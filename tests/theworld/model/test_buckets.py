"""Aspect-ratio buckets: the bucket set, the choice and the resize, a bucketed cache end to end (fake VAE), the
trainer's single-bucket batches, mean-only caches."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests._precompute_helpers import BUCKET_SIZES, bucket_folder, gradient, jpeg_bytes, make_cfg

# ----------------------------------------------------------------------------------------------------------------------
# The bucket set and the choice


@pytest.mark.parametrize("res", [128, 256, 512, 1024])
def test_bucket_set_shapes(res):
    from theworld.model.images import BUCKET_STEP, buckets

    bs = buckets(res)
    assert BUCKET_STEP == 32 and (res, res) in bs and len(set(bs)) == len(bs)
    for w, h in bs:
        assert w % 32 == 0 and h % 32 == 0  # every world.pool (1, 2, 4) divides the (h/8, w/8) latent grid
        assert abs(w * h - res * res) <= max(w, h) * 32 / 2  # the generation rule's bound
        assert max(w, h) / min(w, h) <= 2.0
        assert (h, w) in bs
    ratios = [w / h for w, h in bs]
    assert ratios == sorted(ratios) and len(set(ratios)) == len(ratios)


def test_buckets_at_512_are_the_documented_ones_within_4_percent_of_the_area():
    from theworld.model.images import buckets

    landscape = [(512, 512), (544, 480), (576, 448), (608, 416), (640, 416), (672, 384), (704, 384)]
    assert buckets(512) == tuple(sorted({*landscape, *((h, w) for w, h in landscape)}, key=lambda b: b[0] / b[1]))
    assert all(abs(w * h / 512**2 - 1) < 0.04 for w, h in buckets(512))


@pytest.mark.parametrize(
    "size,bucket",
    [
        ((1920, 1080), (672, 384)),
        ((1080, 1920), (384, 672)),
        ((1000, 1000), (512, 512)),
        ((1200, 1000), (544, 480)),
        ((4000, 1000), (704, 384)),
        ((640, 480), (576, 448)),
        ((480, 640), (448, 576)),
        ((3, 2), (640, 416)),
    ],
)
def test_the_chosen_bucket(size, bucket):
    from theworld.model.images import bucket_for

    assert bucket_for(*size, 512) == bucket


def test_the_chosen_bucket_has_the_nearest_log_aspect_ratio():
    from theworld.model.images import bucket_for, buckets

    rng = random.Random(0)
    for _ in range(500):
        w, h = rng.randint(1, 5000), rng.randint(1, 5000)
        got = bucket_for(w, h, 512)
        dist = lambda b: abs(math.log(b[0] / b[1]) - math.log(w / h))
        assert dist(got) == min(dist(b) for b in buckets(512))


def test_bucket_resize_covers_the_bucket_and_crops_at_most_the_remainder():
    from theworld.model.images import bucket_for, load_for_vae

    for w, h in [(300, 150), (150, 300), (200, 120), (90, 300), (128, 128), (1000, 37)]:
        pixels, meta = load_for_vae(jpeg_bytes(gradient(w, h)), 128, "bucket")
        bw, bh = bucket_for(w, h, 128)
        assert tuple(pixels.shape) == (3, bh, bw) and pixels.dtype == torch.uint8
        left, top, right, bottom = meta["crop_box"]
        assert meta["original_size"] == [w, h]
        # the crop box has the bucket's aspect ratio, keeps one whole side and is centred
        assert (left, right) == (0, w) or (top, bottom) == (0, h)
        assert abs((right - left) / (bottom - top) - bw / bh) < 2 / min(right - left, bottom - top) + 1e-9
        assert abs(left - (w - right)) <= 1 and abs(top - (h - bottom)) <= 1


def test_bucket_follows_exif_rotation_and_squares_are_unchanged():
    from theworld.model.images import load_for_vae

    exif = Image.Exif()
    exif[0x0112] = 6  # stored 300 x 150, shown 150 x 300
    pixels, meta = load_for_vae(jpeg_bytes(gradient(300, 150), exif=exif.tobytes()), 128, "bucket")
    assert tuple(pixels.shape) == (3, 192, 96) and meta["original_size"] == [150, 300]
    data = jpeg_bytes(gradient(100, 100))
    crop, _ = load_for_vae(data, 128, "crop")
    bucket, _ = load_for_vae(data, 128, "bucket")
    assert tuple(bucket.shape) == (3, 128, 128) and torch.equal(crop, bucket)


def test_bucket_needs_a_resolution_divisible_by_32():
    from theworld.core.errors import UserError
    from theworld.model.config import ImageConfig

    with pytest.raises(UserError, match="image.resolution.*32"):
        ImageConfig(resolution=72, resize="bucket")
    ImageConfig(resolution=72, resize="crop")


# ----------------------------------------------------------------------------------------------------------------------
# A bucketed cache end to end


def test_bucketed_precompute_records_each_samples_latent_shape(tmp_path, fake_vae):
    from precompute import inspect
    from precompute.cosmos_latents import run
    from theworld import cache_format as cf
    from theworld.model.images import bucket_for

    src = bucket_folder(tmp_path / "src", 18)
    out = tmp_path / "cache"
    run(
        make_cfg(
            out, "source.type=folder", f"source.path={src}", "image.resize=bucket", "cache.flip=true", res=128, shard=8
        )
    )
    manifest = json.loads((out / "manifest.json").read_text())
    expected = {}
    for i in range(18):
        w, h = BUCKET_SIZES[i % len(BUCKET_SIZES)]
        bw, bh = bucket_for(w + i % 7, h, 128)
        expected[f"img{i:03d}_jpg"] = [16, 1, bh // 8, bw // 8]
    assert manifest["latent_shape"] is None
    counts = {}
    for shape in expected.values():
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    assert manifest["latent_shapes"] == [{"shape": list(k), "num_samples": v} for k, v in sorted(counts.items())]
    assert len(counts) == 5
    reader = cf.CacheReader(out)
    for i in range(3):
        for e in cf.read_sidecar(out, i)["samples"]:
            assert e["latent_shape"] == expected[e["key"]]
    for j in range(len(reader)):
        s = reader[j]
        shape = expected[s.key]
        assert list(s.mean.shape) == list(s.logvar.shape) == list(s.flip_mean.shape) == shape
        assert reader.latent_hw[j].tolist() == shape[2:]
        box = s.meta["crop_box"]
        assert (box[2] - box[0]) / (box[3] - box[1]) == pytest.approx(shape[3] / shape[2], rel=0.05)
    args = type(
        "A",
        (),
        {
            "config": None,
            "overrides": [],
            "n": 18,
            "seed": 0,
            "batch_size": 8,
            "tol": 1e-5,
            "out": str(tmp_path / "sheet.png"),
        },
    )()
    report, code, _ = inspect.verify(out, args)
    assert code == 0 and report["ok"]
    # stored images re-encoded at their bucket size reproduce the cached latents; decode draws every shape
    report, code, _ = inspect.compare_live(out, args)
    assert code == 0 and report["n"] == 18 and report["max_abs_diff"] < 1e-5
    report, code, _ = inspect.decode(out, args)
    assert code == 0 and report["n"] == 18 and Image.open(tmp_path / "sheet.png").size[0] > 0


def test_a_cache_without_per_sample_shapes_reads_as_square(tmp_path, fake_vae):
    """Version-1 caches written before the sidecar recorded latent shapes: every sample has the manifest's."""
    from precompute.cosmos_latents import run
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


# ----------------------------------------------------------------------------------------------------------------------
# The trainer's order


def test_global_batches_hold_one_bucket_and_a_square_cache_keeps_the_plain_order():
    from train.data.order import epoch_batches, epoch_order, rank_indices, steps_per_epoch

    train = np.arange(1000, 1200)
    buckets = np.random.default_rng(0).choice(4, size=200, p=[0.5, 0.3, 0.15, 0.05])
    sizes = np.bincount(buckets)
    for epoch in (0, 1, 2):
        batches = epoch_batches(train, 7, epoch, 8, buckets)
        assert batches.shape == (steps_per_epoch(sizes, 8), 8) == (int((sizes // 8).sum()), 8)
        of = buckets[batches - 1000]
        assert (of == of[:, :1]).all()  # one bucket per global batch
        assert len(set(batches.ravel().tolist())) == batches.size  # no sample twice
        for k in range(4):  # each bucket loses fewer than G samples
            assert sizes[k] - (of[:, 0] == k).sum() * 8 < 8
        assert len(set(of[:, 0].tolist())) > 1
        # a pure function of (seed, epoch); processes split each global batch; resuming reads the tail
        assert np.array_equal(batches, epoch_batches(train, 7, epoch, 8, buckets))
        two = [rank_indices(train, 7, epoch, 8, r, 2, 0, buckets).reshape(-1, 4) for r in range(2)]
        assert np.array_equal(np.concatenate(two, axis=1), batches)
        tail = rank_indices(train, 7, epoch, 8, 1, 2, 5, buckets)
        assert np.array_equal(tail, two[1][5:].ravel())
    assert not np.array_equal(epoch_batches(train, 7, 0, 8, buckets), epoch_batches(train, 7, 1, 8, buckets))
    # one bucket: global batch b is order[b*G:(b+1)*G], as for a square cache
    one = epoch_batches(train, 7, 3, 16, np.zeros(200, dtype=np.int32))
    assert np.array_equal(one, epoch_order(train, 7, 3)[:192].reshape(12, 16))
    assert np.array_equal(one, epoch_batches(train, 7, 3, 16))


def test_too_few_samples_in_every_bucket_is_a_one_line_error():
    from theworld.core.errors import UserError
    from train.data.order import steps_per_epoch

    with pytest.raises(
        UserError,
        match="train.global_batch_size': 8 is more than the training samples of every "
        r"latent shape \(largest: 7\)",
    ):
        steps_per_epoch(np.array([7, 5, 3]), 8)
    assert steps_per_epoch(np.array([8, 5, 17]), 8) == 3


# ----------------------------------------------------------------------------------------------------------------------
# --plan and cache.latents: mean


def _shard_bytes(cache) -> int:
    return json.loads((cache / "manifest.json").read_text())["bytes"]


@pytest.mark.parametrize("latents", ["posterior", "mean"])
def test_plan_matches_a_real_runs_bytes_within_5_percent(tmp_path, fake_vae, latents):
    from precompute import sizing
    from precompute.cosmos_latents import run
    from theworld import cache_format as cf

    src = bucket_folder(tmp_path / "src", 24)
    cfg = make_cfg(
        tmp_path / "cache",
        "source.type=folder",
        f"source.path={src}",
        "image.resize=bucket",
        "cache.flip=true",
        "cache.siglip=true",
        f"cache.latents={latents}",
        res=128,
        shard=8,
        n=24,
    )
    p = sizing.estimate(cfg)
    assert not (tmp_path / "cache").exists()  # the plan writes nothing
    run(cfg)
    real = _shard_bytes(tmp_path / "cache")
    assert p["entries"] == 24 and p["shards"] == 3
    assert abs(p["bytes_total"] / real - 1) < 0.05, (p, real)
    side = cf.read_sidecar(tmp_path / "cache", 0)["samples"][0]["members"]
    assert p["bytes_per_sample"]["siglip"] == sizing._member(side[cf.SIGLIP][1])  # exact: sized from the saved config
    assert len(p["latent_grids"]) == 5


def test_a_mean_only_cache_halves_the_latent_bytes(tmp_path, fake_vae):
    from precompute import inspect
    from precompute.cosmos_latents import run
    from theworld import cache_format as cf

    sizes = {}
    for latents in ("posterior", "mean"):
        out = tmp_path / latents
        run(make_cfg(out, f"cache.latents={latents}", "cache.flip=true", res=64, n=8))
        reader = cf.CacheReader(out)
        s = reader[0]
        assert (s.logvar is None) == (s.flip_logvar is None) == (latents == "mean")
        assert cf.latents_stored(cf.load_manifest(out)) == latents
        assert cf.load_manifest(out)["contents"].get("latents") == ("mean" if latents == "mean" else None)
        sizes[latents] = cf.read_sidecar(out, 0)["samples"][0]["members"][cf.LATENT][1]
        report, code, _ = inspect.verify(out, type("A", (), {"config": None, "overrides": []})())
        assert code == 0 and report["ok"]
    assert 0.49 < sizes["mean"] / sizes["posterior"] < 0.52


def test_plan_for_the_real_models_offline_loads_no_model(monkeypatch, capsys):
    from precompute import cosmos_latents
    from theworld.model import encoders

    def no_loading(*a, **k):
        raise AssertionError("--plan loaded a model")

    monkeypatch.setattr(encoders, "load_gemma", no_loading)
    monkeypatch.setattr(encoders, "load_vae", no_loading)
    root = Path(__file__).resolve().parents[3]
    assert (
        cosmos_latents.main(
            [
                "--config",
                str(root / "configs" / "real" / "precompute.yaml"),
                "--plan",
                "--set",
                "source.type=synthetic",
                "--set",
                "source.num_samples=12800000",
                "--set",
                "cache.images=false",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # Gemma 3 4B: 256 image tokens x 2560 hidden in bf16 = 1.31 MB a sample; 16 x 64 x 64 bf16 mean + logvar
    assert "entries: 12800000 in 12500 shards of 1024" in out
    assert "  siglip           1.3 MB   x 12800000 = 16.8 TB" in out
    assert "  latent         263.2 kB   x 12800000 = 3.4 TB" in out
    assert "total for the whole source: 20.2 TB" in out


def test_the_world_projector_pools_a_non_square_latent_over_h_and_w_separately():
    from theworld.model.projector import WorldProjector

    torch.manual_seed(0)
    proj = WorldProjector(32, torch.zeros(16), torch.ones(16), pool=4)
    mean = torch.randn(2, 16, 1, 12, 20)
    out = proj(mean, None)
    assert out.shape == (2, 3 * 5 + 2, 32) and proj.num_tokens(12, 20) == 17
    # token (row 1, column 3) is the projection of the mean over latent rows 4-7 and columns 12-15
    pooled = mean[:, :, 0, 4:8, 12:16].mean(dim=(-2, -1))
    torch.testing.assert_close(out[:, 1 + 1 * 5 + 3], proj.net(pooled) * proj.embed_scale)


def test_bad_images_in_bucket_mode_are_bad_images(tmp_path):
    """The bucket is chosen from the header before decoding: a broken or zero-size file is still a BadImage."""
    from tests._precompute_helpers import bomb_png
    from theworld.model.images import BadImage, load_for_vae

    for data in (
        b"",
        b"\xff\xd8\xff\xe0" + bytes(range(256)),
        bomb_png(),
        bomb_png(0, 10),
        bomb_png(10, 0),
        jpeg_bytes(gradient(64, 64))[:200],
    ):
        with pytest.raises(BadImage):
            load_for_vae(data, 128, "bucket")


def test_plan_for_an_unknown_hub_model_offline_is_a_one_line_error(capsys):
    from precompute import cosmos_latents

    assert (
        cosmos_latents.main(
            [
                "--plan",
                "--set",
                "source.num_samples=8",
                "--set",
                "cache.siglip=true",
                "--set",
                "model.gemma=nobody/not-a-gemma",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.gemma" in err[0] and "nobody/not-a-gemma" in err[0], err


def test_upscaled_compares_the_crop_box_with_the_bucket_not_the_resolution():
    """A 128x64 picture fills its 128x64 bucket at 96 px exactly: not enlarged, though its short side is under 96."""
    from theworld.model import images

    exact = {"original_size": [128, 64], "crop_box": [0, 0, 128, 64]}
    assert not images.upscaled(exact, 96, "bucket")
    assert images.upscaled({"original_size": [64, 32], "crop_box": [0, 0, 64, 32]}, 96, "bucket")
    assert images.upscaled(exact, 96, "crop")  # its 64 px square is enlarged to 96 x 96
    assert not images.upscaled({"original_size": [200, 100], "crop_box": [50, 0, 150, 100]}, 96, "crop")


def test_bucketed_precompute_encodes_each_shards_buckets_in_full_batches(tmp_path, fake_vae, monkeypatch):
    """A shard's samples are grouped by bucket before batching: one encoder call per batch_size samples of a shape
    in a shard; the cache's key -> latent is what one-sample batches give, and a resumed run writes the same bytes."""
    import math
    from collections import Counter

    from precompute.cosmos_latents import run
    from tests._precompute_helpers import latents
    from theworld import cache_format as cf
    from theworld.model.images import bucket_for

    src = bucket_folder(tmp_path / "src", 24)
    calls = []
    encode = fake_vae.encode
    monkeypatch.setattr(fake_vae, "encode", lambda x: (calls.append(tuple(x.shape)), encode(x))[1])
    cfg = lambda out, batch: make_cfg(
        out,
        "source.type=folder",
        f"source.path={src}",
        "image.resize=bucket",
        f"batch_size={batch}",
        n=24,
        res=128,
        shard=12,
    )
    first = run(cfg(tmp_path / "a", 4))

    def bucket(i: int) -> tuple[int, int]:
        w, h = BUCKET_SIZES[i % len(BUCKET_SIZES)]
        return bucket_for(w + i % 7, h, 128)

    per_shard = [Counter(bucket(i) for i in range(lo, lo + 12)) for lo in (0, 12)]
    assert len(calls) == sum(
        math.ceil(n / 4) for c in per_shard for n in c.values()
    )  # 10; splitting each loader batch by shape made 20
    assert all(n <= 4 for n, *_ in calls)
    assert {(w, h) for *_, h, w in calls} == {s for c in per_shard for s in c}
    one = run(cfg(tmp_path / "b", 1))
    assert first["num_samples"] == one["num_samples"] == 24
    got, want = latents(tmp_path / "a"), latents(tmp_path / "b")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    # resume: a lost shard is rebuilt byte for byte
    cf.tar_path(tmp_path / "a", 1).unlink()
    again = run(cfg(tmp_path / "a", 4))
    assert again["summary"]["encoded_this_run"] == 12
    assert again["shard_index"] == first["shard_index"]
