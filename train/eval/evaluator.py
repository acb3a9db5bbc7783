"""What runs at an eval, one interface: `Trainer.run_eval` calls each evaluator's `run` (every process: under FSDP
each forward is a collective) and then its `log` (what it writes to metrics.jsonl, the trackers and the console), in
the order `evaluators` is given them: caption samples, the held-out loss, the benchmarks, the alignment view.
Captions come first so an eval's loss line stays its last line but for the benchmarks' (and the alignment's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from train.components import Components
    from train.metrics import Metrics
    from train.step import LoopState


class Evaluator(Protocol):
    def run(self, components: Components) -> dict | list:
        """This eval's results (metrics, or caption rows); may raise train.preempt.EvalCut."""

    def log(self, metrics: Metrics, state: LoopState, results) -> None:
        """Record `run`'s results for the eval at `state.step`."""


def evaluators(*candidates: Evaluator | None) -> list[Evaluator]:
    """The evaluators a run has, in the order given (None: not configured)."""
    return [e for e in candidates if e is not None]
