"""Preemption: SIGTERM (a scheduler's notice) or SIGINT (Ctrl-C) ends the run at the next step boundary with a
checkpoint, so rerunning the same command continues it exactly.

The signal handler only records the signal; the loop asks `requested()` after every step. Under several processes the
flag is all-reduced (max) each step, so every rank stops after the same step, saves together and nobody waits in a
collective for a rank that left. A second signal while the checkpoint is being written stops at once (the previous
checkpoint stays intact: saves are atomic).
"""
from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from train.config import TrainConfig
    from train.metrics import Metrics

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + signal number, what a shell reports


class Preemption:
    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.signum: int | None = None
        self._previous = {}

    def install(self) -> "Preemption":
        for sig in EXIT_CODES:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name} received: finishing this step, then saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

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
        if step % cfg.train.save_every:
            save()
        metrics.message(f"stopped by {signal.Signals(self.signum).name} after step {step}: checkpoint "
                        f"{cfg.output_dir}/checkpoint-{step}; rerun the same command to resume from it")
        metrics.close()
        return self.exit_code


def ignore_in_workers() -> None:
    """In a DataLoader worker: Ctrl-C reaches the whole process group, and a worker that dies of it mid-batch would
    turn the graceful stop into a loader error; the main process decides when to stop, then shuts the workers down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
