"""What a resume changes: the settings of the checkpoint's config.yaml that differ from this run's, named (with old
and new values) in the warning a resume under a different config gives, and the changes a resume refuses before any
model loads: another `world.num_world_steps` (another model), and another cache, model or stage for a finished run,
which would train nothing and relabel final/ with settings its weights never saw."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from theworld.core.config import shown, to_dict
from theworld.core.errors import UserError
from theworld.core.paths import path_kind
from theworld.model.stage_layout import CONFIG, FINAL, read_yaml
from train.config import MOVED_KEYS, RESUME_NEUTRAL

if TYPE_CHECKING:
    from train.config import TrainConfig

# What a finished run's final/ is of: its data, its models and its stage (what trains, and from what)
IDENTITY = ("cache_dir", "data", "model", "freeze", "lora", "init_from", "world", "image")
SHOWN = 4  # changes named in the warning; the rest counted


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix.rstrip("."): d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _current_name(key: str) -> str:
    for old, move in MOVED_KEYS.items():
        if key == old or key.startswith(old + "."):
            return move.new + key[len(old) :]
    return key


def _neutral(key: str) -> bool:
    return any(key == n or key.startswith(n + ".") for n in RESUME_NEUTRAL)


def saved_config(checkpoint: Path) -> dict | None:
    """The checkpoint's config.yaml as a mapping (None where it has none: a checkpoint of an early release)."""
    return read_yaml(checkpoint) if path_kind(checkpoint / CONFIG) is not None else None


def config_changes(saved: dict, cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(key, value then, value now) for every setting that differs, by today's key names; keys the saved config
    lacks (added since) and resume-neutral keys are left out."""
    was = {_current_name(k): v for k, v in _flat(saved).items()}
    now = _flat(to_dict(cfg))
    return [(k, was[k], now[k]) for k in now if k in was and was[k] != now[k] and not _neutral(k)]


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    named = ", ".join(f"{k} {shown(a)} -> {shown(b)}" for k, a, b in changes[:SHOWN])
    return named + (f" and {len(changes) - SHOWN} more" if len(changes) > SHOWN else "")


def check_resume(cfg: TrainConfig, checkpoint: Path, step: int) -> None:
    """Before any model loads: refuse a resume that would change the model, or relabel a finished run."""
    saved = saved_config(checkpoint)
    if saved is None:
        return
    changes = config_changes(saved, cfg)
    steps = next(((a, b) for k, a, b in changes if k == "world.num_world_steps"), None)
    if steps is None and "world" in saved and "num_world_steps" not in (saved.get("world") or {}):
        steps = (0, cfg.world.num_world_steps) if cfg.world.num_world_steps else None  # from before the key
    if steps is not None:
        raise UserError(
            f"config key 'world.num_world_steps': {checkpoint} was trained with {steps[0]}, this run gives {steps[1]}:"
            f" that changes the model's world tokens, so it cannot continue this run; use another output_dir (with "
            f"init_from: {checkpoint} to start from its weights), or --set world.num_world_steps={steps[0]}"
        )
    if step < cfg.train.max_steps:
        return  # the run goes on: what changed is the warning's
    idle = not cfg.world.num_world_steps  # without rollouts the other world-step keys change nothing (run_hash)
    other = [
        c
        for c in changes
        if c[0].split(".")[0] in IDENTITY and not (idle and c[0].startswith(("world.max_world_steps", "world.rollout")))
    ]
    if other:
        out = Path(cfg.output_dir)
        final = f", {out / FINAL}" if (out / FINAL).is_dir() else ""
        raise UserError(
            f"output_dir {out} holds a finished run (step {step}{final}) trained with other settings: "
            f"{describe(other)}; rerunning it would train nothing and label its weights with settings they never "
            f"saw. Use another output_dir for a new run, or --set train.max_steps=N (above {step}) to continue this "
            "one with them"
        )
