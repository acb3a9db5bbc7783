"""Preemption: SIGTERM (a scheduler's notice) or SIGINT (Ctrl-C) ends the run at the next step boundary with a
checkpoint, so rerunning the same command continues it exactly.

The signal handler only records the signal; the loop asks `requested()` after every step. Under several processes the
flag is all-reduced (max) each step, so every rank stops after the same step, saves together and nobody waits in a
collective for a rank that left. A second signal while the checkpoint is being written stops at once (the previous
checkpoint stays intact: saves are atomic).

A launcher waits only so long after forwarding its SIGTERM (torch elastic: 30 s, then SIGKILL), and an eval (a large
benchmark) can take minutes. So the evals ask `poll()` between batches: a request cuts the running eval short
(`EvalCut`, nothing of it logged) and the run goes straight to its checkpoint. Every process polls at the same points
of an eval (its batches are counted to the longest share), so the check can be a collective too.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from theworld.core import log

_log = log.get(__name__)

if TYPE_CHECKING:
    from accelerate import Accelerator

    from train.config import TrainConfig
    from train.metrics import Metrics

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + signal number, what a shell reports
# A launcher passes its stop signal on to processes that may have had it already (a Ctrl-C, or a scheduler that
# signals the whole process group): a repeat this close to the first is the same request, not "stop at once".
REPEAT_S = 1.0
_active: Preemption | None = None  # the installed one, which `poll` asks


class EvalCut(Exception):
    """A stop was requested during an eval: the eval is abandoned so the checkpoint comes first."""


def poll() -> None:
    """Between two batches of an eval, on every process: raise EvalCut when any process was asked to stop."""
    if _active is not None and _active.requested():
        raise EvalCut


class Preemption:
    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.signum: int | None = None  # this process's signal, or another's (`requested`)
        self._received: float | None = None  # when this process got its first signal
        self._previous = {}

    def install(self) -> Preemption:
        global _active
        for sig in EXIT_CODES:
            self._previous[sig] = signal.signal(sig, self._handle)
        _active = self
        return self

    def restore(self) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        _active = None

    def _handle(self, signum: int, frame) -> None:
        if self._received is not None:  # asked twice: stop now
            if time.monotonic() - self._received < REPEAT_S:
                return
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        self._received = time.monotonic()
        self.signum = self.signum or signum
        _log.info(
            f"{signal.Signals(signum).name} received: finishing this step, then saving a checkpoint "
            "(send it again to stop at once)"
        )

    def requested(self) -> bool:
        """Whether any process got a signal (a collective under several processes: call it on every rank)."""
        flag = torch.tensor([0 if self.signum is None else int(self.signum)], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="max")  # ranks may have got different signals, or none
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())
        return bool(flag.item())

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 128 + (self.signum or 0))

    def finish(self, step: int, cfg: TrainConfig, save: Callable[[], None], metrics: Metrics) -> int:
        """After the step that saw the request: its checkpoint (unless just saved), where it is, the exit code."""
        name = signal.Signals(self.signum).name
        if step == 0:
            metrics.message(f"stopped by {name} before the first step: nothing to save")
            metrics.close()
            return self.exit_code
        if step % cfg.train.checkpoint.every:
            save()
        metrics.message(
            f"stopped by {name} after step {step}: checkpoint {cfg.output_dir}/checkpoint-{step}; rerun "
            "the same command to resume from it"
        )
        metrics.close()
        return self.exit_code


def cut_message(step: int) -> str:
    """What the run says of an eval a stop request cut short."""
    signum = _active.signum if _active is not None else None
    name = signal.Signals(signum).name if signum else "a stop request"
    return (
        f"{name} during the eval at step {step}: eval cut short and not logged, so the checkpoint is written "
        "before the launcher's grace period ends"
    )


def ignore_in_workers() -> None:
    """In a DataLoader worker: a stop signal to the whole process group (Ctrl-C; SLURM signals every process of a job
    step) reaches the workers too, and a worker that dies of it turns the graceful stop into a loader error with no
    checkpoint. The main process decides when to stop, then shuts the workers down; so SIGINT is ignored, and a
    SIGTERM ends the worker only when its parent sent it (the DataLoader's own shutdown, as torch's handler does)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Python's handlers cannot see who sent a signal: it stays blocked in every thread and one thread takes it with
    # its sender (threads started later inherit the mask, so none of them gets it either)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_take_sigterm, args=(os.getppid(),), name="sigterm", daemon=True).start()


def _take_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent or os.getppid() != parent:  # the loader's shutdown, or the main process is gone
            os._exit(0)


def worker_killed_by(error: BaseException, stop: Preemption) -> bool:
    """Whether `error` is the loader's report of a worker that died of the stop signal this process got as well
    (one started just then, before it could take the signal over): the stop, not a failure."""
    return stop.signum is not None and isinstance(error, RuntimeError) and "killed by signal" in str(error)
