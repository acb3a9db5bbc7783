"""Checkpoints of an older format_version, read as the current one: every "written before ..." rule of a checkpoint
folder's state.json and optimizer.pt lives here, so `train.checkpoint` reads one layout.

- 3 (what this code writes for a sharded checkpoint, train/state/shards.py): as 2, with `shards` in state.json
  ({processes, optimizer, ema}) and the trainable weights, their EMA and the AdamW state in torch.distributed.checkpoint
  files (`.metadata`, `__<rank>_0.distcp`) in place of trainable.safetensors, ema.safetensors and optimizer.pt.
- 2 (what this code writes for a whole checkpoint): state.json has `format_version`, the sha256 of every other file,
  the data position, the cache identity, the config hash and the process count, and `state_sha256`, a digest of its
  own content (absent in those written before it: taken as they are, the step still checked against the folder's);
  optimizer.pt has one AdamW group per (part, decay).
- 1 (no `format_version`): any of those may be missing: files without a recorded sha256 are taken as they are;
  without a cache identity, config hash or process count nothing is compared on resume; AdamW state in one group per
  decay setting (decay, then no decay, each in parameter order) is re-keyed by parameter name to the per-part groups.

Both resume, and `init_from` and `TheWorld.from_pretrained` read the weights of either.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from theworld.core import compat
from theworld.core.errors import UserError
from train.optim import decays

if TYPE_CHECKING:
    from train.components import Components

FORMAT_VERSION = 2  # a whole checkpoint's
SHARDED_VERSION = 3  # a sharded one's
READABLE = compat.readable(compat.CHECKPOINT_FORMATS)  # how long each is read: theworld/core/compat.py


def state(saved: dict, path: Path) -> dict:
    """state.json of the checkpoint at `path` read as FORMAT_VERSION (in place), or a one-line refusal of a version
    this code does not read."""
    version = saved.get("format_version", 1)
    if version not in READABLE:
        raise UserError(
            f"resume: {path} has checkpoint format_version {version!r}, this code reads "
            f"{', '.join(map(str, READABLE))}; resume it with the code that wrote it"
        )
    saved.setdefault("sha256", {})
    return saved


def optimizer(components: Components, saved: dict) -> dict:
    """optimizer.pt's state dict in this run's group layout (one group per part and decay setting)."""
    if saved["param_groups"] and "part" not in saved["param_groups"][0]:
        return _from_decay_groups(components, saved)
    return saved


def _from_decay_groups(components: Components, saved: dict) -> dict:
    """State written with the earlier layout, one AdamW group per decay setting (decay, then no decay, each in
    parameter order), re-keyed by parameter name to this optimiser's per-part groups."""
    trainable = [(n, p) for n, p in components.raw.named_parameters() if p.requires_grad]
    before = [n for n, p in trainable if decays(n, p)] + [n for n, p in trainable if not decays(n, p)]
    name_of = {id(p): n for n, p in trainable}
    now = {name_of[id(p)]: i for i, p in enumerate(p for g in components.optimizer.param_groups for p in g["params"])}
    if sum(len(g["params"]) for g in saved["param_groups"]) != len(before):
        raise ValueError(
            f"it holds state for {sum(len(g['params']) for g in saved['param_groups'])} tensors, this "
            f"run trains {len(before)}"
        )
    groups, first = [], 0
    for g in components.optimizer.param_groups:  # the config's hyperparameters; the state is what carries over
        settings = {k: v for k, v in g.items() if k != "params"}
        groups.append({**settings, "params": list(range(first, first + len(g["params"])))})
        first += len(g["params"])
    return {"state": {now[before[i]]: st for i, st in saved["state"].items()}, "param_groups": groups}
