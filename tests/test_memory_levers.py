"""Memory levers for real sizes (issue 33 item 2): activation checkpointing (none | full | selective, every_n, parts)
of the language model, the vision tower and the VAE encoder gives the gradients it gives without, and really
recomputes; big-model dispatch (`TheWorld.from_pretrained(device_map=...)`) gives the logits of a plain load."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from theworld import device_map, encoders, gemma3, images, synthetic
from theworld.arch import CHECKPOINT_PARTS
from theworld.config import FreezeConfig, WorldConfig, from_dict, load_config, to_dict, to_yaml
from theworld.errors import UserError
from theworld.inputs import text_batch
from theworld.model import TheWorld
from theworld.text import ChatFormatter
from train.config import TrainConfig, run_hash

CAPTIONS = ["top left red circle .", "top right blue square . bottom left green cross ."]
ROOT = Path(__file__).resolve().parents[1]
LAYERS = 3  # per stack: every_n 2 then wraps layers 0 and 2 and leaves 1 alone


@pytest.fixture(scope="module")
def parts():
    """The tiny Gemma 3 with LAYERS decoder and SigLIP layers (seeded), its processor and the tiny VAE, in fp32."""
    from transformers import Gemma3ForConditionalGeneration

    base, processor = encoders.load_gemma("tiny", "float32")
    config = copy.deepcopy(base.config)
    config.text_config.num_hidden_layers = config.vision_config.num_hidden_layers = LAYERS
    config.text_config.layer_types = gemma3.layer_types(LAYERS)
    torch.manual_seed(0)
    gemma = Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():  # zero-initialised in a random model: the image tokens would carry nothing back
        gemma.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.05)
    return gemma, processor, encoders.load_vae("tiny", "float32")


def world(parts, freeze: FreezeConfig) -> TheWorld:
    gemma, processor, vae = parts
    model = TheWorld.from_modules(copy.deepcopy(gemma), copy.deepcopy(vae), WorldConfig(), freeze, seed=0)
    model.processor = processor
    model.cast_trainable_to_fp32()
    return model.train()


def batch(model: TheWorld):
    """Captions with live inputs: the VAE encodes the pictures, SigLIP reads their pixels."""
    fmt = ChatFormatter(model.processor)
    scenes = [synthetic.scene(0, i)[0] for i in range(len(CAPTIONS))]
    return text_batch([fmt.encode(synthetic.PROMPT, c) for c in CAPTIONS], fmt.pad_id).with_inputs(
        images=torch.stack([images.to_uint8_tensor(s) for s in scenes]),
        pixel_values=torch.stack([images.siglip_pixels(model.processor.image_processor, s) for s in scenes]),
    )


class OpCounts(TorchDispatchMode):
    """Counts the aten ops that run (forward, recomputation and backward): an op selective checkpointing keeps is
    not run again, one it recomputes is."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def step(model: TheWorld, inputs) -> tuple[dict[str, torch.Tensor], Counter]:
    """One training step's gradients of every trainable parameter, and the ops it ran."""
    model.zero_grad(set_to_none=True)
    with OpCounts() as ops:
        model(inputs).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return grads, ops.counts


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


UNFROZEN = FreezeConfig(vision=False, language=False, vae=False)  # stage 4: every part trains


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_every_part_gives_the_same_gradients_and_recomputes(parts, mode):
    model = world(parts, UNFROZEN)
    inputs = batch(model)
    base, ops_off = step(model, inputs)
    assert {n.split(".")[0] for n in base} == {"gemma", "world_encoder", "projector"}
    assert all(g.abs().sum() > 0 for n, g in base.items() if ".layers.0." in n or "down_blocks.0." in n)
    wrapped = model.activation_checkpointing(mode, 1, ["language", "vision", "vae"])
    vae_blocks = len(model.world_encoder.vae.encoder.down_blocks) + 1  # and the mid block
    assert wrapped == {"language": LAYERS, "vision": LAYERS, "vae": vae_blocks}
    grads, ops_on = step(model, inputs)
    assert_same(base, grads)
    # the cheap ops (norms, activations) run again in the backward either way; matmuls and convolutions only in full
    assert ops_on["rsqrt"] > ops_off["rsqrt"] and ops_on["gelu"] > ops_off["gelu"]
    recomputed = lambda op: ops_on[op] - ops_off[op]  # noqa: E731
    if mode == "full":
        assert recomputed("convolution") > 0 and recomputed("mm") + recomputed("addmm") > 0
    else:
        assert recomputed("convolution") == 0 and recomputed("mm") == recomputed("addmm") == recomputed("bmm") == 0
    model.activation_checkpointing("none")
    grads, ops_none = step(model, inputs)
    assert_same(base, grads)
    assert ops_none == ops_off  # none: nothing recomputed any more


def test_every_n_and_parts_wrap_only_what_they_name(parts):
    model = world(parts, UNFROZEN)
    inputs = batch(model)
    base, _ = step(model, inputs)
    calls = Counter()
    hooks = [
        layer.mlp.register_forward_hook(lambda m, i, o, k=f"language{idx}": calls.update([k]))
        for idx, layer in enumerate(model.gemma.model.language_model.layers)
    ]
    hooks += [
        layer.mlp.register_forward_hook(lambda m, i, o, k=f"vision{idx}": calls.update([k]))
        for idx, layer in enumerate(model.gemma.model.vision_tower.encoder.layers)
    ]
    assert model.activation_checkpointing("full", 2, ["language"]) == {"language": 2, "vision": 0, "vae": 0}
    grads, _ = step(model, inputs)
    for h in hooks:
        h.remove()
    assert_same(base, grads)
    # layers 0 and 2 of the language model ran twice (forward, recomputation), layer 1 and every vision layer once
    assert calls == {"language0": 2, "language1": 1, "language2": 2, "vision0": 1, "vision1": 1, "vision2": 1}


def test_the_earlier_switch_wraps_both_gemma_stacks_fully(parts):
    model = world(parts, FreezeConfig(language=False))
    inputs = batch(model)
    base, ops_off = step(model, inputs)
    model.gradient_checkpointing(True)
    assert [layer.gradient_checkpointing for layer in model.gemma.model.language_model.layers] == [True] * LAYERS
    assert [layer.gradient_checkpointing for layer in model.gemma.model.vision_tower.encoder.layers] == [True] * LAYERS
    grads, ops_on = step(model, inputs)
    assert_same(base, grads)
    assert ops_on["mm"] + ops_on["addmm"] > ops_off["mm"] + ops_off["addmm"]
    model.gradient_checkpointing(False)
    assert not any(layer.gradient_checkpointing for layer in model.gemma.model.language_model.layers)


# ----------------------------------------------------------------------------------------------------------------------
# train.hardware.activation_checkpointing: the config


def _train(*sets: str) -> TrainConfig:
    return load_config(TrainConfig, None, list(sets))


def test_config_reads_the_earlier_switch_and_refuses_disagreement():
    assert vars(_train().train.hardware.activation_checkpointing) == {
        "mode": "none",
        "every_n": 1,
        "parts": list(CHECKPOINT_PARTS),
    }
    legacy = _train("train.hardware.gradient_checkpointing=true").train.hardware
    assert vars(legacy.activation_checkpointing) == {"mode": "full", "every_n": 1, "parts": ["language", "vision"]}
    assert legacy.gradient_checkpointing is None  # said once: the saved config reloads
    assert _train("train.hardware.gradient_checkpointing=false").train.hardware.activation_checkpointing.mode == "none"
    both = _train("train.hardware.gradient_checkpointing=true", "train.hardware.activation_checkpointing.mode=full")
    assert both.train.hardware.activation_checkpointing.parts == list(CHECKPOINT_PARTS)
    # a mode alone; a section without a mode is on (full)
    selective = _train("train.hardware.activation_checkpointing=selective").train.hardware
    assert selective.activation_checkpointing.mode == "selective"
    every = _train("train.hardware.activation_checkpointing={every_n: 2}").train.hardware.activation_checkpointing
    assert (every.mode, every.every_n) == ("full", 2)
    assert (
        _train("train.hardware.activation_checkpointing.parts=[vae]").train.hardware.activation_checkpointing.mode
        == "full"
    )
    for sets, words in (
        (
            ["train.hardware.gradient_checkpointing=true", "train.hardware.activation_checkpointing.mode=selective"],
            "disagree",
        ),
        (
            ["train.hardware.gradient_checkpointing=false", "train.hardware.activation_checkpointing.mode=full"],
            "disagree",
        ),
        (["train.hardware.activation_checkpointing.mode=some"], "train.hardware.activation_checkpointing.mode"),
        (["train.hardware.activation_checkpointing.every_n=0"], "train.hardware.activation_checkpointing.every_n"),
        (
            ["train.hardware.activation_checkpointing.parts=[language, projector]"],
            "train.hardware.activation_checkpointing.parts",
        ),
        (["train.hardware.activation_checkpointing.parts=[vae, vae]"], "train.hardware.activation_checkpointing.parts"),
        (["train.hardware.activation_checkpointing.speed=1"], "train.hardware.activation_checkpointing.speed"),
        (["train.hardware.activation_checkpointing=fast"], "'fast' is not a mode (none, full, selective)"),
        (["train.hardware.activation_checkpointing={mode: none, every_n: 2}"], "with mode none checkpoints nothing"),
        (["train.hardware.activation_checkpointing=full", "train.hardware.gradient_checkpointing=false"], "disagree"),
    ):
        with pytest.raises(UserError) as e:
            _train(*sets)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_saved_configs_of_either_form_reload_and_the_setting_is_resume_neutral(tmp_path):
    old = _train("train.hardware.gradient_checkpointing=true")
    new = _train(
        "train.hardware.activation_checkpointing.mode=selective", "train.hardware.activation_checkpointing.every_n=2"
    )
    for cfg in (old, new):  # what a checkpoint's config.yaml holds, read back
        (tmp_path / "c.yaml").write_text(to_yaml(cfg))
        again = load_config(TrainConfig, tmp_path / "c.yaml")
        assert again.train.hardware.activation_checkpointing == cfg.train.hardware.activation_checkpointing
    # the math does not change: resuming under another setting is the same run, and a run of before keeps its hash
    assert run_hash(old) == run_hash(new) == run_hash(_train())
    legacy_false = to_dict(_train())
    legacy_false["train"]["hardware"]["gradient_checkpointing"] = False
    del legacy_false["train"]["hardware"]["activation_checkpointing"]
    assert run_hash(_train("train.hardware.gradient_checkpointing=false")) == run_hash(
        from_dict(TrainConfig, legacy_false)
    )


def test_training_builds_the_model_with_the_configured_checkpointing(parts):
    from train.components import ready_for_training

    cfg = _train(
        "train.hardware.activation_checkpointing.mode=selective", "train.hardware.activation_checkpointing.every_n=2"
    )
    model = ready_for_training(world(parts, UNFROZEN), cfg)
    flags = [layer.gradient_checkpointing for layer in model.gemma.model.language_model.layers]
    assert flags == [True, False, True]
    vae_wrapped = ["forward" in vars(b) for b in [*model.world_encoder.vae.encoder.down_blocks]]
    assert vae_wrapped[:3] == [True, False, True]
    twin = copy.deepcopy(model)  # a copy's wrapped blocks run the copy's weights
    block = twin.world_encoder.vae.encoder.down_blocks[0]
    assert block.forward.__self__ is block


# ----------------------------------------------------------------------------------------------------------------------
# device_map


def test_disk_offload_gives_the_logits_of_a_normal_load(trained_run, tmp_path):
    from conftest import fixed_inputs

    plain, processor = TheWorld.from_pretrained(trained_run["run"], device="cpu")
    inputs = fixed_inputs(plain, processor)
    with torch.no_grad():
        expected = plain(inputs, return_logits=True).logits
    for mapping in ("disk", {"gemma.model.language_model": "disk", "": "cpu"}):
        model, _ = TheWorld.from_pretrained(trained_run["run"], device_map=mapping, offload_folder=tmp_path / "off")
        offloaded = model.gemma.model.language_model.layers[0].mlp.up_proj.weight
        assert offloaded.device.type == "meta"  # its weights are read from the offload folder at each forward
        assert any((tmp_path / "off").iterdir()) and model.input_device == torch.device("cpu")
        with torch.no_grad():
            logits = model(inputs, return_logits=True).logits
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
        assert model.generate([synthetic.scene(3, 0)[0]], synthetic.PROMPT, max_new_tokens=3) == plain.generate(
            [synthetic.scene(3, 0)[0]], synthetic.PROMPT, max_new_tokens=3
        )
    with pytest.raises(UserError, match="'gemma.nope' is not a module of TheWorld"):
        device_map.resolve(plain, {"gemma.nope": "cpu"})


@pytest.mark.parametrize(
    "bad, words",
    [
        ("cuda:3", "device 'cuda:3' is not on this machine"),
        ("xpu", "device 'xpu' is not on this machine"),
        (5, "device '5' is not on this machine"),
        ({"gemma": "cuda:1", "": "cpu"}, "device_map['gemma']: device 'cuda:1' is not on this machine"),
        ({"gemma": "mps"}, "device 'mps'"),
        ({"gemma": True}, "not a device"),
        ("disk", "needs an offload_folder"),
        ({}, "empty"),
        (["cpu"], "a mapping of module names"),
    ],
)
def test_a_device_that_is_not_there_is_one_line_before_loading(bad, words, tmp_path):
    if torch.cuda.device_count() > 3:
        pytest.skip("this machine has the GPUs these names refer to")
    with pytest.raises(UserError) as e:
        TheWorld.from_pretrained(tmp_path / "no-such-stage", device_map=bad)  # refused before the folder is read
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_describe_and_evaluate_take_a_device_map(tmp_path, capsys):
    from theworld import describe, evaluate

    image = tmp_path / "a.png"
    synthetic.scene(0, 0)[0].save(image)
    assert describe.main(["--model", str(tmp_path), "--image", str(image), "--device-map", "cuda:7"]) == 2
    assert "device 'cuda:7' is not on this machine" in capsys.readouterr().err
    assert describe.main(["--model", str(tmp_path), "--image", str(image), "--device-map", '{"gemma": 1']) == 2
    assert "--device-map: not a JSON object" in capsys.readouterr().err
    argv = ["--model", str(tmp_path), "--data", str(tmp_path / "x.jsonl"), "--offload-folder", str(tmp_path)]
    assert evaluate.main(argv) == 2
    assert "--offload-folder needs --device-map" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# tools.memory_plan's columns


def _plan(capsys, *args: str) -> dict:
    from tools import memory_plan as memory

    assert memory.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_reports_each_lever_and_keeps_the_configured_estimate(capsys):
    from theworld.arch import REAL

    plan = _plan(capsys, "--config", str(ROOT / "configs" / "real" / "stage4.yaml"), "--gpus", "1")
    # the configured plan (gradient_checkpointing: true, the earlier switch) is the one the docs quote
    assert round(plan["per_gpu_bytes"]["ddp"]["total"] / 2**30, 2) == 105.57
    assert plan["config"]["activation_checkpointing"] == {"mode": "full", "every_n": 1, "parts": ["language", "vision"]}
    ac = plan["levers"]["activation_checkpointing"]
    assert list(ac) == ["none", "full", "full_every_2", "selective", "selective_every_2"]
    act = {k: v["activations"] for k, v in ac.items()}
    assert act["full"] < act["full_every_2"] < act["none"] and act["full"] < act["selective"] < act["none"]
    assert act["selective"] < act["selective_every_2"] < act["none"]
    # only activations move: every total differs from none's by the activation difference alone
    for k, v in ac.items():
        for mode in ("ddp", "fsdp", "fsdp_offload"):
            assert ac["none"]["total"][mode] - v["total"][mode] == act["none"] - act[k]
    # full on a stack of L layers keeps L inputs and one layer: the earlier formula, now with the VAE's blocks
    vae = plan["levers"]["vae_block_checkpointing"]
    assert vae["trains"] and vae["activations"]["full"] < vae["activations"]["selective"] < vae["activations"]["none"]
    configured = plan["per_gpu_bytes"]["ddp"]["activations"]  # language + vision full, the VAE not
    assert act["full"] == configured - (vae["activations"]["none"] - vae["activations"]["full"])
    assert not ac["none"]["fits"]["fsdp_offload"] and ac["full"]["fits"]["fsdp_offload"]
    w = plan["levers"]["weights_only_checkpoint"]
    assert w["saved_bytes"] == 8 * plan["trainable_params"] == w["checkpoint_bytes"] - w["weights_only_bytes"]
    # selective keeps each layer's input, q k v, attention, o_proj and the gated MLP's three matmuls
    t = REAL["text"]
    width = 3 * t["hidden_size"] + 2 * 8 * 256 + 2 * 4 * 256 + 2 * t["intermediate_size"]
    from tools.memory_plan import selective_width

    assert selective_width(_text_config(), "language") == width


def _text_config():
    from transformers import Gemma3TextConfig

    from theworld.arch import REAL

    return Gemma3TextConfig(**REAL["text"])


def test_memory_follows_the_configured_checkpointing(capsys):
    stage3 = ["--config", str(ROOT / "configs" / "real" / "stage3.yaml"), "--gpus", "2"]
    sel = _plan(
        capsys,
        *stage3,
        "--set",
        "train.hardware.gradient_checkpointing=null",
        "--set",
        "train.hardware.activation_checkpointing.mode=selective",
    )
    assert (
        sel["per_gpu_bytes"]["ddp"]["activations"]
        == sel["levers"]["activation_checkpointing"]["selective"]["activations"]
    )
    every = _plan(
        capsys,
        *stage3,
        "--set",
        "train.hardware.gradient_checkpointing=null",
        "--set",
        "train.hardware.activation_checkpointing.mode=full",
        "--set",
        "train.hardware.activation_checkpointing.every_n=2",
    )
    assert (
        every["per_gpu_bytes"]["fsdp"]["activations"]
        == every["levers"]["activation_checkpointing"]["full_every_2"]["activations"]
    )
    assert not every["levers"]["vae_block_checkpointing"]["trains"]  # stage 3: the VAE is frozen


@pytest.mark.slow
def test_training_runs_with_each_lever_reach_the_same_weights(cache, tmp_path):
    """Stage 4 (every part trains, the VAE encodes live) through train.loop: two optimizer steps with selective
    checkpointing on every part, and with full every 2nd layer, end where the run without checkpointing ends."""
    from conftest import base_args, metrics, train_inproc, weights

    stage4 = {"freeze.vision": "false", "freeze.language": "false", "freeze.vae": "false", "train.optimizer.lr": "1e-3"}
    runs = {}
    for name, sets in (
        ("none", {}),
        ("selective", {"train.hardware.activation_checkpointing": "selective"}),
        ("full_every_2", {"train.hardware.activation_checkpointing": "{mode: full, every_n: 2}"}),
    ):
        out = tmp_path / name
        assert train_inproc(base_args(cache, out, steps=2, **stage4, **sets)) == 0
        runs[name] = (weights(out), [m["loss"] for m in metrics(out) if "loss" in m])
    base, losses = runs.pop("none")
    assert any(n.startswith("world_encoder.") for n in base) and any(".language_model." in n for n in base)
    for name, (w, lo) in runs.items():
        assert lo == pytest.approx(losses, rel=1e-5), name
        for n, t in base.items():
            torch.testing.assert_close(w[n], t, rtol=1e-4, atol=1e-6, msg=f"{name}: {n}")


def per_layer_kept(text_sizes: dict, seq: int = 64) -> dict[str, float]:
    """Elements per token per hidden unit one Gemma 3 decoder layer keeps for the backward (bf16, SDPA), counted:
    without checkpointing, the tensors autograd saves (weights aside); selectively checkpointed, its input and the
    outputs of theworld.checkpointing.SAVE_OPS (what create_selective_checkpoint_contexts caches)."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RotaryEmbedding

    from theworld.checkpointing import SAVE_OPS

    config = Gemma3TextConfig(**{**text_sizes, "num_hidden_layers": 1}, layer_types=["sliding_attention"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = Gemma3DecoderLayer(config, 0).to(torch.bfloat16)
    h = config.hidden_size
    x = torch.randn(1, seq, h, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq)[None]
    rope = Gemma3RotaryEmbedding(config)(x, positions, layer_type="sliding_attention")
    weights = {p.data_ptr() for p in layer.parameters()}
    saved = {}

    def pack(t):
        if t.data_ptr() not in weights:
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=rope, attention_mask=None, position_ids=positions)

    class Kept(TorchDispatchMode):
        size = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in SAVE_OPS:
                outs = out if isinstance(out, (tuple, list)) else [out]
                self.size += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            return out

    with Kept() as kept:
        layer(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
    unit = seq * h * 2
    return {"none": sum(saved.values()) / unit, "selective": 1 + kept.size / unit}


def test_selective_width_counts_what_a_gemma_layer_keeps():
    """The plan's selective figure per layer against what a Gemma 3 decoder layer with Gemma 3 4B's proportions keeps
    (hidden / 4); and the constant for a layer without checkpointing is a lower bound (docs/training.md, "Memory
    levers": python -m pytest tests/test_memory_levers.py -k gemma_layer -s prints the counts)."""
    from transformers import Gemma3TextConfig

    from theworld.arch import REAL
    from tools.memory_plan import ACT_PER_TOKEN_LAYER, selective_width

    real = REAL["text"]
    sizes = {**real, "hidden_size": 640, "intermediate_size": 2560, "head_dim": 64, "query_pre_attn_scalar": 64}
    kept = per_layer_kept(sizes)
    print(f"per token per hidden unit: none {kept['none']:.1f}, selective {kept['selective']:.1f}")
    width = selective_width(Gemma3TextConfig(**sizes), "language") / sizes["hidden_size"]
    assert width == pytest.approx(kept["selective"], rel=0.05)
    assert kept["none"] > ACT_PER_TOKEN_LAYER and kept["selective"] < kept["none"] / 2
