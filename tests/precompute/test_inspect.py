"""precompute.inspect: summary numbers, verify catching damage, compare-live, decode, fingerprint refusal."""

from __future__ import annotations

import json
from contextlib import closing

import pytest
import torch
from PIL import Image

from precompute import cosmos_latents, inspect, pipeline
from tests._precompute_helpers import cli_args, make_cfg, read_cache_plain, rewrite_manifest, sidecar_json
from tests.conftest import only_line
from tests.fake_vae import FakeWanVAE
from theworld import cache_format as cf
from theworld.model import encoders


@pytest.fixture
def cache(tmp_path, fake_vae):
    out = tmp_path / "cache"
    pipeline.run(make_cfg(out, n=10, shard=4, res=32))
    return out


def _json(capsys) -> dict:
    """The inspect command's JSON report (after whatever a precompute run in the same test printed)."""
    out = capsys.readouterr().out
    start = 0 if out.startswith("{") else out.index("\n{") + 1
    return json.loads(out[start:])


def test_summary_numbers(cache, capsys):
    assert inspect.main(["summary", str(cache), "--json"]) == 0
    r = _json(capsys)
    assert r["num_samples"] == 10 and r["num_shards"] == 3 and r["num_errors"] == 0
    assert r["latent_shape"] == [16, 1, 4, 4] and r["latent_dtype"] == "float32"
    with closing(cf.CacheReader(cache)) as reader:
        means = torch.stack([reader[i].mean for i in range(10)])
    per_channel = means.transpose(0, 1).reshape(16, -1)
    assert r["channel_mean"] == pytest.approx(per_channel.mean(1).tolist(), abs=1e-4)
    assert r["channel_std"] == pytest.approx(per_channel.std(1).tolist(), abs=1e-4)
    total = sum((cache / "shards" / f"shard-{i:06d}.tar").stat().st_size for i in range(3))
    assert r["bytes"] == total and r["bytes_per_sample"] == pytest.approx(total / 10, abs=0.1)
    assert inspect.main(["summary", str(cache)]) == 0
    assert "10 samples, 0 errors, 3 shards" in capsys.readouterr().out


def test_summary_error_reasons(tmp_path, fake_vae, capsys):
    src = tmp_path / "src"
    src.mkdir()
    from tests._precompute_helpers import gradient, png_bytes

    (src / "ok.png").write_bytes(png_bytes(gradient(40, 40)))
    (src / "bad.png").write_bytes(b"not an image")
    (src / "captions.jsonl").write_text(
        '{"image": "ok.png", "caption": "a"}\n{"image": "bad.png", "caption": "b"}\n'
        '{"image": "gone.png", "caption": "c"}\n'
    )
    pipeline.run(make_cfg(tmp_path / "c", "source.type=folder", f"source.path={src}"))
    assert inspect.main(["summary", str(tmp_path / "c"), "--json"]) == 0
    r = _json(capsys)
    assert r["num_samples"] == 1 and r["num_errors"] == 2
    assert r["error_reasons"] == {"unreadable image": 1, "cannot read": 1}


def test_verify_ok_then_flipped_byte_and_truncation(cache, capsys):
    assert inspect.main(["verify", str(cache), "--json"]) == 0
    r = _json(capsys)
    assert r["ok"] and r["num_samples_checked"] == 10 and r["bad_shards"] == []
    shard1 = cache / "shards" / "shard-000001.tar"
    data = bytearray(shard1.read_bytes())
    offset = cf.read_sidecar(cache, 1)["samples"][0]["members"]["latent.safetensors"][0]
    data[offset + 200] ^= 0xFF  # inside the tensor bytes
    shard1.write_bytes(bytes(data))
    shard2 = cache / "shards" / "shard-000002.tar"
    shard2.write_bytes(shard2.read_bytes()[:3000])
    assert inspect.main(["verify", str(cache)]) == 1
    out = capsys.readouterr().out
    assert "bad shard shards/shard-000001.tar" in out and "bad shard shards/shard-000002.tar" in out
    assert "shard-000000.tar" not in out.replace("shards checked", "")
    assert inspect.main(["verify", str(cache), "--json"]) == 1
    assert _json(capsys)["bad_shards"] == ["shards/shard-000001.tar", "shards/shard-000002.tar"]


def test_verify_names_the_shard_whose_files_a_swapped_pair_holds(cache, capsys):
    for path in (cf.tar_path, cf.sidecar_path):
        a, b = path(cache, 0), path(cache, 1)
        a.rename(a.with_name("x"))
        b.rename(a)
        a.with_name("x").rename(b)
    assert inspect.main(["verify", str(cache)]) == 1
    out = capsys.readouterr().out
    assert "it holds what the manifest lists for shards/shard-000001.tar (copied or swapped)" in out
    assert "it holds what the manifest lists for shards/shard-000000.tar (copied or swapped)" in out


def test_verify_catches_nan_and_duplicates_with_matching_hashes(tmp_path, cache, capsys):
    """A shard whose hashes match the manifest but whose content is wrong (written by buggy code) is still caught."""
    members = read_cache_plain(cache)
    bad = dict(next(iter(members.items()))[1])
    from safetensors.torch import load, save

    t = load(bad["latent.safetensors"])
    t["mean"][0, 0, 0, 0] = float("nan")
    bad["latent.safetensors"] = save(t)
    key0 = next(iter(members))
    cf.write_shard(cache, 2, [(key0, bad)])  # duplicate of a key in shard 0, with a NaN
    assert rewrite_manifest(cache)["num_samples"] == 9
    assert inspect.main(["verify", str(cache), "--json"]) == 1
    r = _json(capsys)
    problems = r["shards"][2]["problems"]
    assert r["bad_shards"] == ["shards/shard-000002.tar"]
    assert any("duplicate key" in p for p in problems) and any("non-finite" in p for p in problems)


def test_verify_incomplete_cache_is_a_user_error(cache, capsys):
    (cache / "manifest.json").unlink()
    assert inspect.main(["verify", str(cache)]) == 2
    assert "incomplete" in capsys.readouterr().err


def test_compare_live_exact_in_float32(cache, capsys):
    assert inspect.main(["compare-live", str(cache), "--n", "4", "--json", "--tol", "1e-6"]) == 0
    r = _json(capsys)
    assert r["n"] == 4 and len({s["key"] for s in r["samples"]}) == 4
    assert r["max_abs_diff"] <= 1e-6 and r["ok"]


def test_compare_live_catches_changed_latents_via_tol(cache, capsys):
    # Same fingerprint (weights hash), but the cache's numbers were tampered with after the fact.
    reader = cf.CacheReader(cache)
    pairs = []
    for i in range(4):
        s = reader[i]
        s.mean = s.mean + 0.5
        pairs.append((s.key, cf.encode_sample(s, "float32")))
    reader.close()
    cf.write_shard(cache, 0, pairs)
    rewrite_manifest(cache)
    assert inspect.main(["compare-live", str(cache), "--n", "10", "--json", "--tol", "1e-3"]) == 1
    assert _json(capsys)["max_abs_diff_mean"] == pytest.approx(0.5, abs=1e-5)


def test_fingerprint_mismatch_refused_naming_the_field(cache, capsys, monkeypatch):
    assert inspect.main(["compare-live", str(cache), "--n", "2", "--set", "image.resolution=64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "image.resolution" in err and "cache has 32" in err
    other = FakeWanVAE(seed=1)
    monkeypatch.setattr(encoders, "load_vae", lambda spec, dtype="float32": other)
    assert inspect.main(["decode", str(cache), "--n", "2", "--out", str(cache / "x.png")]) == 2
    assert "vae.weights" in capsys.readouterr().err
    assert not (cache / "x.png").exists()
    # summary/verify check the fingerprint only when given a config
    assert inspect.main(["verify", str(cache), "--set", "model.dtype=float32"]) == 2
    assert "vae.weights" in capsys.readouterr().err


def test_decode_contact_sheet(cache, tmp_path, capsys):
    out = tmp_path / "sheets" / "sheet.png"
    assert inspect.main(["decode", str(cache), "--n", "3", "--out", str(out), "--json"]) == 0
    r = _json(capsys)
    assert r["n"] == 3 and r["out"] == str(out)
    img = Image.open(out)
    assert img.mode == "RGB" and img.width > 3 * 2 * 128 and img.height >= 128  # 3 pairs of >=128 px tiles
    # The fake VAE decodes its latents back to 8x8-pooled pictures: close to the originals, far from noise.
    assert all(s["psnr_db"] > 15 for s in r["samples"])


def test_decode_without_images(tmp_path, fake_vae, capsys):
    out = tmp_path / "c"
    pipeline.run(make_cfg(out, "cache.images=false", n=2))
    assert inspect.main(["decode", str(out), "--n", "2", "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").is_file()
    assert inspect.main(["compare-live", str(out), "--n", "2"]) == 2
    assert "cache.images false" in capsys.readouterr().err


def test_bad_arguments_exit_2(cache, capsys):
    assert inspect.main(["frobnicate", str(cache)]) == 2
    assert inspect.main(["decode", str(cache), "--n", "2"]) == 2  # --out missing
    assert inspect.main(["summary", str(cache.parent / "nothing")]) == 2
    assert "no cache" in capsys.readouterr().err


def test_damaged_cache_and_bad_out_are_one_line_errors(cache, tmp_path, capsys):
    def one_line_error(argv, *words):
        assert inspect.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err

    one_line_error(["summary", str(cache), "--max-samples", "0"], "--max-samples")
    (tmp_path / "afile").write_text("x")
    one_line_error(["decode", str(cache), "--out", str(tmp_path / "afile" / "x.png")], "--out")
    one_line_error(["decode", str(cache), "--out", str(tmp_path / "sheet.pngx")], "unknown image extension")
    one_line_error(["decode", str(cache), "--out", str(tmp_path)], f"--out {tmp_path} is a folder holding the cache")
    shard = cache / "shards" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    one_line_error(["summary", str(cache)], "truncated", "inspect verify")
    shard.unlink()
    one_line_error(["compare-live", str(cache), "--n", "10"], "shard-000001.tar", "inspect verify")


def test_a_cache_without_samples_is_a_one_line_error(tmp_path, fake_vae, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(b"broken")
    (src / "a.txt").write_text("caption")
    assert cosmos_latents.main(cli_args(tmp_path / "c", "source.type=folder", f"source.path={src}")) == 2
    capsys.readouterr()
    assert inspect.main(["decode", str(tmp_path / "c"), "--out", str(tmp_path / "s.png")]) == 2
    assert "holds no samples, so it is not a cache" in capsys.readouterr().err


def test_decode_sheet_labels_each_pair_and_says_when_the_vae_is_the_random_tiny_one(cache, tmp_path, capsys):
    import numpy as np

    out = tmp_path / "sheet.png"
    assert inspect.main(["decode", str(cache), "--n", "2", "--out", str(out), "--json"]) == 0
    r = _json(capsys)
    assert "original | decoded" in r["header"] and "tiny (random weights): decodes are noise by design" in r["header"]
    sheet = np.asarray(Image.open(out))
    tile = 128
    assert (sheet[4:28] != 32).any(axis=-1).sum() > 200  # the header's two lines are drawn
    band = sheet[28 + 4 + tile : 28 + 4 + tile + 24, 8 : 8 + 2 * tile]  # under the first pair: key and caption
    assert (band != 32).any(axis=-1).sum() > 200
    assert inspect.main(["decode", str(cache), "--n", "2", "--out", str(out)]) == 0
    assert "tiny (random weights)" in capsys.readouterr().out
    assert "random" not in inspect._decode_header(make_cfg(tmp_path, "model.vae=/models/wan"))


@pytest.mark.parametrize(
    "manifest",
    [
        b"[1, 2, 3]",
        b'"a string"',
        b"17",
        b"null",
        b"\xff\xfe not utf-8",
        b'{"format_version": 1, "shards": {"a": 1}}',
        b'{"format_version": 1, "shards": [{"path": "x"}]}',
    ],
)
def test_a_manifest_that_is_not_a_valid_object_is_one_line_in_summary_and_verify(cache, capsys, manifest):
    (cache / cf.MANIFEST).write_bytes(manifest)
    assert inspect.main(["summary", str(cache)]) == 2
    only_line(capsys, "manifest.json")
    assert inspect.main(["verify", str(cache)]) == 1  # a finding, reported like a bad shard
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "manifest.json" in out[0] and "FAILED" in out[0], out


def test_verify_checks_sidecar_offsets_and_checksums_against_the_tar(cache, capsys):
    assert inspect.main(["verify", str(cache)]) == 0
    capsys.readouterr()
    side = sidecar_json(cache, 0)
    side["samples"][1]["members"][cf.CAPTION][0] += 512  # still inside the tar: only the tar's own layout tells
    cf.atomic_write_json(cf.sidecar_path(cache, 0), side)
    assert inspect.main(["verify", str(cache), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["bad_shards"] == ["shards/shard-000000.tar"]
    assert any("sidecar offsets" in p for p in report["shards"][0]["problems"])
    side["samples"][1]["members"][cf.CAPTION][0] -= 512
    side["samples"][1][cf.CHECKSUMS][cf.CAPTION] ^= 1
    cf.atomic_write_json(cf.sidecar_path(cache, 0), side)
    assert inspect.main(["verify", str(cache), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any("txt fails its crc32" in p for p in report["shards"][0]["problems"])
