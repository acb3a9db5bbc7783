"""`python -m tools.memory_plan --config FILE [--gpus N] [--gpu-memory-gib 80] [--json]`: a per-GPU memory plan.

Parameter counts are exact: the model is built on the meta device (shapes, no weights) from the configs of the base
models; a hub id that is not in the local Hugging Face cache falls back to its architecture in theworld/model/arch.py
(Gemma 3 4B, the Wan 2.1 VAE). Bytes per GPU under ddp and fsdp are broken into frozen weights, trainable weights,
gradients, optimizer state, working buffers and activations; the activation figure is an estimate: per layer, what
the layer keeps for the backward, counted from its shapes (gemma_layer_bytes, siglip_layer_bytes; docs/training.md,
"Memory levers"). Nothing is loaded onto a GPU and nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from theworld.core.config import cli_parser, load_config, shown, to_yaml
from theworld.core.errors import UserError, cli_entry
from theworld.model import lora as lora_adapters
from theworld.model.arch import (
    ANSWER_TOKENS,
    LORA_MODULES,
    TEXT_TOKENS,
    latent_side,
)
from theworld.model.config import trains
from theworld.model.encoders import DTYPES
from theworld.model.world import TheWorld
from train import sharding
from train.config import ActivationCheckpointing, TrainConfig, resolve_micro_batch
from train.meta_model import build_world

HEADROOM = 0.9  # of the card: the CUDA context, NCCL buffers and allocator fragmentation take the rest
ADAM_STATE = 8  # bytes per trainable parameter: AdamW's two fp32 moments
ADAM_FOREACH = 4  # and the fp32 temporary of its step: whole-size with foreach (the default on GPUs), else the size
# of the largest tensor (CPUs step one tensor at a time)
VAE_TENSORS_PER_STAGE = 14  # activations kept per VAE encoder stage, in units of channels x pixels (2 res blocks)


@dataclass
class Counts:
    total: int
    trainable: int
    frozen_bytes: int  # frozen weights in their load dtype
    largest_unit: int  # parameters of the largest FSDP unit below the root
    largest_unit_trainable: int
    root: int  # parameters left in the root FSDP unit
    largest_trainable: int  # elements of the largest trainable tensor


def count(model: TheWorld) -> Counts:
    params = dict(model.named_parameters())  # tied weights once, as the optimiser sees them
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    frozen_bytes = sum(p.numel() * p.element_size() for p in params.values() if not p.requires_grad)
    units = [list(u.parameters()) for u in sharding.units(model)]
    sizes = [sum(p.numel() for p in u) for u in units] or [0]
    biggest = max(range(len(units)), key=lambda i: sizes[i]) if units else None
    big_train = sum(p.numel() for p in units[biggest] if p.requires_grad) if units else 0
    total = sum(p.numel() for p in params.values())
    largest = max((p.numel() for p in params.values() if p.requires_grad), default=0)
    return Counts(total, trainable, frozen_bytes, max(sizes), big_train, total - sum(sizes), largest)


def activation_bytes(cfg: TrainConfig, model: TheWorld, micro: int, ac: ActivationCheckpointing | None = None) -> int:
    """Estimated activation memory of one micro-batch (the layers' widths: LAYER_BYTES, as layer_run says train.loop
    runs them), with the configured activation checkpointing or `ac`."""
    ac = ac or cfg.train.hardware.activation_checkpointing
    gc = model.gemma.config
    text, vision = gc.get_text_config(), gc.vision_config
    e = 2 if cfg.train.hardware.mixed_precision == "bf16" else DTYPES[cfg.model.dtype].itemsize
    side = latent_side(cfg.image.resolution)
    world = model.projector.num_tokens(side, side)
    seq = TEXT_TOKENS + gc.mm_tokens_per_image + 2 + world
    per_sample = _stack(seq, text, layer_run(cfg, "language"), ac, "language")
    per_sample += ANSWER_TOKENS * text.vocab_size * (3 * 4 + e)  # answer logits: compute dtype, fp32 loss + grad
    per_sample += lora_dropout_bytes(cfg, text, "language", seq, e, ac)
    if trains(cfg.freeze, cfg.lora, "vision"):
        patches = (vision.image_size // vision.patch_size) ** 2
        per_sample += _stack(patches, vision, layer_run(cfg, "vision"), ac, "vision")
        per_sample += lora_dropout_bytes(cfg, vision, "vision", patches, e, ac)
    if not cfg.freeze.vae and model.world_encoder is not None:
        per_sample += vae_bytes(model.world_encoder.vae.config, cfg.image.resolution, e, ac)
    return micro * per_sample


def _wrapped(layers: int, ac: ActivationCheckpointing, part: str) -> int:
    """Layers of a stack of `layers` that `ac` checkpoints (0, N, 2N, ...: theworld/model/recompute.py)."""
    return -(-layers // ac.every_n) if ac.wraps(part) else 0


def lora_dropout_bytes(
    cfg: TrainConfig, part_cfg, part: str, seq: int, e: int, ac: ActivationCheckpointing | None = None
) -> int:
    """With lora.dropout > 0 every adapted layer keeps its own dropped-out copy of its input (and a one-byte mask)
    for the backward of lora_A: per layer of the part's stack that is not checkpointed (plus the one recomputed)."""
    lora, ac = cfg.lora, ac or cfg.train.hardware.activation_checkpointing
    if lora is None or lora.dropout == 0 or part not in lora.parts:
        return 0
    heads = getattr(part_cfg, "num_attention_heads", 1) * getattr(part_cfg, "head_dim", part_cfg.hidden_size)
    widths = {"o_proj": heads, "down_proj": part_cfg.intermediate_size, "fc2": part_cfg.intermediate_size}
    per_layer = sum(
        seq * widths.get(m, part_cfg.hidden_size) * (e + 1) for m in lora.target_modules if m in LORA_MODULES[part]
    )
    layers, wrapped = part_cfg.num_hidden_layers, _wrapped(part_cfg.num_hidden_layers, ac, part)
    return per_layer * (layers - wrapped + (1 if wrapped else 0))


@dataclass(frozen=True)
class LayerRun:
    """How train.loop runs a stack's layers, which decides what they keep for the backward: `compute` bytes per
    element of their matmuls and attention (2 under bf16 autocast), `stream` bytes per element of the residual stream
    (a part that trains in full holds fp32 weights, its embeddings too, so its stream is fp32 even under autocast; a
    frozen part's follows model.dtype), whether the layers' own weights train, whether LoRA adapters sit on their
    linear layers, and (language only: train.hardware) the attention kernel and torch.compile."""

    compute: int = 2
    stream: int = 4
    train: bool = True
    adapted: bool = False
    attention: str = "sdpa"
    compiled: bool = False

    @property
    def keeps_matmul_inputs(self) -> bool:  # a matmul keeps its input only for its weight's (or adapter's) gradient
        return self.train or self.adapted

    @property
    def shares_inputs(self) -> bool:
        """Whether the projections reading one normalised input keep it once: autocast casts an fp32 activation anew
        for each matmul (it caches only the casts of weights), so from an fp32 stream q, k and v keep a copy each."""
        return self.stream == self.compute or self.compiled  # a compiled layer casts once


def layer_run(cfg: TrainConfig, part: str) -> LayerRun:
    """The LayerRun of `part`'s layers as train.loop runs them."""
    train = not getattr(cfg.freeze, part)
    stream = 4 if train else DTYPES[cfg.model.dtype].itemsize
    hw = cfg.train.hardware
    compute = 2 if hw.mixed_precision == "bf16" else stream  # without autocast: the weights' dtype
    adapted = cfg.lora is not None and part in cfg.lora.parts
    if part != "language":  # train.hardware.attention and compile act on the language model's layers
        return LayerRun(compute, stream, train, adapted)
    return LayerRun(compute, stream, train, adapted, hw.attention, hw.compile)


def _attention_bytes(heads: int, kv_heads: int, q: int, kv: int, p: LayerRun, seq: int) -> int:
    """What a Gemma layer's attention keeps per token. sdpa: q (normed, rotated), k and v repeated to every head
    (transformers' sdpa path repeats them whenever a mask is passed, and training always passes one; one kv head
    repeats as a view, no copy, unless autocast casts it: k rotated by fp32 cos/sin from an fp32 stream), its output,
    fp32 logsumexp per head, and the boolean mask as a bias of the compute dtype (a row of seq). flex_attention:
    k and v once (it reads kv heads itself), no bias (the block mask is shared). eager: the fp32 softmax and its
    compute-dtype copy (a row of seq per head), and the matmuls' operands."""
    v = q if 1 < kv_heads < heads else kv
    k = q if kv_heads < heads and (kv_heads > 1 or not p.shares_inputs) else kv
    if p.attention == "flex_attention":
        return p.compute * (2 * q + 2 * kv) + 4 * heads
    if p.attention == "eager":
        return p.compute * (2 * q + k + v) + (4 + p.compute) * heads * seq
    return p.compute * (2 * q + k + v + seq) + 4 * heads


def gemma_layer_bytes(tc, p: LayerRun, seq: int = 0) -> int:
    """Bytes per token one Gemma 3 decoder layer keeps for the backward without checkpointing, as train.loop runs it
    (`p`; a boolean mask), counted from what autograd saves (tests/tools/test_memory_plan.py, per_layer_kept: exact for
    eager layers, within 3% of torch.compile's partition); `seq` sizes the attention's rows. Rotary cos/sin are
    computed once per forward and shared by every layer."""
    h, i, heads, kv_heads = tc.hidden_size, tc.intermediate_size, tc.num_attention_heads, tc.num_key_value_heads
    q, kv = heads * tc.head_dim, kv_heads * tc.head_dim
    rows = 4 * (4 + heads + kv_heads)  # one fp32 rsqrt per row of each RMSNorm (q and k are normed per head)
    attention = _attention_bytes(heads, kv_heads, q, kv, p, seq)
    if p.compiled:
        # torch.compile's partition keeps the matmuls' outputs and recomputes the norms and activations from them:
        # the layer input, the inputs of the q and k norms (q_proj, k_proj), of the post-attention and post-feedforward
        # norms (o_proj, down_proj) and of the gated activation (gate, up); for weights' gradients also the
        # normalised inputs of q/k/v and gate/up (cast once), o_proj's input and the gated product down_proj reads
        kept = p.stream * h + p.compute * (q + kv + 2 * h + 2 * i)
        return rows + attention + kept + (p.compute * (2 * h + q + i) if p.keeps_matmul_inputs else 0)
    # six RMSNorms (input, post-attention, pre- and post-feedforward over h; q and k per head): each computes in fp32
    # and keeps its input in fp32 (a copy of a bf16 input; under fp32 the input itself), and, when its weight
    # trains, the normalised fp32 tensor that weight multiplies
    norms = 4 * (4 * h + q + kv) * (2 if p.train else 1)
    # the normalised inputs of q/k/v and gate/up (cast to the compute dtype: once, or once per projection when the
    # stream is fp32 under autocast) and the gated product down_proj reads; o_proj reads attention's kept output
    copies = (2 if p.shares_inputs else 5) * h
    matmuls = p.compute * (copies + i) if p.keeps_matmul_inputs else 0
    mlp = p.compute * 3 * i  # gated MLP: gelu's input (gate), its output and up (the product's two factors)
    return rows + norms + matmuls + attention + mlp


def siglip_layer_bytes(vc, p: LayerRun, seq: int = 0) -> int:
    """Bytes per token one SigLIP encoder layer keeps for the backward without checkpointing (sdpa, no mask), counted
    as gemma_layer_bytes' are; `seq` is unused (no mask)."""
    h, i, heads = vc.hidden_size, vc.intermediate_size, vc.num_attention_heads
    # two LayerNorms: each keeps its input (the residual stream) and fp32 mean and rstd per row
    norms = 2 * (p.stream * h + 8)
    # the normalised inputs of q/k/v and fc1 (cast per projection when the stream is fp32 under autocast) and fc2's
    # input (gelu's output); out_proj reads attention's kept output
    copies = (2 if p.shares_inputs else 4) * h
    matmuls = p.compute * (copies + i) if p.keeps_matmul_inputs else 0
    attention = p.compute * 4 * h + 4 * heads  # sdpa: q, k, v, its output, fp32 logsumexp per head
    return norms + matmuls + attention + p.compute * i  # and gelu's input (fc1's output)


LAYER_BYTES = {"language": gemma_layer_bytes, "vision": siglip_layer_bytes}  # one per architecture a stack holds


def selective_width(part_cfg, part: str, p: LayerRun | None = None) -> int:
    """Elements per token a selectively checkpointed layer keeps: its input and the outputs of the ops it saves
    (theworld.model.recompute.SAVE_OPS): q, k and v, attention, the output projection and the MLP's matmuls (Gemma's
    gated MLP has two input projections); never more than a layer keeps without checkpointing (precision `p`)."""
    p = p or LayerRun()
    h, heads = part_cfg.hidden_size, part_cfg.num_attention_heads
    head_dim = getattr(part_cfg, "head_dim", None) or h // heads
    kv = getattr(part_cfg, "num_key_value_heads", None) or heads
    mlp = part_cfg.intermediate_size * (2 if part == "language" else 1)
    width = h + 2 * heads * head_dim + 2 * kv * head_dim + h + mlp + h
    return min(width, LAYER_BYTES[part](part_cfg, p) // p.compute)


def _stack(seq: int, part_cfg, p: LayerRun, ac: ActivationCheckpointing, part: str) -> int:
    """Activations of a stack of transformer layers for one sequence: a full-checkpointed layer keeps its input (in
    the stream's dtype), a selective one its input and its matmul and attention outputs, the others everything
    (LAYER_BYTES); plus one layer recomputed at a time in the backward."""
    hidden, layers = part_cfg.hidden_size, part_cfg.num_hidden_layers
    layer = seq * LAYER_BYTES[part](part_cfg, p, seq)
    wrapped = _wrapped(layers, ac, part)
    if not wrapped:
        return layers * layer
    kept = seq * hidden * p.stream
    if ac.mode == "selective":
        kept += seq * p.compute * (selective_width(part_cfg, part, p) - hidden)
    return wrapped * kept + (layers - wrapped) * layer + layer


VAE_KEPT = {"full": 1, "selective": 3}  # tensors a checkpointed residual block keeps: its input (and its two convs')


def vae_bytes(vc, resolution: int, e: int, ac: ActivationCheckpointing) -> int:
    """Activations of the training VAE encoder for one image: VAE_TENSORS_PER_STAGE tensors of channels x pixels per
    stage, shared by its residual blocks; a checkpointed block (theworld.model.recompute: down blocks, then the mid
    block, every_n over that list) keeps VAE_KEPT of its own, plus the largest block recomputed at a time."""
    blocks, total, index, largest = vc.num_res_blocks, 0, 0, 0
    for i, m in enumerate(vc.dim_mult):
        size = vc.base_dim * m * (resolution >> i) ** 2 * e
        wrapped = sum(ac.wraps("vae") and (index + j) % ac.every_n == 0 for j in range(blocks))
        total += (blocks - wrapped) * VAE_TENSORS_PER_STAGE * size // blocks
        total += wrapped * VAE_KEPT.get(ac.mode, 0) * size
        if wrapped:
            largest = max(largest, VAE_TENSORS_PER_STAGE * size // blocks)
        index += blocks + (i < len(vc.dim_mult) - 1)  # and the stage's downsampling block
    return total + largest


def per_gpu(
    cfg: TrainConfig,
    model: TheWorld,
    c: Counts,
    gpus: int,
    micro: int,
    foreach: bool = True,
    ac: ActivationCheckpointing | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes per GPU under ddp, fsdp and fsdp with host offload (train.hardware.cpu_offload). With one GPU fsdp runs
    unsharded (the same as ddp); with offload it shards over a group of one, and only the gathered units stay."""
    e = 2 if cfg.train.hardware.mixed_precision == "bf16" else 4
    act = activation_bytes(cfg, model, micro, ac)
    step_tmp = ADAM_FOREACH * (c.trainable if foreach else c.largest_trainable)
    ddp = {
        "frozen_weights": c.frozen_bytes,
        "trainable_weights": 4 * c.trainable,
        # DDP's reducer keeps a flat bucket copy of every gradient besides the .grad tensors
        "gradients": 4 * c.trainable * (2 if gpus > 1 else 1),
        "optimizer_state": ADAM_STATE * c.trainable + step_tmp,
        # autocast keeps a bf16 copy of each fp32 weight it used for the rest of the forward
        "working_buffers": 2 * c.trainable if e == 2 else 0,
        "activations": act,
    }
    # the root stays gathered; two units are gathered at a time (current + prefetched), and one unit's whole fp32
    # gradient exists before its reduce-scatter
    gathered = e * (c.root + 2 * c.largest_unit) + 4 * c.largest_unit_trainable
    if gpus == 1:
        fsdp = dict(ddp)
    else:
        fsdp = {
            "frozen_weights": c.frozen_bytes // gpus,
            "trainable_weights": 4 * c.trainable // gpus,
            "gradients": 4 * c.trainable // gpus,
            "optimizer_state": (ADAM_STATE * c.trainable + step_tmp) // gpus,
            "working_buffers": gathered,
            "activations": act,
        }
    offload = {
        "frozen_weights": 0,
        "trainable_weights": 0,
        "gradients": 0,
        "optimizer_state": 0,
        "working_buffers": gathered,
        "activations": act,
    }
    for d in (ddp, fsdp, offload):
        d["total"] = sum(d.values())
    return {"ddp": ddp, "fsdp": fsdp, "fsdp_offload": offload}


# The activation checkpointing settings tools.memory_plan compares, on every part that trains (docs/training.md)
LEVERS = {
    "none": ("none", 1),
    "full": ("full", 1),
    "full_every_2": ("full", 2),
    "selective": ("selective", 1),
    "selective_every_2": ("selective", 2),
}


def levers(cfg: TrainConfig, model: TheWorld, c: Counts, gpus: int, micro: int, budget: int) -> dict:
    """What each memory lever gives at this micro-batch: per-GPU activations and totals with each activation
    checkpointing setting (LEVERS, on the language model, the vision tower and the VAE where they train), the VAE
    encoder's own activations with and without block checkpointing, and what a weights-only checkpoint
    (train.checkpoint.save_optimizer: false) leaves out of each checkpoint folder."""
    e = 2 if cfg.train.hardware.mixed_precision == "bf16" else DTYPES[cfg.model.dtype].itemsize
    checkpointing = {}
    for name, (mode, every_n) in LEVERS.items():
        ac = ActivationCheckpointing(mode=mode, every_n=every_n)
        per = per_gpu(cfg, model, c, gpus, micro, ac=ac)
        checkpointing[name] = {
            "activations": per["ddp"]["activations"],
            "total": {k: v["total"] for k, v in per.items()},
            "fits": {k: v["total"] <= budget for k, v in per.items()},
        }
    vae_trains = not cfg.freeze.vae and model.world_encoder is not None
    vae = (
        {
            mode: micro
            * vae_bytes(model.world_encoder.vae.config, cfg.image.resolution, e, ActivationCheckpointing(mode))
            for mode in ("none", "full", "selective")
        }
        if model.world_encoder is not None
        else {}
    )
    ema = 4 * c.trainable if cfg.train.optimizer.ema else 0
    return {
        "activation_checkpointing": checkpointing,
        "vae_block_checkpointing": {"trains": vae_trains, "activations": vae},
        "weights_only_checkpoint": {
            "checkpoint_bytes": 4 * c.trainable + ema + ADAM_STATE * c.trainable,  # weights, EMA, AdamW's moments
            "weights_only_bytes": 4 * c.trainable + ema,
            "saved_bytes": ADAM_STATE * c.trainable,
        },
    }


def host_bytes(c: Counts, gpus: int) -> int:
    """Host memory each process holds under fsdp with offload: its shard of every weight, gradient and AdamW moment
    (the optimizer steps on the CPU, one tensor at a time)."""
    return (c.frozen_bytes + (4 + 4 + ADAM_STATE) * c.trainable + ADAM_FOREACH * c.largest_trainable) // gpus


def estimate(cfg: TrainConfig, gpus: int, gpu_memory_gib: float, model: TheWorld | None = None) -> dict:
    model = model or build_world(cfg)
    c = count(model)
    budget = int(gpu_memory_gib * 2**30 * HEADROOM)
    micro = resolve_micro_batch(cfg, gpus)  # `auto` becomes what a run on `gpus` processes would use
    per = per_gpu(cfg, model, c, gpus, micro)
    out = {
        "config": {
            "gemma": cfg.model.gemma,
            "vae": cfg.model.vae,
            "freeze": vars(cfg.freeze),
            "mixed_precision": cfg.train.hardware.mixed_precision,
            "gradient_checkpointing": cfg.train.hardware.activation_checkpointing.mode != "none",
            "activation_checkpointing": vars(cfg.train.hardware.activation_checkpointing),
            "micro_batch_size": micro,
        },
        "gpus": gpus,
        "gpu_memory_bytes": int(gpu_memory_gib * 2**30),
        "budget_bytes": budget,
        "total_params": c.total,
        "trainable_params": c.trainable,
        "frozen_params": c.total - c.trainable,
        "lora": (
            {"params": lora_adapters.count(model), "parts": cfg.lora.parts, "r": cfg.lora.r} if cfg.lora else None
        ),
        "per_gpu_bytes": per,
        "fits": {k: v["total"] <= budget for k, v in per.items()},
        "host_bytes_per_process": {"fsdp_offload": host_bytes(c, gpus)},
        "suggested_micro_batch_size": {},
    }
    out["levers"] = levers(cfg, model, c, gpus, micro, budget)
    per_process = cfg.train.global_batch_size // gpus if cfg.train.global_batch_size % gpus == 0 else 0
    for mode in per:
        ok = [
            m
            for m in range(1, per_process + 1)
            if per_process % m == 0 and per_gpu(cfg, model, c, gpus, m)[mode]["total"] <= budget
        ]
        out["suggested_micro_batch_size"][mode] = max(ok) if ok else None
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:8.2f}"


def render(p: dict) -> str:
    rows = [
        "frozen_weights",
        "trainable_weights",
        "gradients",
        "optimizer_state",
        "working_buffers",
        "activations",
        "total",
    ]
    modes = list(p["per_gpu_bytes"])
    cell = lambda values: "".join(f"{v:>14s}" for v in values)
    lines = [
        f"parameters: {p['total_params']:,} total, {p['trainable_params']:,} trainable, "
        f"{p['frozen_params']:,} frozen (exact, from the model built on the meta device)"
        + (
            f"; LoRA adapters: {p['lora']['params']:,} on {', '.join(p['lora']['parts'])} (r {p['lora']['r']})"
            if p["lora"]
            else ""
        ),
        f"per GPU, {p['gpus']} GPU(s) of {p['gpu_memory_bytes'] / 2**30:.0f} GiB "
        f"(budget {HEADROOM:.0%}: {p['budget_bytes'] / 2**30:.1f} GiB), micro_batch_size "
        f"{p['config']['micro_batch_size']}; GiB:",
        f"{'':20s}{cell(modes)}",
    ]
    for r in rows:
        lines.append(f"{r:20s}{cell(_gib(p['per_gpu_bytes'][m][r]).strip() for m in modes)}")
    lines.append(f"{'fits':20s}{cell(str(p['fits'][m]) for m in modes)}")
    s = p["suggested_micro_batch_size"]
    lines.append(
        f"{'micro_batch_size':20s}{cell(str(s[m] or '-') for m in modes)}"
        "  (largest that fits and divides the per-process batch; - : none)"
    )
    lines.append(
        f"fsdp_offload (train.hardware.cpu_offload) keeps weights, gradients and optimizer state in host memory: "
        f"{p['host_bytes_per_process']['fsdp_offload'] / 2**30:.1f} GiB per process"
    )
    lines += render_levers(p["levers"], modes, cell)
    lines.append("activations and working buffers are estimates (docs/performance.md); the rest is exact")
    return "\n".join(lines)


def render_levers(lv: dict, modes: list[str], cell) -> list[str]:
    ac = lv["activation_checkpointing"]
    lines = [
        "levers: train.hardware.activation_checkpointing on every part that trains (configured above: "
        "per_gpu_bytes); activations and totals, GiB:",
        f"{'':20s}{cell(['activations', *modes])}",
    ]
    for name, row in ac.items():
        values = [_gib(row["activations"]).strip()]
        values += [_gib(row["total"][m]).strip() + ("" if row["fits"][m] else " (no)") for m in modes]
        lines.append(f"{name:20s}{cell(values)}")
    vae = lv["vae_block_checkpointing"]
    if vae["trains"]:
        lines.append(
            "VAE encoder activations (parts: vae), GiB: "
            + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in vae["activations"].items())
        )
    w = lv["weights_only_checkpoint"]
    lines.append(
        f"each checkpoint folder: {w['checkpoint_bytes'] / 2**30:.1f} GiB, weights only "
        f"(train.checkpoint.save_optimizer: false) {w['weights_only_bytes'] / 2**30:.1f} GiB"
    )
    return lines


MAX_GPUS, MAX_GPU_GIB = 2**20, 2**20  # beyond any machine; keeps the byte counts finite integers


@cli_entry
def main(argv: list[str] | None = None) -> int:
    ap = cli_parser("tools.memory_plan", __doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.config is None:
        raise UserError("tools.memory_plan: --config is required")
    if not 1 <= args.gpus <= MAX_GPUS:
        raise UserError(f"tools.memory_plan: --gpus must be between 1 and {MAX_GPUS}, got {shown(args.gpus)}")
    if not 0 < args.gpu_memory_gib <= MAX_GPU_GIB:  # also refuses inf and nan
        raise UserError(
            f"tools.memory_plan: --gpu-memory-gib must be a positive number of GiB up to {MAX_GPU_GIB}, got "
            f"{args.gpu_memory_gib}"
        )
    cfg = load_config(TrainConfig, args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    p = estimate(cfg, args.gpus, args.gpu_memory_gib)
    print(json.dumps(p, indent=1) if args.json else render(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
