"""The training config: one strict dataclass tree, validated before any model is loaded."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from theworld.cache_format.fingerprint import ROLLOUT_DEFAULTS
from theworld.cache_format.settings import MOVED as STORAGE_MOVED
from theworld.cache_format.settings import Settings
from theworld.core import compat, hub
from theworld.core.config import (
    FLOAT32_MAX,
    at_least,
    check_sizes,
    check_threads,
    check_workers,
    cli_parser,
    config_key,
    load_config,
    require_path,
    shown,
    to_dict,
    to_yaml,
)
from theworld.core.errors import UserError
from theworld.model.arch import CHECKPOINT_PARTS, PACKED_ATTENTION
from theworld.model.config import FreezeConfig, ImageConfig, LoraConfig, ModelConfig, WorldConfig, check_lora

# A key declared `neutral` may change between a run and its resumption without changing its numbers: where files go,
# what is logged and when, how the same global batch is split over processes and micro-batches, where the AdamW step
# runs (train.cpu_offload: like a change of process count, equal numbers up to rounding), whether activations are
# recomputed. `run_hash` leaves these keys out.
NEUTRAL_KEY = "resume_neutral"
NEUTRAL = {NEUTRAL_KEY: True}


def neutral(default: Any) -> Any:
    """A field with `default` whose key is resume-neutral (a mutable default: `field(default_factory=...,
    metadata=NEUTRAL)`)."""
    return field(default=default, metadata=NEUTRAL)


TRACKERS = ("tensorboard", "wandb")
DEFAULT_CACHE = "cache/latents"


@dataclass
class LrMultipliers:
    """Learning-rate factor of each part on top of train.lr and its schedule (e.g. a freshly initialised projector
    next to pretrained layers); a part that is frozen ignores its factor."""

    projector: float = 1.0
    vision: float = 1.0  # SigLIP tower + multimodal projector
    language: float = 1.0  # language model + lm_head
    vae: float = 1.0

    def __post_init__(self) -> None:
        for name, x in vars(self).items():
            if not (math.isfinite(x) and x > 0):
                raise UserError(
                    f"config key 'train.optimizer.lr_multipliers.{name}': must be a positive finite number, got {x}"
                )


@dataclass
class BenchmarkEntry:
    """A `train.eval.benchmarks` entry that names more than its file (a plain string entry is {path} with defaults)."""

    path: str
    protocol: Literal["auto", "generate", "loglik"] = "auto"  # auto: generate for items with their own prompt (BLINK)
    baselines: list[str] = field(default_factory=list)  # names of theworld/infer/baselines.py, or [all]

    def __post_init__(self) -> None:
        self.names()  # checked as the config loads

    def names(self, world_steps: int | None = None) -> list[str]:
        """The baselines this entry asks for on a stage with `world_steps` (world.num_world_steps): `all` includes
        the rollout baselines when it is > 0 (theworld/infer/baselines.py, `parse`)."""
        from theworld.infer.baselines import parse

        try:
            return parse(self.baselines, world_steps)
        except UserError as e:
            raise UserError(f"config key 'train.eval.benchmarks': {e}".replace("--baselines: ", "")) from None


@dataclass
class PlateauConfig:
    """When the eval loss counts as plateaued (train/eval/plateau.py): less than `min_improvement` (relative) over the
    last `window_evals` evals; 0: the evals covering the last 5,000 steps, or the run's last quarter if shorter."""

    window_evals: int = 0
    min_improvement: float = 0.01
    min_steps: int = 0  # no plateau is declared (and no stop made) before this step (the plan: 10k stage 1, 5k later)

    def __post_init__(self) -> None:
        at_least(self, "train.eval.plateau", 0, "window_evals", "min_steps")
        check_sizes(self, "train.eval.plateau")
        if not (math.isfinite(self.min_improvement) and self.min_improvement >= 0):
            raise UserError(
                f"config key 'train.eval.plateau.min_improvement': must be a finite number >= 0, got "
                f"{self.min_improvement}"
            )


@dataclass
class ActivationCheckpointing:
    """Recompute activations in the backward instead of keeping them (theworld/model/recompute.py, docs/training.md):
    `full` keeps only each wrapped layer's input; `selective` keeps the outputs of matmuls, attention and
    convolutions and recomputes the rest (torchtitan's op-level selective checkpointing). `every_n`: wrap layers 0,
    N, 2N, ... of each part's stack (the others keep all their activations). `parts`: Gemma's decoder layers,
    SigLIP's encoder layers and the VAE encoder's blocks (a part that does not train keeps no activations anyway)."""

    mode: Literal["none", "full", "selective"] | None = None  # None: full (the section given means it is on)
    every_n: int = 1
    parts: list[str] = field(default_factory=lambda: list(CHECKPOINT_PARTS))

    def __post_init__(self) -> None:
        if self.mode is None:
            self.mode = "full"
        if self.mode == "none" and self.every_n != 1:
            raise UserError(
                f"config key 'train.hardware.activation_checkpointing.every_n': {shown(self.every_n)} with mode none "
                "checkpoints nothing; use mode full or selective"
            )
        if not 1 <= self.every_n <= MAX_EVERY_N:
            raise UserError(
                f"config key 'train.hardware.activation_checkpointing.every_n': must be in [1, {MAX_EVERY_N}] (1: "
                f"every layer), got {shown(self.every_n)}"
            )
        if len(set(self.parts)) != len(self.parts) or set(self.parts) - set(CHECKPOINT_PARTS):
            raise UserError(
                f"config key 'train.hardware.activation_checkpointing.parts': each of {list(CHECKPOINT_PARTS)} at most "
                f"once, got {shown(self.parts)}"
            )

        if self.mode != "none" and not self.parts:
            raise UserError(
                f"config key 'train.hardware.activation_checkpointing.parts': [] with mode {self.mode} checkpoints "
                f"nothing; name the stacks to recompute (of {list(CHECKPOINT_PARTS)}), or use mode none"
            )

    def wraps(self, part: str) -> bool:
        return self.mode != "none" and part in self.parts


CHECKPOINT_MODES = ("none", "full", "selective")
MAX_EVERY_N = 1024  # beyond any stack's depth (train.meta_model's MAX_LAYERS)
# What the earlier switch train.gradient_checkpointing: true did: every layer of Gemma's two stacks, the VAE never.
LEGACY_FULL = ActivationCheckpointing(mode="full", parts=["language", "vision"])


def resolve_checkpointing(legacy: bool | None, given: ActivationCheckpointing | str | None) -> ActivationCheckpointing:
    """train.hardware.activation_checkpointing (a section, or a mode alone) from it and the earlier
    train.hardware.gradient_checkpointing (true: LEGACY_FULL, false: none); both given must agree (true with mode full,
    false with none)."""
    if isinstance(given, str):
        if given not in CHECKPOINT_MODES:
            raise UserError(
                f"config key 'train.hardware.activation_checkpointing': {shown(given)} is not a mode "
                f"({', '.join(CHECKPOINT_MODES)}) or a section {{mode, every_n, parts}}"
            )
        given = ActivationCheckpointing(mode=given)
    if legacy is None:
        return given or ActivationCheckpointing(mode="none")
    if given is None:
        return copy.deepcopy(LEGACY_FULL) if legacy else ActivationCheckpointing(mode="none")
    if given.mode != ("full" if legacy else "none"):
        raise UserError(
            f"config keys 'train.hardware.gradient_checkpointing' ({str(legacy).lower()}) and "
            f"'train.hardware.activation_checkpointing.mode' ({given.mode}) disagree; drop "
            "train.hardware.gradient_checkpointing (true means mode full, false mode none)"
        )
    return given


@dataclass
class OptimizerConfig:
    """`train.optimizer`: AdamW, gradient clipping and the EMA of the trainable weights (train/optim.py, step.py)."""

    lr: float = 1e-2
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0  # never applied to biases, norms, the world markers and the temporal table
    grad_clip: float = 1.0  # 0: no clipping (the norm is still computed and logged)
    grad_norm_warn: float = 100.0  # warn when the pre-clip gradient norm exceeds this (0: never)
    lr_multipliers: LrMultipliers = field(default_factory=LrMultipliers)
    ema: float = 0.0  # EMA decay of the trainable weights (0: off), e.g. 0.999
    ema_warmup_steps: int = 0  # the decay ramps up linearly from 0 to `ema` over this many steps (step.ema_decay)

    def __post_init__(self) -> None:
        at_least(self, "train.optimizer", 0, "weight_decay", "grad_clip", "grad_norm_warn", "ema_warmup_steps")
        if not self.lr > 0:
            raise UserError(f"config key 'train.optimizer.lr': must be positive, got {self.lr}")
        for name, x in vars(self.lr_multipliers).items():  # what AdamW multiplies the update by, in float32
            if self.lr * x > FLOAT32_MAX:
                raise UserError(
                    f"config key 'train.optimizer.lr_multipliers.{name}': {x:g} x train.optimizer.lr {self.lr:g} does "
                    f"not fit float32 (at most {FLOAT32_MAX:.4g})"
                )
        if not 0.0 <= self.ema < 1.0:
            raise UserError(f"config key 'train.optimizer.ema': decay must be in [0, 1), got {self.ema}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UserError(f"config key 'train.optimizer.betas': two numbers in [0, 1), got {self.betas}")


@dataclass
class LrSchedule:
    """`train.lr_schedule`: the learning-rate factor as a pure function of the step (train/optim.py, `lr_factor`)."""

    decay: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 50

    def __post_init__(self) -> None:
        at_least(self, "train.lr_schedule", 0, "warmup_steps")


@dataclass
class LoaderConfig:
    """`train.loader`: what a sample becomes on its way into a batch (train/data/cache.py)."""

    num_workers: int = neutral(2)
    flip: bool = False  # horizontal flip augmentation with left/right caption swap (needs flipped latents cached)
    cached_siglip: bool = True  # use cached SigLIP features when present and the vision tower is frozen
    max_length: int = 0  # token cap per sample (0: none)
    # within each window of group_window consecutive global batches, samples of similar token length (and the same
    # number of images) go together (train/data/order.py)
    group_by_length: bool = False
    group_window: int = 16
    # several samples to a row of at most pack_length tokens (world block included), each attending only within
    # itself (theworld/model/packing.py): the same samples, losses and gradients, less padding
    packing: bool = neutral(False)
    pack_length: int = neutral(2048)

    def __post_init__(self) -> None:
        at_least(self, "train.loader", 0, "num_workers", "max_length")
        at_least(self, "train.loader", 1, "group_window", "pack_length")
        check_sizes(self, "train.loader")
        check_workers("train.loader.num_workers", self.num_workers)


@dataclass
class EvalSet:
    """A `train.eval.sets` entry: a latent cache evaluated apart at every eval, as `<name>/eval_loss`,
    `<name>/eval_loss_shuffled_world`, `<name>/eval_gap` (train/eval/heldout.py). Every sample of it is held out."""

    name: str
    cache: str
    samples: int = 0  # 0: all of the cache; N: N of them, chosen by key hash as the run's own split is

    def __post_init__(self) -> None:
        at_least(self, "train.eval.sets", 0, "samples")
        if not self.name or "/" in self.name or self.name in ("data", "bench", "samples"):
            raise UserError(
                f"config key 'train.eval.sets': name {self.name!r} must be non-empty, without '/', and not "
                "data, bench or samples (their metrics' prefixes)"
            )
        require_path("train.eval.sets", self.cache)


@dataclass
class EvalConfig:
    """`train.eval`: the held-out loss, the benchmarks and the caption samples of every eval (train/trainer.py)."""

    every: int = neutral(500)  # 0: only at the end
    samples: int = 256  # held out by key hash, never trained on
    batch_size: int = 0  # 0: train.micro_batch_size (at least 2, so world latents can be permuted)
    # multiple-choice sets scored at every eval (JSONL, or a BLINK parquet folder; docs/inference.md):
    # bench/<name>/accuracy, .../accuracy_shuffled_world
    benchmarks: list[str | BenchmarkEntry] = field(default_factory=list, metadata=NEUTRAL)
    # held-out samples captioned at every eval (own world, shuffled world, true caption); 0: none
    captions: int = neutral(8)
    caption_tokens: int = neutral(32)  # new tokens per generated caption
    plateau: PlateauConfig = field(default_factory=PlateauConfig, metadata=NEUTRAL)
    # checkpoint, final weights and summary at the first eval that finds a plateau
    stop_on_plateau: bool = neutral(False)
    # named caches evaluated apart at every eval: [{name, cache[, samples]}]
    sets: list[EvalSet] = field(default_factory=list, metadata=NEUTRAL)
    # world tokens against Gemma's embedding table at every eval (align/* metrics, a PCA picture in train.report)
    alignment: bool = neutral(False)

    def __post_init__(self) -> None:
        at_least(self, "train.eval", 0, "every", "samples", "batch_size", "captions", "caption_tokens")
        check_sizes(self, "train.eval")
        names = [s.name for s in self.sets]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise UserError(f"config key 'train.eval.sets': two sets named {dup[0]!r}; name each once")


@dataclass
class KeepBest:
    """`train.checkpoint.keep_best`: the checkpoint whose step has the best `metric` in metrics.jsonl (an eval line's
    key, e.g. eval_loss, bench/<name>/accuracy) is kept beside the last ones (train/state/checkpoint.py)."""

    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if not self.metric or self.metric == "step":
            raise UserError("config key 'train.checkpoint.keep_best.metric': name an eval metric, e.g. eval_loss")


@dataclass
class CheckpointConfig:
    """`train.checkpoint`: when checkpoints are written and how many stay (train/state/checkpoint.py)."""

    every: int = neutral(500)
    keep_last: int = neutral(2)
    # false: weights-only checkpoints, a resume from one starts the optimizer fresh (not an exact resume;
    # docs/training.md)
    save_optimizer: bool = neutral(True)
    keep_best: KeepBest | None = neutral(None)  # {metric, mode}: the best checkpoint by a metric, kept as well
    # FSDP runs (train.hardware.sharding: fsdp over several processes): each process writes its own shard through
    # torch.distributed.checkpoint; false: whole tensors gathered to the main process, which writes them alone
    sharded: bool = neutral(True)
    # the key `async`: sharded saves are written in the background while training goes on; the checkpoint is sealed
    # and listed once every shard is on disk (a run that writes no shards saves as it would without it)
    async_: bool = neutral(False)

    def __post_init__(self) -> None:
        at_least(self, "train.checkpoint", 1, "every", "keep_last")


@dataclass
class LoggingConfig:
    """`train.logging`: how often the step metrics go to the console and the trackers (train/metrics.py)."""

    every: int = neutral(50)

    def __post_init__(self) -> None:
        at_least(self, "train.logging", 1, "every")


@dataclass
class HardwareConfig:
    """`train.hardware`: how the run uses the machine: precision, kernels, sharding, threads, recomputation."""

    mixed_precision: Literal["no", "bf16", "fp16"] = "no"  # fp16 is refused with its reason (below)
    compile: bool = False  # torch.compile the language model's decoder layers (GPU; see docs/performance.md)
    attention: Literal["sdpa", "flex_attention", "eager"] = "sdpa"  # the language model's attention kernel;
    # flex_attention (GPU) skips the masked blocks outside Gemma's 1024-token sliding window (docs/performance.md)
    # fsdp: FSDP2 fully_shard of weights, gradients and optimizer state across processes (train/sharding.py,
    # docs/training.md); an accelerate launch config asking for FSDP selects it too
    sharding: Literal["ddp", "fsdp"] = neutral("ddp")
    # fsdp only: keep parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy; the optimizer
    # steps on the CPU); also with one process, which then shards over a group of one
    cpu_offload: bool = neutral(False)
    # torch intra-op threads of each training process (0: torch's default); on a small CPU box 1 avoids OpenMP threads
    # fighting the loader workers (several times faster for the tiny demo on 2 cores)
    cpu_threads: int = neutral(0)
    # the earlier switch, still read: true is activation_checkpointing {mode: full, parts: [language, vision]}, false
    # none; once resolved it is null and activation_checkpointing says what runs
    gradient_checkpointing: bool | None = neutral(None)
    # a section, or a mode alone (selective: {mode: selective}); null: none (or what gradient_checkpointing says)
    activation_checkpointing: ActivationCheckpointing | str | None = neutral(None)
    # the device's dense bf16 peak in TFLOP/s per GPU for the logged mfu; 0: from the table of known GPUs
    # (train/flops.py), no mfu on a GPU it does not know
    peak_tflops: float = neutral(0.0)

    def __post_init__(self) -> None:
        at_least(self, "train.hardware", 0, "cpu_threads", "peak_tflops")
        if not math.isfinite(self.peak_tflops):
            raise UserError(
                f"config key 'train.hardware.peak_tflops': must be a finite number >= 0, got {self.peak_tflops}"
            )
        check_threads("train.hardware.cpu_threads", self.cpu_threads)
        if self.mixed_precision == "fp16":
            # Gemma 3's activations overflow float16, and fp16 needs a loss scaler whose state and skipped steps this
            # loop does not handle: bf16 has float32's range and needs none.
            raise UserError(
                "config key 'train.hardware.mixed_precision': fp16 is not supported (Gemma 3 overflows float16); "
                "use bf16"
            )
        self.activation_checkpointing = resolve_checkpointing(
            self.gradient_checkpointing, self.activation_checkpointing
        )
        self.gradient_checkpointing = None  # said once: a saved config reloads without the two disagreeing


@dataclass
class TrainSection:
    """`train`: the run's length and batch, and a section for each part of the loop a builder takes alone."""

    max_steps: int = 1000
    epochs: float = 0.0  # > 0: train this many epochs of the data (0.5 allowed) instead of max_steps, which it sets
    global_batch_size: int = 32  # the optimiser's batch, whatever the number of processes
    # per process per forward; accumulation = global / (micro * processes). auto: the largest divisor of
    # global / processes that is at most max_micro_batch_size
    micro_batch_size: int | Literal["auto"] = neutral("auto")
    max_micro_batch_size: int = neutral(32)  # what one forward fits in memory (used by micro_batch_size: auto)
    max_nonfinite: int = 5  # this many non-finite steps in a row stop the run
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)

    def __post_init__(self) -> None:
        at_least(self, "train", 1, "max_steps", "global_batch_size", "max_micro_batch_size", "max_nonfinite")
        if self.micro_batch_size != "auto":
            at_least(self, "train", 1, "micro_batch_size")
        check_sizes(self, "train")
        if not (math.isfinite(self.epochs) and self.epochs >= 0):
            raise UserError(f"config key 'train.epochs': must be a finite number >= 0, got {self.epochs}")
        if self.loader.packing and self.hardware.attention not in PACKED_ATTENTION:
            raise UserError(
                f"config key 'train.loader.packing': packed rows need train.hardware.attention sdpa or eager (their "
                f"4D masks), not {self.hardware.attention}"
            )


# Where each key of earlier releases lives now: the flat `train` section (release 4) and the top-level object storage
# keys (release 5). A config (or a --set) with an old key still loads, with one warning line naming the new keys, for
# as long as theworld/core/compat.py's rule says; `run_hash` hashes the old shape, so runs resume as before.
MOVED_KEYS = compat.moves(
    4,
    {
        f"train.{old}": f"train.{new}"
        for old, new in {
            "lr": "optimizer.lr",
            "betas": "optimizer.betas",
            "weight_decay": "optimizer.weight_decay",
            "grad_clip": "optimizer.grad_clip",
            "grad_norm_warn": "optimizer.grad_norm_warn",
            "lr_multipliers": "optimizer.lr_multipliers",
            "ema": "optimizer.ema",
            "ema_warmup_steps": "optimizer.ema_warmup_steps",
            "schedule": "lr_schedule.decay",
            "warmup_steps": "lr_schedule.warmup_steps",
            "num_workers": "loader.num_workers",
            "flip": "loader.flip",
            "cached_siglip": "loader.cached_siglip",
            "max_length": "loader.max_length",
            "eval_every": "eval.every",
            "eval_samples": "eval.samples",
            "eval_batch_size": "eval.batch_size",
            "benchmarks": "eval.benchmarks",
            "samples": "eval.captions",
            "sample_tokens": "eval.caption_tokens",
            "plateau": "eval.plateau",
            "stop_on_plateau": "eval.stop_on_plateau",
            "save_every": "checkpoint.every",
            "keep_last": "checkpoint.keep_last",
            "save_optimizer": "checkpoint.save_optimizer",
            "log_every": "logging.every",
            "mixed_precision": "hardware.mixed_precision",
            "compile": "hardware.compile",
            "attention": "hardware.attention",
            "sharding": "hardware.sharding",
            "cpu_offload": "hardware.cpu_offload",
            "cpu_threads": "hardware.cpu_threads",
            "gradient_checkpointing": "hardware.gradient_checkpointing",
            "activation_checkpointing": "hardware.activation_checkpointing",
        }.items()
    },
) | compat.moves(5, STORAGE_MOVED)


BY_SAMPLES = "samples"  # data[].weight: each of the cache's training samples once an epoch


@dataclass
class MixtureEntry:
    """One cache of a `data` mixture and its weight: its share of each epoch is weight / sum of weights. `samples` on
    every entry reads each cache's training samples once an epoch, the caches as one (a dataset precomputed in parts,
    one per node: docs/precompute.md), ordered a window of shards at a time as one cache is."""

    cache: str
    weight: float | str = 1.0

    def __post_init__(self) -> None:
        require_path("data[].cache", self.cache)
        if self.weight == BY_SAMPLES:
            return
        if isinstance(self.weight, str) or not self.weight > 0:
            raise UserError(
                f"config key 'data[].weight': must be positive, or '{BY_SAMPLES}' (each of the cache's training "
                f"samples once an epoch), got {self.weight!r} (cache {self.cache})"
            )


@dataclass
class ProfileConfig:
    enabled: bool = False
    start_step: int = 5  # profile steps [start_step, start_step + steps)
    steps: int = 5
    top: int = 15  # operations printed

    def __post_init__(self) -> None:
        for name, least in (("start_step", 0), ("steps", 1), ("top", 1)):
            if getattr(self, name) < least:
                raise UserError(f"config key 'profile.{name}': must be >= {least}, got {getattr(self, name)}")
        check_sizes(self, "profile")

    def check_window(self, max_steps: int) -> None:
        """The profiled steps lie within the run (`max_steps`, resolved from train.epochs where set): a window past
        its end would profile nothing, and one that runs over it would never write its trace."""
        if self.enabled and self.start_step + self.steps > max_steps:
            raise UserError(
                f"config key 'profile.start_step': steps {self.start_step}-{self.start_step + self.steps - 1} "
                f"(profile.steps {self.steps}) are not all within the run's {max_steps} steps, so no trace would "
                f"be written; use profile.start_step <= {max(max_steps - self.steps, 0)}"
                + (" or fewer profile.steps" if self.steps > max_steps else "")
            )


WANDB_FORBIDDEN = "/\\#?%:\n\r\t\0"  # characters W&B refuses in a project or entity name
WANDB_MAX_NAME = 128


@dataclass
class WandbConfig:
    """Used when `trackers` holds wandb; the run id is kept in the checkpoints, so a resumed run continues it."""

    project: str = "theworld"
    run_name: str | None = None
    entity: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("project", "entity"):  # W&B refuses these only once the run starts; the project also names a
            value = getattr(self, name)  # folder of TensorBoard's logs under output_dir
            if value is None and name == "entity":
                continue
            bad = sorted(set(WANDB_FORBIDDEN) & set(value))
            if not value.strip() or bad or len(value) > WANDB_MAX_NAME:
                raise UserError(
                    f"config key 'wandb.{name}': {value!r} is not a W&B {name} name ("
                    + (
                        f"it holds {' '.join(bad)}"
                        if bad
                        else "empty"
                        if not value.strip()
                        else f"over {WANDB_MAX_NAME} characters"
                    )
                    + f"); use letters, digits, '-', '_' and '.', at most {WANDB_MAX_NAME} characters"
                    + ("; the entity (team or user) has a key of its own: wandb.entity" if "/" in value else "")
                )


@dataclass
class HubConfig:
    """Upload to the Hugging Face Hub (train/state/hub_upload.py), in the background: `end`: final/; `every_save`: also
    each
    checkpoint's model files. The token is huggingface_hub's own (its login, or HF_TOKEN)."""

    model_id: str | None = None  # user/name; null: no upload
    strategy: Literal["end", "every_save"] = "end"
    private: bool = True
    # every_save: each checkpoint whole (optimizer and state too) in its own checkpoint-N/ folder of the repo, every
    # one kept (a resume or init_from can start from any); false: the model files at the repo's top, newest only
    history: bool = False

    def __post_init__(self) -> None:
        if self.model_id is not None:
            hub.check_id("hub.model_id", self.model_id)


@dataclass
class TrainConfig:
    MOVED: ClassVar[dict[str, compat.Move]] = MOVED_KEYS  # earlier releases' keys, still read (theworld/core/config.py)

    model: ModelConfig = field(default_factory=ModelConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    lora: LoraConfig | None = None  # LoRA adapters on frozen parts (theworld/model/lora.py, docs/training.md)
    train: TrainSection = field(default_factory=TrainSection)
    profile: ProfileConfig = field(default_factory=ProfileConfig, metadata=NEUTRAL)
    cache_dir: str = DEFAULT_CACHE  # the one cache trained on; or `data`, leaving this at its default
    data: list[MixtureEntry] = field(default_factory=list)  # a weighted mixture of caches (train/data/mixture.py)
    output_dir: str = neutral("runs/stage1")
    seed: int = 0
    # auto: the newest complete checkpoint in output_dir, if any; a path; null: fresh
    resume: str | None = neutral("auto")
    init_from: str | None = None  # a previous stage's final/ (or checkpoint dir, or .safetensors file)
    # tensorboard, wandb; [] for none
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"], metadata=NEUTRAL)
    wandb: WandbConfig = field(default_factory=WandbConfig, metadata=NEUTRAL)
    hub: HubConfig = field(default_factory=HubConfig, metadata=NEUTRAL)
    # a cache_dir or data[].cache that is a URL, the node's shard cache, the read-ahead, the shuffle window and node
    # groups; its keys but shuffle_window and node_groups are resume-neutral (STORAGE_NEUTRAL)
    storage: Settings = field(default_factory=Settings)

    def caches(self) -> list[tuple[str, float | str]]:
        """(cache folder, weight) of each cache trained on: cache_dir with weight 1, or the `data` mixture."""
        return [(e.cache, e.weight) for e in self.data] if self.data else [(self.cache_dir, 1.0)]

    @property
    def joined(self) -> bool:
        """A `data` mixture read as one cache: every weight is `samples` (each training sample once an epoch)."""
        return bool(self.data) and all(e.weight == BY_SAMPLES for e in self.data)

    def __post_init__(self) -> None:
        require_path("cache_dir", self.cache_dir), require_path("output_dir", self.output_dir)
        if self.data and self.cache_dir != DEFAULT_CACHE:
            raise UserError(
                "config keys 'cache_dir' and 'data' are both set: use cache_dir for one cache, data for a mixture"
            )
        check_mixture(self.data)
        check_node_groups(self)
        for cache, _ in self.caches():  # a run deletes unfinished writes (.tmp-*) in its output_dir
            if os.path.realpath(cache) == os.path.realpath(self.output_dir):
                raise UserError(
                    f"config key 'output_dir': {self.output_dir} is the cache {cache} trained on; the run's "
                    "checkpoints and clean-up would mix with the cache's files: use another output_dir"
                )
        check_lora(self.freeze, self.lora)
        for t in self.trackers:
            if t not in TRACKERS:
                raise UserError(f"config key 'trackers': unknown tracker {t!r} (known: {', '.join(TRACKERS)})")
        if self.resume == "":
            self.resume = None


def check_node_groups(cfg: TrainConfig) -> None:
    """storage.node_groups > 1 orders one cache of one latent shape (checked with the cache: order.check_sizes) a
    window of shards at a time, each global batch in equal parts."""
    groups, g = cfg.storage.node_groups, cfg.train.global_batch_size
    if groups == 1:
        return
    if cfg.data and not cfg.joined or cfg.train.loader.group_by_length:
        what = "a 'data' mixture by weight" if cfg.data else "train.loader.group_by_length"
        raise UserError(
            f"config key 'storage.node_groups': {what} orders its samples otherwise than a window of shards in "
            f"parts: leave node_groups at 1{f' (or give every cache weight {BY_SAMPLES})' if cfg.data else ''}"
        )
    if g % groups:
        raise UserError(
            f"config key 'storage.node_groups': train.global_batch_size {g} does not split into {groups} equal "
            "parts; use a divisor of it"
        )


MAX_WEIGHT_RATIO = 1e6  # data weights further apart give a cache no sample of an epoch, or lose the others in rounding


def check_mixture(data: list[MixtureEntry]) -> None:
    """A mixture names each cache once (by its real path: a symlink or another spelling is the same cache, which would
    be drawn twice per epoch) and its weights are within MAX_WEIGHT_RATIO of each other."""
    seen: dict[str, str] = {}
    for e in data:
        real = os.path.realpath(e.cache)
        if real in seen:
            same = "" if seen[real] == e.cache else f" and {seen[real]} (the same folder, {real})"
            raise UserError(
                f"config key 'data': cache {e.cache}{same} is listed twice; list it once with the sum of its weights"
            )
        seen[real] = e.cache
    by_samples = [e.weight == BY_SAMPLES for e in data]
    if any(by_samples) and not all(by_samples):
        e = data[by_samples.index(False)]
        raise UserError(
            f"config key 'data': weight '{BY_SAMPLES}' reads every cache's training samples once an epoch, so it is "
            f"given to every cache or to none (cache {e.cache} has weight {e.weight:g})"
        )
    weights = [] if any(by_samples) else [e.weight for e in data]
    if weights and max(weights) / min(weights) > MAX_WEIGHT_RATIO:
        raise UserError(
            f"config key 'data': weights {min(weights):g} and {max(weights):g} are more than {MAX_WEIGHT_RATIO:g} "
            "times apart: the smaller would get no sample of an epoch; use weights within that ratio (a share, "
            "e.g. 1 and 3), or leave the cache out"
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def resolve_micro_batch(cfg: TrainConfig, world_size: int) -> int:
    """train.micro_batch_size for `world_size` processes (auto resolved), or a one-line error that suggests values
    that work. Sets it in `cfg` so every later use (loaders, checkpoints' config hash) sees the number."""
    t = cfg.train
    g, m = t.global_batch_size, t.micro_batch_size
    if g % world_size:
        lo, hi = g - g % world_size, g + world_size - g % world_size
        raise UserError(
            f"config key 'train.global_batch_size': {g} does not split over {world_size} processes; use "
            f"a multiple of {world_size}, e.g. {hi}" + (f" or {lo}" if lo else "")
        )
    per_process = g // world_size
    if m == "auto":
        m = _largest_divisor(per_process, t.max_micro_batch_size)
    elif per_process % m:
        raise UserError(
            f"config key 'train.micro_batch_size': {m} does not divide the {per_process} samples each of "
            f"{world_size} process(es) gets of train.global_batch_size {g}; use "
            f"{_largest_divisor(per_process, m)} (or auto)"
        )
    t.micro_batch_size = m
    return m


def accumulation_steps(cfg: TrainConfig, world_size: int) -> int:
    m = resolve_micro_batch(cfg, world_size)
    return cfg.train.global_batch_size // (m * world_size)


def neutral_keys(cls: type, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys of `cls`'s fields declared with `neutral`, through its sections."""
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get(NEUTRAL_KEY):
            keys.append(prefix + config_key(f.name))
        elif dataclasses.is_dataclass(hints[f.name]):
            keys += neutral_keys(hints[f.name], f"{prefix}{f.name}.")
    return tuple(keys)


# the storage section is shared with precompute (theworld/cache_format/storage.py), so its neutral keys are named here
STORAGE_NEUTRAL = ("storage.options", "storage.local_dir", "storage.local_max_gb", "storage.prefetch_shards")
RESUME_NEUTRAL = neutral_keys(TrainConfig) + STORAGE_NEUTRAL
GROUPING_KEYS = ("train.loader.group_by_length", "train.loader.group_window")


def run_hash(cfg: TrainConfig) -> str:
    """Hash of everything that defines the run's numbers (recorded in each checkpoint's state.json), taken over the
    flat `train` section of earlier releases (MOVED_KEYS), so that their checkpoints still resume."""
    d = to_dict(cfg)
    if d.get("lora") is None:  # runs without LoRA keep the hash they had before the section existed
        d.pop("lora", None)
    if not cfg.world.num_world_steps:  # without rollouts the other world-step keys change nothing, and runs keep
        for key in ("num_world_steps", "max_world_steps", "rollout"):  # the hash they had before the keys existed
            d["world"].pop(key, None)
    else:  # a setting at its default leaves the hash runs had before it existed
        for key, default in ROLLOUT_DEFAULTS.items():
            if d["world"]["rollout"].get(key) == default:
                del d["world"]["rollout"][key]
    if not cfg.storage.shuffle_window:  # the global order: runs keep the hash they had before the key existed
        d["storage"].pop("shuffle_window")
    if cfg.storage.node_groups == 1:  # likewise
        d["storage"].pop("node_groups")
    for key in RESUME_NEUTRAL:
        _pop(d, key)
    if not cfg.train.loader.group_by_length:  # runs without grouping keep the hash they had before the keys existed
        for key in GROUPING_KEYS:
            _pop(d, key)
    for old, move in MOVED_KEYS.items():
        value = _pop(d, move.new)
        if value is not _MISSING:
            _put(d, old, value)
    if not d["storage"]:
        del d["storage"]  # every key of it moved back, or neutral
    for section in [k for k, v in d["train"].items() if v == {} and dataclasses.is_dataclass(getattr(cfg.train, k))]:
        del d["train"][section]  # every key of it moved back, or neutral
    d["train"]["gradient_checkpointing"] = False  # the hash runs had before it was neutral (false, its default)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


_MISSING = object()


def _put(d: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value


def _pop(d: dict, dotted: str) -> Any:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.get(p, {})
    return d.pop(last, _MISSING)


def load(argv: list[str] | None = None) -> tuple[TrainConfig, object]:
    parser = cli_parser("train.loop", "Train TheWorld from a latent cache (one process, or under accelerate launch).")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the run's steps, tokens, trainable parameters and time (no weights loaded; train/plan.py), exit",
    )
    parser.add_argument(
        "--samples", type=int, default=None, help="with --plan: the cache's samples (default: its manifest's count)"
    )
    parser.add_argument("--gpus", type=int, default=8, help="with --plan: GPUs the time is given for (default 8)")
    args = parser.parse_args(argv)
    return load_config(TrainConfig, args.config, args.overrides), args


__all__ = [
    "TrainConfig",
    "TrainSection",
    "OptimizerConfig",
    "LrSchedule",
    "LoaderConfig",
    "EvalConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "HardwareConfig",
    "ActivationCheckpointing",
    "PlateauConfig",
    "EvalSet",
    "KeepBest",
    "WandbConfig",
    "HubConfig",
    "LrMultipliers",
    "ProfileConfig",
    "accumulation_steps",
    "resolve_micro_batch",
    "run_hash",
    "load",
    "to_yaml",
]
