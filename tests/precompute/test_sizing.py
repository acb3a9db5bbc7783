"""precompute.sizing: `--plan`'s rollout time is for the device precompute uses here, measured or stated, and never
a rounded "0 hours"."""

from __future__ import annotations

import json

import pytest
import torch

from precompute import sizing
from tests._precompute_helpers import bucket_folder, make_cfg

ROLL = ["world.num_world_steps=1", "world.rollout.inference_steps=1", "batch_size=4"]


def test_a_small_rollout_is_timed_on_this_machines_device_and_kept_apart_from_gpu_time(tmp_path):
    plain = sizing.estimate(make_cfg(tmp_path / "c", n=6))
    plan = sizing.estimate(make_cfg(tmp_path / "c", *ROLL, n=6))
    r = plan["rollout"]
    device = "GPU" if torch.cuda.is_available() else "CPU"
    assert r["device"] == device and r["basis"].startswith("measured") and r["seconds_per_sample"] > 0
    assert r["hours"] > 0 and abs(r["hours"] - r["seconds_per_sample"] * plan["samples"] / 3600) <= 0.01 * r["hours"]
    line = next(ln for ln in sizing.report(plan).splitlines() if ln.startswith("rollouts:"))
    assert f"on a {device}, " in line and f" {device}-hours for 6 samples" in line and " 0 " not in line, line
    if device == "CPU":  # CPU time is not GPU time
        assert plan["gpu_hours"] == plain["gpu_hours"] and "not in the GPU time below" in line


def test_a_large_rollout_without_a_gpu_is_priced_at_this_cpus_measured_rate_and_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = make_cfg(__import__("pathlib").Path("/nonexistent"), "world.num_world_steps=2", n=4)
    flops = 900e12
    seconds, device, basis = sizing.rollout_seconds(cfg, flops, (64, 64))
    assert device == "CPU" and "ESTIMATE, no GPU here" in basis and "GFLOP/s" in basis
    assert seconds > flops / sizing.ASSUMED_GPU_FLOPS * 10  # a CPU is not priced at an H100's rate


def _plan(capsys, *overrides: str) -> tuple[int, list[str]]:
    from precompute import cosmos_latents
    from tests.conftest import ROOT

    args = ["--config", str(ROOT / "configs" / "precompute.yaml"), "--plan"]
    rc = cosmos_latents.main(args + [a for o in overrides for a in ("--set", o)])
    return rc, capsys.readouterr()


@pytest.mark.parametrize("key", ["model.gemma", "model.vae"])
@pytest.mark.parametrize("text", ["not json{", "{}", "[1, 2]"])
def test_plan_with_a_broken_model_config_is_one_line(tmp_path, capsys, key, text):
    (tmp_path / "config.json").write_text(text)
    rc, out = _plan(capsys, f"{key}={tmp_path}", "source.num_samples=4", f"output_dir={tmp_path / 'c'}")
    if key == "model.vae" and text == "{}":  # diffusers' defaults fill an empty VAE config: the plan goes on
        assert rc == 0 and "latent" in out.out
        return
    assert rc == 2 and out.err.count("\n") == 1 and out.err.startswith(f"error: {key}: cannot load"), out.err


@pytest.mark.parametrize(
    "key,config,words",
    [
        ("model.vae", {"z_dim": "16"}, "no usable z_dim (got '16')"),
        ("model.vae", {"z_dim": -5}, "no usable z_dim (got -5)"),
        ("model.vae", {"z_dim": None}, "no usable z_dim (got None)"),
        ("model.vae", {"z_dim": 10**12}, "its latent would hold 64,000,000,000,000 values per sample"),
        ("model.gemma", {"mm_tokens_per_image": 0, "text_config": {"hidden_size": 8}}, "no usable mm_tokens"),
        ("model.gemma", {"mm_tokens_per_image": 10**5, "text_config": {"hidden_size": 10**5}}, "SigLIP features"),
    ],
)
def test_plan_with_unusable_sizes_in_a_model_config_is_one_line(tmp_path, capsys, key, config, words):
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, out = _plan(capsys, f"{key}={tmp_path}", "source.num_samples=4", f"output_dir={tmp_path / 'c'}")
    assert rc == 2 and out.err.count("\n") == 1 and out.err.startswith(f"error: {key}: ") and words in out.err, out.err


def test_plan_at_absurd_sizes_answers_in_integers_or_refuses(tmp_path, capsys):
    rc, out = _plan(capsys, "source.num_samples=9223372036854775807", "shard_size=1", "source.type=synthetic")
    assert rc == 0 and "entries: 9223372036854775807 in 9223372036854775807 shards of 1" in out.out
    rc, out = _plan(capsys, "image.resolution=16384")
    assert rc == 2 and "'image.resolution'" in out.err and "at most 9456" in out.err


def test_plan_says_why_no_sampled_entry_is_usable(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for name, data in (("a.png", b"not a png"), ("b.png", b""), ("c.png", b"")):
        (src / name).write_bytes(data)
        (src / name).with_suffix(".txt").write_text("caption")
    rc, out = _plan(capsys, "source.type=folder", f"source.path={src}", "source.num_samples=null")
    assert rc == 2 and "none of the 3 sampled entries of the source is usable: " in out.err
    assert "empty file x2" in out.err and "unreadable image" in out.err, out.err


def _shard_bytes(cache) -> int:
    return json.loads((cache / "manifest.json").read_text())["bytes"]


@pytest.mark.parametrize("latents", ["posterior", "mean"])
def test_plan_matches_a_real_runs_bytes_within_5_percent(tmp_path, fake_vae, latents):
    from precompute import sizing
    from precompute.pipeline import run
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


def test_plan_for_the_real_models_offline_loads_no_model(monkeypatch, capsys):
    from precompute import cosmos_latents
    from theworld.model import encoders

    def no_loading(*a, **k):
        raise AssertionError("--plan loaded a model")

    monkeypatch.setattr(encoders, "load_gemma", no_loading)
    monkeypatch.setattr(encoders, "load_vae", no_loading)
    from tests.conftest import ROOT as root

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
