"""LoRA stages (config `lora`, theworld/model/lora.py, theworld/export.py): what trains and what is saved, peft reading
the
adapter folder, the merged export read by plain transformers and by TheWorld without peft, init_from merging into a
full fine-tune, DDP and FSDP over two processes equal to one, kill -9 + resume bitwise, and every refusal."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, base_args, fixed_inputs, fork2, kill_9_once, metrics, run2, train_inproc, weights

# stage 3 as configs/real/stage3_lora.yaml runs it: the vision tower trains whole, the language model through LoRA
LORA3 = {"freeze.vision": "false", "lora.r": 4, "lora.alpha": 8}
TEXT_IDS = torch.arange(2, 14).unsqueeze(0)  # any tokens of the tiny vocabulary


def lm_logits(gemma, ids=TEXT_IDS) -> torch.Tensor:
    """The language model alone on text tokens: what a peft adapter folder or a merged Gemma must reproduce."""
    with torch.no_grad():
        return gemma.eval()(input_ids=ids).logits


def world_logits(model, processor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(fixed_inputs(model, processor), return_logits=True).logits


@pytest.fixture(scope="module")
def lora_run(cache, tmp_path_factory):
    """3 steps of LoRA stage 3 in one process, with EMA, lr_multipliers, gradient checkpointing and dropout on."""
    out = tmp_path_factory.mktemp("lora") / "run"
    extra = {
        **LORA3,
        "train.optimizer.ema": 0.9,
        "train.optimizer.lr_multipliers.language": 2.0,
        "train.hardware.gradient_checkpointing": "true",
        "lora.dropout": 0.1,
        "train.checkpoint.every": 2,
    }
    assert train_inproc(base_args(cache, out, steps=3, **extra)) == 0
    return out


def test_a_lora_stage_saves_only_what_trained(lora_run):
    w = weights(lora_run)
    language = [k for k in w if k.startswith("gemma.model.language_model.")]
    assert language and all(".lora_A.default." in k or ".lora_B.default." in k for k in language)
    assert not any("base_layer" in k or k.startswith("gemma.lm_head") for k in w)
    assert any(k.startswith("projector.") for k in w) and any(k.startswith("gemma.model.vision_tower.") for k in w)
    # 7 projections of 1 tiny layer, A and B each; B starts at zero, so a nonzero B is what training did
    bs = [k for k in language if ".lora_B." in k]
    assert len(bs) == 7 and all(w[k].abs().max() > 0 for k in bs)
    assert all(t.dtype == torch.float32 for t in w.values())
    ckpt = load_file(str(lora_run / "checkpoint-2" / "trainable.safetensors"))
    ema = load_file(str(lora_run / "final" / "ema.safetensors"))
    assert ckpt.keys() == w.keys() == ema.keys()
    card = (lora_run / "final" / "README.md").read_text()
    assert "language (LoRA r 4)" in card


def test_peft_reads_the_final_folder_as_an_adapter_of_the_base_gemma(lora_run):
    from peft import PeftModel

    from theworld.model.encoders import load_gemma
    from theworld.model.world import TheWorld

    model, _ = TheWorld.from_pretrained(lora_run, device="cpu")
    base, _ = load_gemma("tiny", "float32")
    peft_model = PeftModel.from_pretrained(base, str(lora_run / "final"))
    # the vision tower trained whole (not part of the adapter): compare the language model on text
    ours, theirs = lm_logits(model.gemma), lm_logits(peft_model)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (ours - lm_logits(load_gemma("tiny", "float32")[0])).abs().max() > 1e-4  # the adapters change it


def test_merged_export_is_a_plain_gemma_and_a_theworld_folder_without_peft(lora_run, tmp_path, monkeypatch):
    from transformers import Gemma3ForConditionalGeneration

    from theworld import export
    from theworld.model.world import TheWorld

    adapter_model, processor = TheWorld.from_pretrained(lora_run, device="cpu")
    want_lm, want = lm_logits(adapter_model.gemma), world_logits(adapter_model, processor)
    out = tmp_path / "merged"
    assert export.main(["--model", str(lora_run), "--merge", "--out", str(out)]) == 0
    plain = Gemma3ForConditionalGeneration.from_pretrained(out)
    assert not any("lora" in n or "base_layer" in n for n, _ in plain.named_parameters())
    torch.testing.assert_close(lm_logits(plain), want_lm, rtol=0, atol=1e-5)
    monkeypatch.setitem(sys.modules, "peft", None)  # any import of peft now fails
    merged, merged_processor = TheWorld.from_pretrained(out, device="cpu")
    torch.testing.assert_close(world_logits(merged, merged_processor), want, rtol=0, atol=1e-5)
    assert (out / "prompt.txt").read_text() == (lora_run / "final" / "prompt.txt").read_text()
    assert set(load_file(str(out / "trainable.safetensors"))) == {
        k for k in weights(lora_run) if k.startswith("projector.")
    }


def test_init_from_a_lora_stage_into_a_full_fine_tune_merges_first(lora_run):
    from theworld.model.config import FreezeConfig, ModelConfig, WorldConfig
    from theworld.model.world import TheWorld
    from train.state import checkpoint

    adapter_model, _ = TheWorld.from_pretrained(lora_run, device="cpu")
    full, _ = TheWorld.from_config(
        ModelConfig(dtype="float32"), WorldConfig(), FreezeConfig(vision=False, language=False)
    )
    report = checkpoint.init_from(full, lora_run / "final")
    assert report.merged == 7 and not report.ignored
    assert "LoRA adapters of 7 layers merged" in checkpoint.describe_init(lora_run / "final", report)
    torch.testing.assert_close(lm_logits(full.gemma), lm_logits(adapter_model.gemma), rtol=0, atol=1e-5)
    assert all(p.requires_grad for n, p in full.named_parameters() if n.startswith("gemma.model.language_model."))


def test_evaluate_reads_a_lora_stage(lora_run, tmp_path, capsys):
    from theworld import evaluate
    from theworld.infer import benchmark_items

    items = tmp_path / "mc.jsonl"
    benchmark_items.make_synthetic(items, 4)
    assert evaluate.main(["--model", str(lora_run), "--data", str(items), "--json"]) == 0
    assert '"n": 4' in capsys.readouterr().out


@pytest.mark.parametrize(
    "value,key",
    [
        ("lora.parts=[language,audio]", "lora.parts"),
        ("lora.parts=[]", "lora.parts"),
        ("lora.r=0", "lora.r"),
        ("lora.alpha=0", "lora.alpha"),
        ("lora.dropout=1.0", "lora.dropout"),
        ("lora.target_modules=[out_proj]", "lora.target_modules"),  # a SigLIP name, with only the language part
        ("lora.target_modules=[qproj]", "lora.target_modules"),
        ("freeze.language=false", "freeze.language"),
        ("lora.quantize=4bit", "lora.quantize"),
    ],
)
def test_bad_lora_config_is_a_one_line_error_before_any_load(capsys, value, key):
    args = ["--config", str(ROOT / "configs" / "stage3_lora.yaml"), "--set", value, "--set", "cache_dir=/nonexistent"]
    assert train_inproc(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err


def test_a_lora_stage_without_peft_installed_says_so(lora_run, tmp_path, monkeypatch, capsys):
    from theworld import describe
    from theworld.embedded import synthetic

    image = tmp_path / "scene.png"
    synthetic.scene(0, 0)[0].save(image)
    monkeypatch.setitem(sys.modules, "peft.tuners.lora", None)  # as if peft were not installed
    assert describe.main(["--model", str(lora_run), "--image", str(image)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "peft, which is not installed" in err[-1]


def test_qlora_without_cuda_says_so(monkeypatch):
    from theworld.core.errors import UserError
    from theworld.model.config import LoraConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        LoraConfig(quantize="4bit")


def test_export_refusals(lora_run, tmp_path, capsys):
    from theworld import export

    assert export.main(["--model", str(lora_run), "--out", str(tmp_path / "a")]) == 2
    assert "--merge" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mine.txt").write_text("keep")
    assert export.main(["--model", str(lora_run), "--merge", "--out", str(tmp_path / "b")]) == 2
    assert "not an empty folder" in capsys.readouterr().err and (tmp_path / "b" / "mine.txt").read_text() == "keep"
    assert export.main(["--model", str(tmp_path / "none"), "--merge", "--out", str(tmp_path / "c")]) == 2
    assert not (tmp_path / "c").exists()


def test_init_from_lora_adapters_without_their_config_is_refused(lora_run, tmp_path):
    from theworld.core.errors import UserError
    from theworld.model.config import FreezeConfig, ModelConfig, WorldConfig
    from theworld.model.world import TheWorld
    from train.state import checkpoint

    lone = tmp_path / "weights.safetensors"
    lone.write_bytes((lora_run / "final" / "trainable.safetensors").read_bytes())
    full, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), FreezeConfig(language=False))
    with pytest.raises(UserError, match="LoRA adapters but there is no config.yaml"):
        checkpoint.init_from(full, lone)


# ----------------------------------------------------------------------------------------------------------------------
# Whole runs over two processes


# FSDP with host offload as the accelerate launch configuration asks for it (FSDP_OFFLOAD_PARAMS; the one-process run
# through train.hardware.cpu_offload, sharded over a group of one) and the first evaluation at step 0, before any
# training forward: the caption samples run the model's parts (embeddings, the world block, generation) with LoRA
# adapters under host offload before the eval loss runs its root forward. Dropout off: its masks are drawn per
# process, so only without it do 1 and 2 processes draw the same.
LORA_FSDP = {
    **LORA3,
    "lora.dropout": 0.0,
    "train.hardware.sharding": "fsdp",
    "train.eval.every": 2,
    "train.eval.captions": 2,
    "train.eval.caption_tokens": 4,
    "train.eval.samples": 8,
}


@pytest.fixture(scope="module")
def lora_fsdp_runs(cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_fsdp")
    one = {**LORA_FSDP, "train.hardware.cpu_offload": "true"}
    assert train_inproc(base_args(cache, root / "one", steps=3, **one)) == 0
    two = run2(base_args(cache, root / "two", steps=3, **LORA_FSDP), env={"FSDP_OFFLOAD_PARAMS": "true"})
    assert two.returncode == 0, two.stderr[-3000:]
    return {"root": root, "two": two.stderr}


@pytest.mark.slow
def test_lora_fsdp_two_processes_give_the_weights_of_one(lora_fsdp_runs):
    root, err = lora_fsdp_runs["root"], lora_fsdp_runs["two"]
    assert "sharding fsdp (FSDP2 fully_shard" in err and "offloaded to host memory" in err
    w1, w2 = weights(root / "one"), weights(root / "two")
    assert w1.keys() == w2.keys() and any(".lora_B." in k for k in w1)
    for k in [k for k in w1 if not k.endswith("k_proj.bias")]:  # (softmax ignores key biases: rounding noise)
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-5)
    assert (
        load_file(str(root / "two" / "final" / "adapter_model.safetensors")).keys()
        == load_file(str(root / "one" / "final" / "adapter_model.safetensors")).keys()
    )


@pytest.mark.slow
def test_lora_fsdp_two_processes_evaluate_with_samples_at_step_0_as_one_process(lora_fsdp_runs):
    root = lora_fsdp_runs["root"]
    evals = [[m for m in metrics(root / d) if "eval_loss" in m] for d in ("one", "two")]
    assert [m["step"] for m in evals[1]] == [0, 2, 3] == [m["step"] for m in evals[0]]
    for e1, e2 in zip(*evals):
        assert e1["eval_loss"] == pytest.approx(e2["eval_loss"], rel=1e-5)
        assert e1["eval_loss_shuffled_world"] == pytest.approx(e2["eval_loss_shuffled_world"], rel=1e-5)
    samples = [[m["samples"] for m in metrics(root / d) if "samples" in m] for d in ("one", "two")]
    assert len(samples[1]) == 3 and samples[0] == samples[1]  # the same greedy captions at steps 0, 2 and 3


@pytest.mark.slow
def test_lora_ddp_two_processes_give_the_weights_losses_and_ema_of_one(cache, tmp_path):
    """As configs/real/stage3_lora.yaml trains (DDP, gradient checkpointing, an eval with caption samples before the
    first step and at the end); dropout off: its masks are per process."""
    extra = {
        **LORA3,
        "lora.dropout": 0.0,
        "train.hardware.sharding": "ddp",
        "train.hardware.gradient_checkpointing": "true",
    }
    extra |= {
        "train.optimizer.ema": 0.9,
        "train.eval.every": 3,
        "train.eval.captions": 2,
        "train.eval.caption_tokens": 4,
    }
    assert train_inproc(base_args(cache, tmp_path / "one", steps=3, **extra)) == 0
    two = run2(base_args(cache, tmp_path / "two", steps=3, **extra))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "sharding ddp (replicated)" in two.stderr and "2 process(es)" in two.stderr
    for name in ("trainable.safetensors", "ema.safetensors"):
        a, b = (load_file(str(tmp_path / d / "final" / name)) for d in ("one", "two"))
        assert a.keys() == b.keys() and any(".lora_B." in k for k in a), name
        for k in [k for k in a if not k.endswith("k_proj.bias")]:  # (softmax ignores key biases: rounding noise)
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5, msg=f"{name}: {k}")
    l1, l2 = ([m["loss"] for m in metrics(tmp_path / d) if "loss" in m] for d in ("one", "two"))
    assert len(l1) == 3 and l2 == pytest.approx(l1, rel=1e-5)
    e1, e2 = ([(m["step"], m["eval_loss"]) for m in metrics(tmp_path / d) if "eval_loss" in m] for d in ("one", "two"))
    assert [s for s, _ in e1] == [s for s, _ in e2] == [0, 3]
    assert [loss for _, loss in e2] == pytest.approx([loss for _, loss in e1], rel=1e-5)
    assert [m["step"] for m in metrics(tmp_path / "two") if "samples" in m] == [0, 3]


@pytest.mark.slow
def test_lora_fsdp_kill_9_and_resume_gives_bitwise_equal_weights(cache, tmp_path):
    """Dropout on: its masks are a function of (seed, step, rank), so the resumed run draws the killed run's."""
    extra = {
        **LORA3,
        "lora.dropout": 0.1,
        "train.hardware.sharding": "fsdp",
        "train.checkpoint.every": 2,
        "train.optimizer.ema": 0.9,
    }
    ref = run2(base_args(cache, tmp_path / "ref", steps=4, **extra))
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "killed"
    proc = fork2(base_args(cache, out, steps=4, **extra), tmp_path / "logs")
    kill_9_once(proc, lambda: (out / "checkpoint-2").exists())  # both processes
    assert (out / "checkpoint-2").exists() and not (out / "final").exists(), "not killed between save and end"
    resumed = run2(base_args(cache, out, steps=4, **extra))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    for name in ("trainable.safetensors", "ema.safetensors", "adapter_model.safetensors"):
        a, b = (load_file(str(d / "final" / name)) for d in (tmp_path / "ref", out))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_memory_plan_counts_lora_exactly_and_the_real_lora_stage_fits_one_gpu():
    from theworld.core.config import load_config
    from theworld.model import lora
    from tools import memory_plan as memory
    from train import components
    from train.config import TrainConfig

    cfg = load_config(TrainConfig, str(ROOT / "configs" / "stage3_lora.yaml"))
    model, _ = components.build_model(cfg)  # from_pretrained of the tiny models, adapters injected
    params = dict(model.named_parameters())
    plan = memory.estimate(cfg, gpus=1, gpu_memory_gib=80)
    assert plan["trainable_params"] == sum(p.numel() for p in params.values() if p.requires_grad)
    assert plan["lora"]["params"] == lora.count(model) > 0
    no_dropout = memory.estimate(
        load_config(TrainConfig, str(ROOT / "configs" / "stage3_lora.yaml"), ["lora.dropout=0"]),
        gpus=1,
        gpu_memory_gib=80,
    )
    assert no_dropout["per_gpu_bytes"]["ddp"]["activations"] < plan["per_gpu_bytes"]["ddp"]["activations"]
    real = memory.estimate(
        load_config(TrainConfig, str(ROOT / "configs" / "real" / "stage3_lora.yaml")), gpus=1, gpu_memory_gib=80
    )
    assert real["fits"]["ddp"] and real["lora"]["params"] == 29_802_496  # r 16 on Gemma 3 4B's 7 projections


def test_init_from_a_full_fine_tune_into_a_lora_stage_fills_the_frozen_base_layers(tmp_path):
    from theworld.model.config import FreezeConfig, LoraConfig, ModelConfig, WorldConfig
    from theworld.model.world import TheWorld
    from train.state import checkpoint

    full, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), FreezeConfig(language=False))
    name = "gemma.model.language_model.layers.0.self_attn.q_proj.weight"
    with torch.no_grad():
        dict(full.named_parameters())[name].add_(1.0)  # as if stage 3 had trained it
    full.save_trainable(tmp_path / "trainable.safetensors")
    adapted, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), FreezeConfig(), lora=LoraConfig())
    report = checkpoint.init_from(adapted, tmp_path / "trainable.safetensors")
    base = dict(adapted.named_parameters())[name.replace("q_proj.", "q_proj.base_layer.")]
    assert torch.equal(base, dict(full.named_parameters())[name]) and not base.requires_grad
    assert not report.ignored
