"""Memory levers for real sizes (issue 33 item 2): activation checkpointing (none | full | selective, every_n, parts)
of the language model, the vision tower and the VAE encoder gives the gradients it gives without, and really
recomputes; big-model dispatch (`TheWorld.from_pretrained(device_map=...)`) gives the logits of a plain load."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import ROOT, weights
from theworld.core.config import from_dict, load_config, to_dict, to_yaml
from theworld.core.errors import UserError
from theworld.embedded import synthetic
from theworld.model import device_map, encoders, gemma3, images
from theworld.model.arch import CHECKPOINT_PARTS
from theworld.model.config import FreezeConfig, WorldConfig
from theworld.model.inputs import text_batch
from theworld.model.text import ChatFormatter
from theworld.model.world import TheWorld
from train.config import TrainConfig, run_hash

CAPTIONS = ["top left red circle .", "top right blue square . bottom left green cross ."]
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
    from tests.conftest import fixed_inputs

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
    from theworld.model.arch import REAL

    plan = _plan(capsys, "--config", str(ROOT / "configs" / "real" / "stage4.yaml"), "--gpus", "1")
    # the configured plan (gradient_checkpointing: true, the earlier switch) is the one the docs quote
    assert round(plan["per_gpu_bytes"]["ddp"]["total"] / 2**30, 2) == 110.86
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

    from theworld.model.arch import REAL

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
    from tests.conftest import base_args, metrics, train_inproc

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


def _layer(part: str, sizes: dict, attention: str = "sdpa"):
    """One transformers layer of `part` (a Gemma 3 decoder layer, a SigLIP encoder layer) and its config."""
    from transformers import Gemma3TextConfig, SiglipVisionConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer
    from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

    if part == "language":
        config = Gemma3TextConfig(**{**sizes, "num_hidden_layers": 1}, layer_types=["sliding_attention"])
    else:
        config = SiglipVisionConfig(**sizes)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return (Gemma3DecoderLayer(config, 0) if part == "language" else SiglipEncoderLayer(config)), config


def _compiled_saves(seq: int, x: torch.Tensor) -> tuple:
    """A torch.compile backend with inductor's decompositions and partition that records the bytes of the tensors
    its backward reads from the forward (not tangents; of the forward's inputs only the layer's own, `x`)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    saved = []

    def backward(gm, example_inputs):
        for node in gm.graph.find_nodes(op="placeholder"):
            v = node.meta.get("val")
            own_input = not node.name.startswith("primals") or (v.shape == x.shape and v.dtype == x.dtype)
            if isinstance(v, torch.Tensor) and seq in v.shape and not node.name.startswith("tangents") and own_input:
                saved.append(v.numel() * v.element_size())
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=backward,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    return backend, saved


def per_layer_kept(part: str, sizes: dict, p=None, seq: int = 48) -> dict[str, float]:
    """Bytes per token one layer keeps for the backward, counted, as train.loop runs it (tools.memory_plan.LayerRun
    `p`): weights in fp32 where they train (else in the stream's dtype), the input in the stream's dtype, autocast to
    bf16 where the compute dtype is bf16, a boolean mask for Gemma. `none`: the tensors autograd saves that hold a
    row per token (not weights or their autocast copies; not rotary cos/sin or the mask, which every layer shares),
    or under p.compiled those the compiled backward reads; `selective`: the input and the outputs of
    theworld.model.recompute.SAVE_OPS (what create_selective_checkpoint_contexts caches). `seq` is no size of the
    layer's, so a token row tells activations from weights."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from theworld.model.recompute import SAVE_OPS
    from tools.memory_plan import LayerRun

    p = p or LayerRun()
    layer, config = _layer(part, sizes, p.attention)
    dtypes = {2: torch.bfloat16, 4: torch.float32}
    layer.to(torch.float32 if p.train else dtypes[p.stream]).requires_grad_(p.train)
    if p.adapted:  # adapters' gradients need the inputs of the linear layers they sit on, not the norms' outputs
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.requires_grad_(True)
    x = torch.randn(1, seq, config.hidden_size, dtype=dtypes[p.stream], requires_grad=True)
    kwargs, shared = {"attention_mask": None}, set()
    if part == "language":
        positions = torch.arange(seq)[None]
        rope = Gemma3RotaryEmbedding(config)(x, positions, layer_type="sliding_attention")
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]  # training passes one (padding, images)
        kwargs = {"position_embeddings": rope, "attention_mask": mask, "position_ids": positions}
        shared |= {t.untyped_storage().data_ptr() for t in (*rope, mask)}
    shared |= {w.untyped_storage().data_ptr() for w in layer.parameters()}
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=p.compute == 2)
    if p.compiled:
        backend, compiled = _compiled_saves(seq, x)
        with autocast:
            out = torch.compile(layer, backend=backend)(x, **kwargs)
        out.float().sum().backward()  # the backward compiles here
        return {"none": sum(compiled) / seq}
    saved = {}

    def pack(t):
        if seq in t.shape and t.untyped_storage().data_ptr() not in shared:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        layer(x, **kwargs)

    class Kept(TorchDispatchMode):
        size = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in SAVE_OPS:
                outs = out if isinstance(out, (tuple, list)) else [out]
                self.size += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            return out

    with Kept() as kept, autocast:
        layer(x, **kwargs)
    return {"none": sum(saved.values()) / seq, "selective": config.hidden_size * p.stream + kept.size / seq}


GEMMA_SHAPES = {  # Gemma 3 4B's proportions (hidden / 4); a wide MLP with one kv head; no GQA, a narrow MLP
    "4b": {"hidden_size": 640, "intermediate_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4},
    "mqa": {"hidden_size": 512, "intermediate_size": 3072, "num_attention_heads": 4, "num_key_value_heads": 1},
    "mha": {"hidden_size": 384, "intermediate_size": 768, "num_attention_heads": 6, "num_key_value_heads": 6},
}
HEAD_DIMS = {"4b": 64, "mqa": 128, "mha": 32}
SIGLIP_SHAPES = {  # SigLIP So400m's proportions (hidden / 4); narrower heads, a wider MLP
    "so400m": {"hidden_size": 288, "intermediate_size": 1076, "num_attention_heads": 4},
    "wide": {"hidden_size": 256, "intermediate_size": 1536, "num_attention_heads": 8},
}


def _gemma_sizes(name: str) -> dict:
    d = HEAD_DIMS[name]
    return {**GEMMA_SHAPES[name], "head_dim": d, "query_pre_attn_scalar": d, "vocab_size": 64}


def _precisions():
    from tools.memory_plan import LayerRun

    return {  # stage 3/4 (bf16 autocast, fp32 weights and stream), stage 1/2 (frozen bf16), LoRA, all fp32
        "trains": LayerRun(),
        "frozen": LayerRun(stream=2, train=False),
        "lora": LayerRun(stream=2, train=False, adapted=True),
        "fp32": LayerRun(compute=4, stream=4),
    }


@pytest.mark.parametrize("shape", list(GEMMA_SHAPES))
@pytest.mark.parametrize("how", ["trains", "frozen", "lora", "fp32"])
def test_the_plan_counts_what_a_gemma_layer_keeps(shape, how):
    """The plan's bytes per token of a Gemma 3 decoder layer without checkpointing, and selectively checkpointed,
    against what one keeps (docs/training.md, "Memory levers": -s prints the counts)."""
    from transformers import Gemma3TextConfig

    from tools.memory_plan import gemma_layer_bytes, selective_width

    p, sizes = _precisions()[how], _gemma_sizes(shape)
    kept = per_layer_kept("language", sizes, p)
    config = Gemma3TextConfig(**sizes)
    h = sizes["hidden_size"]
    print(f"{shape} {how}: {kept['none'] / h:.1f} bytes per token per hidden unit")
    assert gemma_layer_bytes(config, p, seq=48) == pytest.approx(kept["none"], rel=0.01)
    if how == "trains":
        width = p.stream * h + p.compute * (selective_width(config, "language", p) - h)
        assert width == pytest.approx(kept["selective"], rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, how, attention, compiled",
    [
        ("4b", "trains", "sdpa", True),
        ("mqa", "frozen", "sdpa", True),
        ("mha", "trains", "sdpa", True),
        ("4b", "trains", "eager", False),
        ("mqa", "frozen", "eager", False),
    ],
)
def test_the_plan_counts_what_a_compiled_or_eager_attention_gemma_layer_keeps(shape, how, attention, compiled):
    """train.hardware.compile (the partition torch.compile's inductor makes: it recomputes norms and activations)
    and train.hardware.attention: eager (it keeps the softmax)."""
    import dataclasses

    from transformers import Gemma3TextConfig

    from tools.memory_plan import gemma_layer_bytes

    p = dataclasses.replace(_precisions()[how], attention=attention, compiled=compiled)
    kept = per_layer_kept("language", _gemma_sizes(shape), p)
    assert gemma_layer_bytes(Gemma3TextConfig(**_gemma_sizes(shape)), p, seq=48) == pytest.approx(
        kept["none"], rel=0.035
    )


@pytest.mark.parametrize("shape", list(SIGLIP_SHAPES))
@pytest.mark.parametrize("how", ["trains", "lora", "fp32"])
def test_the_plan_counts_what_a_siglip_layer_keeps(shape, how):
    from transformers import SiglipVisionConfig

    from tools.memory_plan import selective_width, siglip_layer_bytes

    p, sizes = _precisions()[how], SIGLIP_SHAPES[shape]
    kept = per_layer_kept("vision", sizes, p)
    config = SiglipVisionConfig(**sizes)
    h = sizes["hidden_size"]
    assert siglip_layer_bytes(config, p) == pytest.approx(kept["none"], rel=0.01)
    if how == "trains":
        width = p.stream * h + p.compute * (selective_width(config, "vision", p) - h)
        assert width == pytest.approx(kept["selective"], rel=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory")
@pytest.mark.parametrize(
    "train, attention, compiled, rel",
    [(False, "sdpa", False, 0.02), (True, "sdpa", False, 0.06), (False, "flex_attention", True, 0.1)],
)
def test_the_plan_matches_a_real_size_gemma_layer_on_a_gpu(train, attention, compiled, rel):
    """One Gemma 3 4B-size decoder layer on 2 x 1348 tokens under bf16 autocast, as stage 1 (frozen, compiled, flex
    attention) and stage 3 (trained) run it: the growth of allocated memory over a forward, less its output and
    autocast's bf16 weight copies, against the plan (docs/training.md, "Memory levers": -s prints both)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from theworld.model.arch import REAL
    from tools.memory_plan import LayerRun, gemma_layer_bytes

    b, seq, cuda = 2, 1348, torch.device("cuda")
    layer, config = _layer("language", {**REAL["text"], "vocab_size": 64}, attention)
    dtype = torch.float32 if train else torch.bfloat16
    layer = layer.to(cuda, dtype).requires_grad_(train)
    x = torch.randn(b, seq, config.hidden_size, device=cuda, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq, device=cuda)[None].expand(b, seq)
    rope = Gemma3RotaryEmbedding(config).to(cuda)(x, positions, layer_type="sliding_attention")
    if attention == "flex_attention":
        mask = create_block_mask(lambda _b, _h, q, k: (q >= k) & (q - k < 1024), b, None, seq, seq, device=cuda)
    else:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=cuda).tril()[None, None].expand(b, 1, seq, seq)
    forward = torch.compile(layer) if compiled else layer
    casts = sum(w.numel() * 2 for w in layer.parameters() if w.dim() == 2) if train else 0
    for first in (True, False):  # the first call compiles and warms the allocator
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", torch.bfloat16):
            out = forward(x, position_embeddings=rope, attention_mask=mask, position_ids=positions)
        torch.cuda.synchronize()
        kept = (torch.cuda.memory_allocated() - before - out.numel() * out.element_size() - casts) / (b * seq)
        if first:
            out.float().sum().backward()
        del out
    run = LayerRun(stream=4 if train else 2, train=train, attention=attention, compiled=compiled)
    plan = gemma_layer_bytes(config, run, seq)
    print(f"{attention} compiled={compiled} train={train}: kept {kept:.0f} bytes per token, plan {plan}")
    assert plan == pytest.approx(kept, rel=rel)


def test_train_memory_counts_the_rollout_world_tokens():
    from tools.memory_plan import activation_bytes, build_world
    from train.config import TrainConfig

    plain = load_config(TrainConfig, ROOT / "configs" / "real" / "stage1.yaml")
    rollout = load_config(TrainConfig, ROOT / "configs" / "real" / "stage1_rollout.yaml")
    a, b = build_world(plain), build_world(rollout)
    assert a.projector.num_tokens(64, 64) == 32 * 32 + 2 and b.projector.num_tokens(64, 64) == 3 * 32 * 32 + 2
    assert activation_bytes(rollout, b, 1) > activation_bytes(plain, a, 1)
