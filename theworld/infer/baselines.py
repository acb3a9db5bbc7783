"""The conditions a stage is evaluated under, each a column on the same items: the model with each item's own world,
and the baselines it is compared with.

- `shuffled_world`: item i gets the world latents of item i-1 (the first gets the last one's): does the world pathway
  carry information about the scene?
- `no_world`: the same Gemma weights with no world block at all (no SOW, world or EOW tokens): the base model as its
  users know it. For a stage that trained only the projector this is Gemma 3 itself.
- `constant_latent`: every item gets the world tokens of one constant latent, the VAE's own per-channel latent mean
  (`latents_mean`, which the projector subtracts before anything else, so it is the zero of the projector's input).
  It needs no cache (evaluation runs from images) and is the latent "the average scene" has by the VAE's statistics;
  a raw zero latent is (-mean / std) in the projector's units, an arbitrary point. The model keeps the world block's
  length and markers, with no information about the scene in it.
- `init_projector`: the projector as the run initialised it (its seed in the stage's config.yaml), the rest of the
  stage's weights unchanged: what training the projector bought. For a later stage (init_from a previous one) this
  is still the seed's fresh projector, not the previous stage's.
- `base_gemma`: the stage's Gemma before any training (the base model its config.yaml names under `model.gemma`), with
  no world block: the untouched base model's own score. Equal to `no_world` while every stage froze Gemma; where a
  stage trained Gemma (or LoRA adapters on it), the trained tensors are swapped for the base model's (adapters
  switched off) for this column only. Named alone, not part of `all` (it loads the base Gemma's weights once more).
- `no_rollout` (stages trained with world rollouts, world.num_world_steps > 0): the world block of the observed frame
  alone, with its temporal embedding (row 0), without the predicted frames: does imagining the future help? It is
  part of `all` only for such stages; asking for it on a stage without rollouts is an error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from theworld.core.errors import UserError
from theworld.model import stage_layout as layout


@dataclass(frozen=True)
class Condition:
    name: str
    world: str  # "own", "previous", "constant" or "none"
    init_projector: bool = False
    base_gemma: bool = False  # the base model's Gemma weights in place of the stage's (BaseGemma)
    rollout: bool = True  # False: the observed frame alone (its world block without the predicted frames)


MODEL = Condition("model", "own")
SHUFFLED = Condition("shuffled_world", "previous")
BASELINES = {
    c.name: c
    for c in (
        Condition("no_world", "none"),
        Condition("constant_latent", "constant"),
        SHUFFLED,
        Condition("init_projector", "own", init_projector=True),
    )
}
# baselines of stages trained with world rollouts (world.num_world_steps > 0) only
ROLLOUT_BASELINES = {c.name: c for c in (Condition("no_rollout", "own", rollout=False),)}
BASE_GEMMA = Condition("base_gemma", "none", base_gemma=True)
KNOWN = {**BASELINES, **ROLLOUT_BASELINES, BASE_GEMMA.name: BASE_GEMMA}


def parse(spec: str | list[str] | None, world_steps: int | None = None) -> list[str]:
    """`all`, or comma-separated names (a list: already split) -> baseline names in KNOWN's order. `world_steps`: the
    stage's world.num_world_steps: `all` adds the rollout baselines when it is > 0, and naming one when it is 0 is an
    error; None (the stage is not known yet): every name is accepted, `all` is BASELINES."""
    if not spec:
        return []
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if "all" in names:
        if len(set(names)) > 1:
            raise UserError(
                f"--baselines: all already names every baseline ({', '.join(KNOWN)}); give all alone, or "
                f"the names without it (got {','.join(names)})"
            )
        return list({**BASELINES, **ROLLOUT_BASELINES} if world_steps else BASELINES)
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise UserError(f"--baselines: unknown baseline {unknown[0]!r} (known: all, {', '.join(KNOWN)})")
    if world_steps == 0 and (rollout := [n for n in names if n in ROLLOUT_BASELINES]):
        raise UserError(
            f"--baselines: {rollout[0]} compares a stage's world rollouts with the observed frame alone, but this "
            "stage has none (world.num_world_steps 0); leave it out"
        )
    return [n for n in KNOWN if n in names]


def conditions(baselines: list[str]) -> list[Condition]:
    """The model, the shuffled world (always reported), then the other baselines asked for."""
    return [MODEL, SHUFFLED] + [KNOWN[n] for n in baselines if n != SHUFFLED.name]


def world_inputs(
    model, cond: Condition, mean: torch.Tensor, logvar: torch.Tensor, own: torch.Tensor, previous: torch.Tensor
) -> dict:
    """The world inputs (`ModelInputs.with_inputs` keyword arguments) giving each row its world under `cond`;
    `mean`/`logvar` hold the latents of the worlds in play, `own`/`previous` index them per row."""
    if cond.world == "none":
        return {"use_world": False}
    frames = {} if cond.rollout else {"use_rollout": False}
    if cond.world == "constant":
        channels = model.projector.latents_mean.reshape(1, -1, *[1] * (mean.dim() - 2)).to(mean.dtype)
        constant = mean[own] * 0 + channels
        return {"latent_mean": constant, "latent_logvar": torch.zeros_like(constant), **frames}
    at = own if cond.world == "own" else previous
    return {"latent_mean": mean[at], "latent_logvar": logvar[at], **frames}


class InitProjector:
    """The run's initial projector weights, swapped into the model for the `init_projector` condition."""

    def __init__(self, model, world_cfg, seed: int):
        with torch.random.fork_rng(
            devices=list(range(torch.cuda.device_count()))
        ):  # seeding here must not move the caller's (a training run's) RNG
            fresh = type(model).new_projector(model.gemma, model.world_encoder, world_cfg, seed)
        self.state = fresh.to(next(model.projector.parameters()).device).state_dict()

    @classmethod
    def for_stage(cls, model, stage: layout.Stage) -> InitProjector:
        """The initial projector of the run whose stage folder (final/ or checkpoint-N/) this is: its config's
        `world` section and `seed`."""
        return cls(model, stage.sections.world, stage.seed)

    @contextlib.contextmanager
    def active(self, model):
        trained = {k: v.clone() for k, v in model.projector.state_dict().items()}
        model.projector.load_state_dict(self.state)
        try:
            yield
        finally:
            model.projector.load_state_dict(trained)


class BaseGemma:
    """The base Gemma's values of the tensors a stage trained in its Gemma (read from the model folder its config
    names), swapped in for the `base_gemma` condition; LoRA adapters are switched off meanwhile."""

    def __init__(self, model, stage: layout.Stage):
        from safetensors import safe_open

        from theworld.model import encoders
        from theworld.model import lora as lora_adapters

        with safe_open(str(stage.folder / layout.WEIGHTS), "pt") as f:
            trained = [k.removeprefix("gemma.") for k in f.keys() if k.startswith("gemma.")]
        trained = [k for k in trained if not lora_adapters.is_adapter(k)]
        self.adapters = list(lora_adapters.adapted_layers(model.gemma).values())
        self.state = {}
        if trained:
            base = encoders.load_gemma(stage.sections.model.gemma, stage.sections.model.dtype)[0].state_dict()
            own = dict(model.gemma.state_dict())
            for k in trained:
                name = lora_adapters.adapted_name(k, own)
                self.state[name] = base[k.replace(".base_layer.", ".")].to(own[name].device, own[name].dtype)

    @contextlib.contextmanager
    def active(self, model):
        params = dict(model.gemma.state_dict())
        trained = {k: params[k].clone() for k in self.state}
        with torch.no_grad():
            for k, v in self.state.items():
                params[k].copy_(v)
        for layer in self.adapters:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in self.adapters:
                layer.enable_adapters(True)
            with torch.no_grad():
                for k, v in trained.items():
                    params[k].copy_(v)


@contextlib.contextmanager
def applied(model, cond: Condition, init: InitProjector | None, base: BaseGemma | None = None):
    if cond.init_projector:
        if init is None:
            raise ValueError("the init_projector condition needs the run's initial projector (InitProjector)")
        with init.active(model):
            yield
    elif cond.base_gemma:
        if base is None:
            raise ValueError("the base_gemma condition needs the base model's weights (BaseGemma)")
        with base.active(model):
            yield
    else:
        yield
