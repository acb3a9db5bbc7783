"""The parts of a run's state, each saying how it saves and loads itself (torchtitan's `Stateful`): `state_dict()` on
every process (a collective where the part is sharded: the main process gets whole tensors, the others None) and
`load_state_dict()` with what the checkpointer read back from the part's `file`. The file's suffix says its format
(train/state/checkpoint.py): `.safetensors` tensors, `.pt` torch.save'd state of tensors and numbers (read with
weights_only=True), `.yaml` text, and `state.json` small JSON records, one flat object that every record adds its keys
to (in the order of `run_states`, the order state.json has always had).

The learning-rate schedule and the data order are pure functions of the step (and the seed), so their records hold
where they are rather than any state of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from theworld.model.stage_layout import CONFIG, EMA, OPTIMIZER, RECORDS_KEY, RECORDS_VERSION, RNG, STATE, WEIGHTS
from theworld.model.world import local_like
from train import sharding
from train.config import run_hash, to_yaml
from train.state import migrations as checkpoint_migrations
from train.step import LoopState

if TYPE_CHECKING:
    from train.components import Components


class Stateful(Protocol):
    file: str  # the checkpoint file it goes in (theworld/model/stage_layout.py)

    def state_dict(self) -> dict | None: ...

    def load_state_dict(self, state: dict) -> None: ...


def _trainable_names(components: Components) -> list[str]:
    """Names of the trainable parameters, in the order of `components.params` and `components.ema`."""
    return [n for n, p in components.raw.named_parameters() if p.requires_grad]


def _keeps(components: Components) -> bool:
    """Whether this process must take part in state_dict(): the main process, and every process under FSDP (the
    gather is a collective, one tensor at a time)."""
    return components.sharded or components.accelerator.is_main_process


@dataclass
class Trainables:
    """The trainable parameters by their model names (trainable.safetensors, its header saying that the folder
    records its files' sha256)."""

    components: Components
    where: str = WEIGHTS  # named in the message of a file that does not hold this run's trainable set
    file: str = WEIGHTS
    metadata: ClassVar[dict] = {RECORDS_KEY: RECORDS_VERSION}

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        c = self.components
        if not _keeps(c):
            return None
        keep = c.accelerator.is_main_process
        whole = {n: sharding.whole(p, keep) for n, p in zip(_trainable_names(c), c.params)}
        return whole if keep else None

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.components.raw.load_tensors(state, self.where, strict=True)


@dataclass
class Optimizer:
    """AdamW's state dict in torch's own layout, whole tensors (any sharding, any process count reads it)."""

    components: Components
    file: str = OPTIMIZER

    def state_dict(self) -> dict | None:
        c = self.components
        if not _keeps(c):
            return None
        keep = c.accelerator.is_main_process
        opt = c.optimizer.state_dict()
        opt["state"] = {
            i: {k: sharding.whole(v, keep) if torch.is_tensor(v) else v for k, v in st.items()}
            for i, st in sorted(opt["state"].items())
        }
        return opt if keep else None

    def load_state_dict(self, saved: dict) -> None:
        """Each process keeps its slice; the learning-rate multipliers are the config's, not the checkpoint's."""
        c = self.components
        params = [p for g in c.optimizer.param_groups for p in g["params"]]
        saved = checkpoint_migrations.optimizer(c, saved)
        saved["state"] = {
            i: {
                # whole tensors (a whole checkpoint) to this process's slice; a sharded checkpoint's are slices
                k: local_like(params[i], v)
                if torch.is_tensor(v) and v.shape == params[i].shape and not sharding.is_sharded(v)
                else v
                for k, v in st.items()
            }
            for i, st in saved["state"].items()
        }
        c.optimizer.load_state_dict(saved)
        for g in c.optimizer.param_groups:
            if "part" in g:
                g["lr_multiplier"] = getattr(c.cfg.train.optimizer.lr_multipliers, g["part"])


@dataclass
class Ema:
    """The EMA of the trainable weights (train.optimizer.ema > 0), by the same names."""

    components: Components
    file: str = EMA
    missing: ClassVar[str] = " but train.optimizer.ema is on"

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        c = self.components
        if not _keeps(c):
            return None
        keep = c.accelerator.is_main_process
        whole = {n: sharding.whole(t, keep) for n, t in zip(_trainable_names(c), c.ema)}
        return whole if keep else None

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        c = self.components
        for t, n in zip(c.ema, _trainable_names(c)):
            t.copy_(local_like(t, state[n]))


@dataclass
class Rng:
    """torch's CPU RNG state of the main process."""

    file: str = RNG

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"torch_cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["torch_cpu"])


@dataclass
class RunConfig:
    """The resolved config (config.yaml: what `TheWorld.from_pretrained` reads). Saved only: a resume runs under the
    config it is given, compared with the checkpoint's by `RunRecord`'s hash."""

    cfg: object
    file: str = CONFIG
    saved_only: ClassVar[bool] = True  # checkpoints of format 1 may lack it

    def state_dict(self) -> dict[str, str]:
        return {"text": to_yaml(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class LoopFields:
    """Some fields of the run's LoopState as a state.json record; a field the checkpoint lacks (an older one) takes
    its default, as a fresh LoopState would."""

    state: LoopState
    keys: tuple[str, ...]
    file: str = STATE

    def state_dict(self) -> dict:
        return {k: getattr(self.state, k) for k in self.keys}

    def load_state_dict(self, saved: dict) -> None:
        fresh = LoopState()
        for k in self.keys:
            setattr(self.state, k, saved[k] if k in saved else getattr(fresh, k))


# LoopState's fields by the part of the run they belong to (every field in exactly one)
SCHEDULE = ("step",)  # the schedule's position: the learning rate is a pure function of it
PLATEAU = ("eval_history", "plateau_step")  # train/eval/plateau.py's record
TRACKERS = ("wandb_run_id",)  # the W&B run a resumed run continues
PROGRESS = tuple(f.name for f in fields(LoopState) if f.name not in SCHEDULE + PLATEAU + TRACKERS)


@dataclass
class DataOrder:
    """Where the data order is (a pure function of (seed, step): nothing to restore) and which samples it orders
    (`cache`: compared on resume by train.checkpoint.restore)."""

    state: LoopState
    steps_per_epoch: int
    cache: dict | None
    file: str = STATE

    def state_dict(self) -> dict:
        epoch, cursor = divmod(self.state.step, self.steps_per_epoch)
        return {"epoch": epoch, "data_cursor": {"epoch": epoch, "batch_in_epoch": cursor}, "cache": self.cache}

    def load_state_dict(self, saved: dict) -> None:
        pass


@dataclass
class RunRecord:
    """What the checkpoint was written under: the config's hash, the process count (compared on resume by
    train.checkpoint.restore) and the checkpoint format."""

    cfg: object
    num_processes: int
    file: str = STATE

    def state_dict(self) -> dict:
        return {
            "config_hash": run_hash(self.cfg),
            "num_processes": self.num_processes,
            "format_version": checkpoint_migrations.FORMAT_VERSION,
        }

    def load_state_dict(self, saved: dict) -> None:
        pass


def run_states(
    components: Components,
    state: LoopState,
    steps_per_epoch: int,
    cache: dict | None,
    optimizer: bool = True,
    source: Path | None = None,
) -> list[Stateful]:
    """Every part of a training run's state, in the order they are saved and restored (the RNG after the tensors, as
    before the parts were separate; state.json's records in the order of its keys). `optimizer`: False for a
    weights-only checkpoint (train.checkpoint.save_optimizer: false), or to resume from one. `source`: the checkpoint
    they are restored from (named in messages)."""
    c = components
    parts: list[Stateful] = [Trainables(c, str(source / WEIGHTS)) if source else Trainables(c)]
    if optimizer:
        parts.append(Optimizer(c))
    if c.ema is not None:
        parts.append(Ema(c))
    parts += [
        Rng(),
        RunConfig(c.cfg),
        LoopFields(state, SCHEDULE),
        LoopFields(state, PROGRESS),
        LoopFields(state, PLATEAU),
        LoopFields(state, TRACKERS),
        DataOrder(state, steps_per_epoch, cache),
        RunRecord(c.cfg, c.accelerator.num_processes),
    ]
    return parts
