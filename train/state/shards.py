"""Sharded checkpoints of FSDP runs (train.checkpoint.sharded, the default under FSDP over several processes): every
process writes its own shard of the trainable weights, their EMA and the AdamW state through
`torch.distributed.checkpoint` (DCP; files `.metadata` and `__<rank>_0.distcp` in the checkpoint folder), so no
process gathers whole tensors; the main process adds the small parts (RNG, config, state.json) as in a whole
checkpoint and seals the folder the same way (train/state/checkpoint.py: state.json last, with every file's sha256,
then the rename). With train.checkpoint.async the shards are copied to host memory and written by a background thread
while training goes on; the main process seals the checkpoint only once every process's shard is on disk, so a run
killed meanwhile resumes from the checkpoint before it. A resume reads the shards into this run's layout, whatever
its process count (DCP reshards).
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from theworld.core import atomic, log
from theworld.core.errors import UserError
from theworld.core.process_group import gather_ints
from train.state import migrations
from train.state.states import Ema, Optimizer, Stateful, Trainables, run_states

if TYPE_CHECKING:
    from train.components import Components
    from train.step import LoopState

METADATA = ".metadata"  # DCP's index of the shards: present in a sharded checkpoint only
TENSOR_PARTS = (Trainables, Optimizer, Ema)  # what the shards hold instead of their own files
_log = log.get(__name__)


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint at `path` holds DCP shards rather than whole-tensor files."""
    return (path / METADATA).is_file()


def _names(c: Components) -> list[str]:
    return [n for n, p in c.raw.named_parameters() if p.requires_grad]


def _optimizer_names(c: Components) -> list[str]:
    """The trainable parameters' names in the optimiser's index order (its groups' parameters, in turn)."""
    name_of = {id(p): n for n, p in c.raw.named_parameters()}
    return [name_of[id(p)] for g in c.optimizer.param_groups for p in g["params"]]


def tensors(c: Components, optimizer: bool) -> dict:
    """The DCP state dict: this process's views of the trainable weights, their EMA and the AdamW state by parameter
    name (DTensors under FSDP; DCP writes each process's slice and the replicated step counts once)."""
    names = _names(c)
    sd: dict = {"trainable": {n: p.detach() for n, p in zip(names, c.params)}}
    if c.ema is not None:
        sd["ema"] = dict(zip(names, c.ema))
    if optimizer:
        state = c.optimizer.state_dict()["state"]
        sd["optimizer"] = {n: state[i] for i, n in enumerate(_optimizer_names(c)) if i in state}
    return sd


def _template(c: Components, optimizer: bool) -> dict:
    """`tensors`' layout to load into, with AdamW state to fill where the fresh optimiser has none yet."""
    sd = tensors(c, False)
    if optimizer:
        params = [p for g in c.optimizer.param_groups for p in g["params"]]
        sd["optimizer"] = {
            n: {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p.detach()),
                "exp_avg_sq": torch.zeros_like(p.detach()),
            }
            for n, p in zip(_optimizer_names(c), params)
        }
    return sd


def small_parts(parts: list[Stateful]) -> list[Stateful]:
    """The parts of `run_states` the shards do not hold: the RNG, the config, state.json's records."""
    return [p for p in parts if not isinstance(p, TENSOR_PARTS)]


def record(c: Components, optimizer: bool) -> dict:
    """What state.json says of the shards (and the format that has them)."""
    return {
        "format_version": migrations.SHARDED_VERSION,
        "shards": {"processes": c.world_size, "optimizer": optimizer, "ema": c.ema is not None},
    }


class ShardedSaver:
    """Writes sharded checkpoints; with `asynchronous`, one at a time in the background over a process group of its
    own (gloo), so its collectives never interleave with training's."""

    def __init__(self, asynchronous: bool):
        import torch.distributed as dist

        self.asynchronous = asynchronous
        self.group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None
        self.pending: tuple[Future, threading.Thread | None, list] | None = None  # the save in flight

    def save(self, c: Components, state: LoopState, steps_per_epoch: int, cache: dict | None, seal) -> None:
        """Every process: checkpoint-<step> from this step's state. `seal(tmp, parts, given)`: the main process's
        completion of the folder (train/state/checkpoint.py). Returns once this process's shard is written, or
        (asynchronous) once it is copied to host memory."""
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save in flight
        optimizer = c.cfg.train.checkpoint.save_optimizer
        name = f"checkpoint-{state.step}"
        pid = gather_ints(c.accelerator, os.getpid())[0]  # the folder the main process will rename
        tmp = atomic.partial_path(Path(c.cfg.output_dir) / name, pid=pid)
        main = c.accelerator.is_main_process
        parts = small_parts(run_states(c, state, steps_per_epoch, cache, optimizer))
        given = [part.state_dict() for part in parts] + [record(c, optimizer)] if main else []
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        c.accelerator.wait_for_everyone()
        writer = dcp.FileSystemWriter(str(tmp))
        if not self.asynchronous:
            dcp.save(tensors(c, optimizer), storage_writer=writer)
            if main:
                seal(tmp, name, parts, given)
            return
        future = dcp.async_save(tensors(c, optimizer), storage_writer=writer, process_group=self.group)
        errors: list = []
        sealer = None
        if main:  # sealed as soon as every shard is on disk (the future completes after the last one's metadata)

            def finish() -> None:
                try:
                    future.result()
                    seal(tmp, name, parts, given)
                except BaseException as e:  # noqa: BLE001  raised on the training thread at the next wait
                    errors.append(e)

            sealer = threading.Thread(target=finish, name=f"seal-{name}", daemon=True)
            sealer.start()
        self.pending = (future, sealer, errors)

    def wait(self) -> None:
        """Until the save in flight is written (and, on the main process, sealed); its error, if it failed."""
        if self.pending is None:
            return
        future, sealer, errors = self.pending
        self.pending = None
        if sealer is not None:
            sealer.join()
        else:
            future.result()
        if errors:
            raise errors[0]


def load(c: Components, path: Path, optimizer: bool) -> None:
    """Every process: the shards of the checkpoint at `path` into this run's weights, EMA and AdamW state, in this
    run's layout (resharded by DCP when the process count differs)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    sd = _template(c, optimizer)
    alone = not dist.is_initialized()  # one process without a group reads every shard (restore says so)
    try:
        with warnings.catch_warnings():  # DCP warns of it even when told
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(path), no_dist=alone)
    except Exception as e:  # a missing or damaged shard, or another trainable set
        raise UserError(
            f"resume: cannot read the shards of {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); move "
            "this checkpoint out of output_dir and resume: auto takes the one before it"
        ) from e
    if optimizer:
        saved = {
            "state": {i: sd["optimizer"][n] for i, n in enumerate(_optimizer_names(c))},
            "param_groups": c.optimizer.state_dict()["param_groups"],
        }
        Optimizer(c).load_state_dict(saved)
