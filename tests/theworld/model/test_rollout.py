"""World rollouts (theworld/model/rollout.py): the Video2World pipeline's prompt, the rollout cache's latents, cached ==
live, seeds per (seed, key), 1 == 2 processes, inspect on a rollout cache, fingerprint refusals and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load as st_load

from precompute import cosmos_latents, inspect, pipeline
from tests._precompute_helpers import cli_args, latents, make_cfg, read_cache_plain, single_threaded_run
from tests.conftest import run2
from theworld.core.errors import UserError
from theworld.embedded import tiny
from theworld.model import encoders, images, rollout
from theworld.model.config import ModelConfig, RolloutConfig, WorldConfig

STEPS = 2  # predicted frames
ROLL = [f"world.num_world_steps={STEPS}", "world.rollout.inference_steps=2"]
N, SHARD = 6, 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny pipeline's tensors are too small to gain from threads, and on a busy machine OpenMP's spinning threads
    make it many times slower: this module runs on one, as launched processes (OMP_NUM_THREADS=1) do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """A rollout cache (2 predicted frames) and the same source without rollouts, with what reached the text
    encoder while the rollout cache was built (a global forward pre-hook: any T5 encoder's input ids)."""
    from transformers import T5EncoderModel

    root = tmp_path_factory.mktemp("rollout")
    seen: list[torch.Tensor] = []

    def hook(module, args):
        if isinstance(module, T5EncoderModel):  # the pipeline passes the token ids first
            seen.append(args[0].clone())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        rolled = single_threaded_run(make_cfg(root / "rolled", *ROLL, n=N, shard=SHARD))
    finally:
        handle.remove()
    plain = single_threaded_run(make_cfg(root / "plain", n=N, shard=SHARD))
    dirs = {"rolled": root / "rolled", "plain": root / "plain"}
    return {**dirs, "manifest": rolled, "plain_manifest": plain, "seen": seen}


def test_the_pipeline_is_given_the_rollout_prompt_once_and_never_a_caption(caches):
    from diffusers.pipelines.cosmos.pipeline_cosmos2_video2world import DEFAULT_NEGATIVE_PROMPT
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.ensure(tiny.TINY_ROLLOUT_DIR) / "tokenizer")
    texts = [tok.decode(row, skip_special_tokens=True) for ids in caches["seen"] for row in ids]
    # encoded once per run: the prompt and (guidance 7 > 1) the pipeline's default negative prompt, nothing else
    assert texts == [RolloutConfig().prompt, DEFAULT_NEGATIVE_PROMPT]
    captions = {m["txt"].decode() for m in read_cache_plain(caches["rolled"]).values()}
    assert len(captions) > 1 and not captions & set(texts)


def test_a_rollout_cache_holds_the_observed_frame_then_the_predicted_ones(caches):
    m = caches["manifest"]
    assert m["latent_shape"] == [16, 1 + STEPS, 4, 4] and m["contents"]["world_steps"] == STEPS
    world = m["fingerprint"]["world"]
    assert world["num_world_steps"] == STEPS and world["inference_steps"] == 2 and world["seed"] == 0
    assert world["prompt"] == RolloutConfig().prompt and world["transformer"]["weights"]
    assert (
        "world_steps" not in caches["plain_manifest"]["contents"]
        and "world" not in caches["plain_manifest"]["fingerprint"]
    )
    rolled, plain = read_cache_plain(caches["rolled"]), read_cache_plain(caches["plain"])
    assert list(rolled) == list(plain)
    predicted = []
    for key in rolled:
        r, p = st_load(rolled[key]["latent.safetensors"]), st_load(plain[key]["latent.safetensors"])
        assert r["mean"].shape == (16, 1 + STEPS, 4, 4) and p["mean"].shape == (16, 1, 4, 4)
        assert torch.equal(r["mean"][:, :1], p["mean"]) and torch.equal(r["logvar"][:, :1], p["logvar"])
        assert (r["logvar"][:, 1:] == rollout.PREDICTED_LOGVAR).all()
        predicted.append(r["mean"][:, 1:])
        assert not torch.allclose(r["mean"][:, 1], r["mean"][:, 0], atol=1e-2)  # a prediction, not a copy
    assert not torch.allclose(predicted[0], predicted[1], atol=1e-3)  # each image its own future


@pytest.fixture(scope="module")
def tiny_rollout():
    vae = encoders.load_vae("tiny", "float32")
    return encoders.WorldEncoder(vae), rollout.Rollout.load("tiny", "float32", vae, STEPS, RolloutConfig(2))


def _pixels(cache, keys=None) -> tuple[list[str], torch.Tensor]:
    samples = read_cache_plain(cache)
    keys = keys or list(samples)
    return keys, torch.stack([images.load_for_vae(samples[k]["image"], 32)[0] for k in keys])


def test_a_samples_rollout_depends_on_its_seed_and_key_not_on_its_batch(caches, tiny_rollout):
    _, pipe = tiny_rollout
    keys, px = _pixels(caches["rolled"])
    seeds = rollout.sample_seeds(0, keys)
    whole = pipe(px[:4], seeds[:4])
    alone = pipe(px[2:3], seeds[2:3])
    reordered = pipe(px[[3, 2]], [seeds[3], seeds[2]])
    torch.testing.assert_close(alone[0], whole[2], rtol=0, atol=1e-4)
    torch.testing.assert_close(reordered[1], whole[2], rtol=0, atol=1e-4)
    other_seed = pipe(px[2:3], rollout.sample_seeds(1, keys[2:3]))
    assert (other_seed[0] - whole[2]).abs().max() > 1e-2
    assert rollout.sample_seed(0, "a") == rollout.sample_seed(0, "a") != rollout.sample_seed(0, "b")


def test_a_rollout_stays_where_its_holder_put_it():
    """Whoever holds the pipeline places it (TheWorld's .to or device map, precompute's _load_models): an input on
    another device does not move it there (a device map's placement would be undone). Pixels on `meta` fail in the
    pipeline; the weights and prompt embeddings stay on the CPU."""
    vae = encoders.load_vae("tiny", "float32")
    pipe = rollout.Rollout.load("tiny", "float32", vae, STEPS, RolloutConfig(2))
    with pytest.raises(RuntimeError, match="meta"):
        pipe(torch.zeros(1, 3, 32, 32, dtype=torch.uint8, device="meta"), [0])
    assert {t.device.type for t in [*pipe.parameters(), *pipe.buffers()]} == {"cpu"}


def test_live_rollouts_equal_the_cached_ones_and_frame_0_keeps_its_gradient(caches):
    from theworld.model.world import TheWorld

    world = WorldConfig(num_world_steps=STEPS, rollout=RolloutConfig(inference_steps=2))
    model, _ = TheWorld.from_config(ModelConfig(dtype="float32"), world)
    keys, px = _pixels(caches["rolled"], list(read_cache_plain(caches["rolled"]))[1:5])
    cached = latents(caches["rolled"])
    with torch.no_grad():
        mean, logvar = model.world_latents(px, None, None, rollout.sample_seeds(0, keys))
    assert mean.shape == (4, 16, 1 + STEPS, 4, 4)
    for row, key in enumerate(keys):
        torch.testing.assert_close(mean[row], cached[key], rtol=0, atol=1e-3)
    assert (logvar[:, :, 1:] == rollout.PREDICTED_LOGVAR).all()
    # the VAE trains (stage 4): the observed frame carries its gradient, the predicted ones none (frozen transformer)
    model.world_encoder.vae.requires_grad_(True)
    mean, _ = model.world_latents(px[:1], None, None, rollout.sample_seeds(0, keys[:1]))
    assert mean.requires_grad
    mean[:, :, 0].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.world_encoder.vae.encoder.parameters())
    assert all(p.grad is None and not p.requires_grad for p in model.rollout.transformer.parameters())
    # without seeds, each row's noise comes from its pixels: the same image rolls out the same in any batch
    with torch.no_grad():
        a = model.world_latents(px[:2], None, None)[0]
        b = model.world_latents(px[1:2], None, None)[0]
    torch.testing.assert_close(a[1], b[0], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="one seed per image"):
        model.rollout(px[:2], [1])
    # built without the pipeline (cached latents only): live latents are refused, not silently one frame
    model.rollout = None
    with pytest.raises(ValueError, match="rollout pipeline"):
        model.world_latents(px[:1], None, None)
    given = torch.zeros(1, 16, 1 + STEPS, 4, 4)
    assert model.world_latents(px[:1], given, None)[0] is given  # cached latents still pass through


@pytest.mark.slow
def test_two_processes_write_the_rollout_cache_of_one(caches, tmp_path):
    two = tmp_path / "two"
    res = run2(cli_args(two, *ROLL, n=N, shard=SHARD), module="precompute.cosmos_latents")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"encoded {N} images" in res.stdout and "on 2 process(es)" in res.stdout
    m2 = json.loads((two / "manifest.json").read_text())
    assert m2["shard_index"] == caches["manifest"]["shard_index"]
    l1, l2 = latents(caches["rolled"]), latents(two)
    assert list(l1) == list(l2) and all(torch.equal(l1[k], l2[k]) for k in l1)


def test_inspect_summary_compare_live_and_decode_on_a_rollout_cache(caches, tmp_path, capsys):
    cache = str(caches["rolled"])
    assert inspect.main(["summary", cache, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_steps"] == STEPS and report["latent_frames"] == 1 + STEPS
    assert inspect.main(["compare-live", cache, "--n", "4", "--json", "--tol", "1e-3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 4 and report["world_steps"] == STEPS and report["max_abs_diff"] <= 1e-3
    out = tmp_path / "strip.png"
    assert inspect.main(["decode", cache, "--n", "2", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "filmstrip" in report["header"] and report["n"] == 2
    from PIL import Image

    sheet = Image.open(out)
    plain = tmp_path / "pairs.png"
    assert inspect.main(["decode", str(caches["plain"]), "--n", "2", "--out", str(plain)]) == 0
    # one strip per sample: original + observed + 2 predicted tiles, twice as wide as original + decoded
    assert sheet.width > 1.8 * Image.open(plain).width


def test_a_cache_made_with_other_rollout_settings_is_refused_by_name(caches, tmp_path, capsys):
    cache = str(caches["rolled"])
    code = inspect.main(["compare-live", cache, "--n", "1", "--set", "world.rollout.prompt=A red car drives away."])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "world.prompt" in err, err
    assert inspect.main(["compare-live", cache, "--n", "1", "--set", "world.num_world_steps=0"]) == 2
    assert "world" in capsys.readouterr().err
    # a rerun into the cache's folder with another prompt: refused, naming the field
    out = tmp_path / "c"
    shutil.copytree(caches["rolled"], out)
    args = cli_args(out, *ROLL, "world.rollout.guidance_scale=3.0", n=N, shard=SHARD)
    assert cosmos_latents.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "fingerprint.world.guidance_scale" in err, err


def _one_line_exit_2(capsys, args, *words) -> None:
    assert cosmos_latents.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and all(w in err for w in words), err


def test_bad_rollout_input_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "c"
    _one_line_exit_2(capsys, cli_args(out, "world.num_world_steps=17"), "world.num_world_steps", "16")
    _one_line_exit_2(capsys, cli_args(out, *ROLL, "world.rollout.prompt="), "world.rollout.prompt", "empty")
    _one_line_exit_2(capsys, cli_args(out, *ROLL, "world.rollout.prompt=' '"), "world.rollout.prompt")
    _one_line_exit_2(capsys, cli_args(out, *ROLL, "world.rollout.inference_steps=0"), "inference_steps")
    _one_line_exit_2(capsys, cli_args(out, *ROLL, res=40), "image.resolution", "16")
    _one_line_exit_2(capsys, cli_args(out, *ROLL, "cache.flip=true"), "cache.flip")
    # a model.vae folder holding the VAE alone: no Video2World transformer
    vae_only = tmp_path / "vae-only"
    shutil.copytree(tiny.ensure(tiny.TINY_VAE_DIR), vae_only)
    _one_line_exit_2(capsys, cli_args(out, *ROLL, f"model.vae={vae_only}"), "no Video2World transformer")
    _one_line_exit_2(capsys, [*cli_args(out, *ROLL, f"model.vae={vae_only}"), "--plan"], "no Video2World transformer")
    # a pipeline folder whose transformer is another kind (a Wan text-to-video pipeline): refused before any weights
    other = tmp_path / "wan-pipeline"
    shutil.copytree(tiny.ensure(tiny.TINY_ROLLOUT_DIR), other)
    shutil.copytree(tiny.ensure(tiny.TINY_VAE_DIR), other / "vae")
    config = json.loads((other / "transformer" / "config.json").read_text())
    (other / "transformer" / "config.json").write_text(json.dumps({**config, "_class_name": "WanTransformer3DModel"}))
    _one_line_exit_2(capsys, cli_args(out, *ROLL, f"model.vae={other}"), "no Video2World transformer", "Wan")
    from diffusers.utils import is_torchvision_available

    if not is_torchvision_available():  # the real transformer's padding mask goes through torchvision
        config["concat_padding_mask"] = True
        (other / "transformer" / "config.json").write_text(json.dumps(config))
        _one_line_exit_2(capsys, cli_args(out, *ROLL, f"model.vae={other}"), "pip install torchvision")
    assert not (out / "shards").exists()


def test_a_pipeline_other_than_the_tiny_one_needs_the_guardrail(tmp_path, capsys):
    from diffusers.utils import is_cosmos_guardrail_available

    pipeline = tmp_path / "pipeline"
    shutil.copytree(tiny.ensure(tiny.TINY_ROLLOUT_DIR), pipeline)
    shutil.copytree(tiny.ensure(tiny.TINY_VAE_DIR), pipeline / "vae")
    if is_cosmos_guardrail_available():  # then the guardrail runs: the tiny pipeline's prompt is harmless
        assert cosmos_latents.main(cli_args(tmp_path / "c", *ROLL, f"model.vae={pipeline}", n=2)) == 0
        return
    _one_line_exit_2(capsys, cli_args(tmp_path / "c", *ROLL, f"model.vae={pipeline}"), "pip install cosmos_guardrail")


def test_the_plan_counts_rollout_bytes_and_time(tmp_path):
    from precompute import sizing

    plain = sizing.estimate(make_cfg(tmp_path / "c", n=8))
    rolled = sizing.estimate(make_cfg(tmp_path / "c", *ROLL, n=8))
    assert rolled["bytes_per_sample"]["latent"] > 2.5 * plain["bytes_per_sample"]["latent"] - 2048
    assert rolled["rollout"]["world_steps"] == STEPS and rolled["rollout"]["transformer_passes_per_sample"] == 4
    assert rolled["gpu_hours"] >= plain["gpu_hours"] and "rollout" not in plain
    # the real config: 3 latent frames of 64 x 64 at 512 px, 35 steps x 2 (guidance) passes, offline
    from precompute.config import PrecomputeConfig
    from theworld.core.config import load_config

    real = load_config(
        PrecomputeConfig,
        "configs/real/precompute_rollout.yaml",
        ["source.type=synthetic", "source.path=null", "source.num_samples=1000"],
    )
    plan = sizing.estimate(real)
    assert plan["rollout"]["latent_frames"] == 3 and plan["rollout"]["transformer_passes_per_sample"] == 70
    assert plan["rollout"]["seconds_per_sample"] > 0.1
    assert "rollouts: 70 transformer passes" in sizing.report(plan)


@pytest.mark.slow
def test_the_rollout_benchmark_measures_both_steps():
    """tools.speed_precompute --cases rollout at 2 denoising steps: figures present and sane (speed is not tested)."""
    from tools import speed_precompute as bench

    row = bench.bench_rollout(4, repeats=1, inference_steps=2)
    assert row["rollouts_per_s"] > 0 and row["world_steps"] == STEPS and row["inference_steps"] == 2
    assert 0 < row["step_ratio_cached_to_live"] < 1  # a live step rolls out: it is the slower one
    assert row["live_step_ms"] > row["cached_step_ms"] > 0


def test_a_mean_only_rollout_cache_keeps_every_frames_mean_and_no_logvar(caches, tmp_path):
    out = tmp_path / "mean"
    m = pipeline.run(make_cfg(out, *ROLL, "cache.latents=mean", n=2, shard=SHARD))
    assert m["contents"]["latents"] == "mean" and m["contents"]["world_steps"] == STEPS
    full = latents(caches["rolled"])
    for key, members in read_cache_plain(out).items():
        t = st_load(members["latent.safetensors"])
        assert set(t) == {"mean"} and t["mean"].shape == (16, 1 + STEPS, 4, 4)
        torch.testing.assert_close(t["mean"], full[key], rtol=0, atol=1e-5)


def test_world_steps_at_inference_stay_within_the_trained_table():
    trained = WorldConfig(num_world_steps=2, max_world_steps=4)
    assert rollout.at_inference(trained, 4, "runs/x").num_world_steps == 4
    assert rollout.at_inference(trained, 1, "runs/x").max_world_steps == 4
    for steps in (0, 5):
        with pytest.raises(UserError, match=r"--world-steps: must be in \[1, 4\]"):
            rollout.at_inference(trained, steps, "runs/x")
    with pytest.raises(UserError, match="trained without world rollouts"):
        rollout.at_inference(WorldConfig(), 1, "runs/x")
    line = rollout.steps_line(2, 4)
    assert "2 predicted latent frame(s)" in line and "1 + 4 x 2 = 9 video frames" in line and ": 8 there" in line
