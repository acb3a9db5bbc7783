"""`train.checkpoint.keep_best: {metric, mode}`: which complete checkpoint has the best value of a metric in
metrics.jsonl. Read from the log each time, so a resumed run (whose log holds the earlier evals) keeps the same one;
a step logged twice (a killed run's eval repeated after its resume) counts by its last line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from theworld.model.stage_layout import CHECKPOINT_RE
from train.metrics import METRICS

if TYPE_CHECKING:
    from train.config import KeepBest


def values(output_dir: str | Path, metric: str) -> dict[int, float]:
    """step -> the metric's value on that step's last line that has it (finite numbers only)."""
    path = Path(output_dir) / METRICS
    out: dict[int, float] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # a line being written by a killed run
            continue
        v = event.get(metric) if isinstance(event, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[int(event["step"])] = float(v)
    return out


def best(output_dir: str | Path, checkpoints: list[Path], keep: KeepBest | None) -> tuple[Path, float] | None:
    """The checkpoint among `checkpoints` whose step has the best value (ties: the earliest), with the value; None
    without keep_best or when no checkpoint's step has one."""
    if keep is None:
        return None
    got = values(output_dir, keep.metric)
    scored = [(got[s], s, p) for p in checkpoints if (s := int(CHECKPOINT_RE.match(p.name).group(1))) in got]
    if not scored:
        return None
    sign = 1 if keep.mode == "min" else -1
    value, _, path = min(scored, key=lambda t: (sign * t[0], t[1]))
    return path, value


def card_line(output_dir: str | Path, checkpoints: list[Path], keep: KeepBest | None) -> str:
    """The model card's line naming the best checkpoint ('' without keep_best)."""
    if keep is None:
        return ""
    found = best(output_dir, checkpoints, keep)
    if found is None:
        return f"- best checkpoint by {keep.metric} ({keep.mode}): none measured yet\n"
    return f"- best checkpoint by {keep.metric} ({keep.mode}): `{found[0].name}` ({keep.metric} {found[1]:.4f})\n"
