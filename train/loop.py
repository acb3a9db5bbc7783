"""`accelerate launch -m train.loop --config configs/stage1.yaml` (or `python -m train.loop ...`): train from the cache.

Thin on purpose: parse the config, check everything checkable without a model (train/trainer.py's `Checked`, the
config resolved there once), build the run (`Trainer.start`: train/components.py, train/data/cache.py,
train/state/checkpoint.py,
train/metrics.py), run the loop below. See docs/training.md.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from theworld.core import heap, log, run_lock
from theworld.core.errors import cli_entry
from train.config import TrainConfig, load, to_yaml

if TYPE_CHECKING:
    from train.trainer import Trainer

_log = log.get(__name__)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    cfg, args = load(argv)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if args.plan:
        from train import plan  # builds the model on the meta device: nothing of the run starts

        print(plan.render(plan.plan(cfg, args.samples, args.gpus)), end="")
        return 0
    # a launch that cannot train as one group (a MULTI_CPU Accelerate config run as one process) is refused before
    # the model's imports too: torch alone, ~3 s of CPU instead of ~11
    from theworld.core.process_group import launched_processes

    launched_processes()
    with heap.scope():
        return _run(cfg, t_start)


def _run(cfg: TrainConfig, t_start: float) -> int:
    heap.freeze()  # torch's imports: the collector's passes skip them from here on (theworld/core/heap.py)
    # A cache in object storage is opened before transformers is imported (~6 s of CPU a process), so that a wrong
    # URL or an unreachable endpoint is one line within seconds; a local one after the launch's checks, in Checked.
    from theworld.core.location import is_url
    from train.data.cache import open_cache

    opened = open_cache(cfg) if any(is_url(str(c)) for c, _ in cfg.caches()) else None
    from train.components import make_accelerator
    from train.preempt import EXIT_CODES
    from train.trainer import Checked, Trainer

    checked = Checked.of(cfg, opened)  # everything checkable without a model is checked before loading one
    accelerator = make_accelerator(cfg, checked.launch)
    # one run per output_dir: a second one would take this run's unfinished saves for a killed run's and delete them
    with run_lock.hold(cfg.output_dir, accelerator):
        # the run is freed as train returns, before its process group is destroyed below: a DDP model freed after
        # that can deadlock with gloo's thread
        code = train(Trainer.start(checked, accelerator, t_start))
    # not after an error, when another process may still be in a collective (see precompute's main); a preempted run
    # stopped on every rank after the same step
    if code == 0 or code in EXIT_CODES.values():
        accelerator.state.destroy_process_group()
    return code


def train(t: Trainer) -> int:
    """The optimisation steps, with their logs, evals and saves; a requested stop or too many non-finite steps end
    it early."""
    from torch.profiler import record_function

    from theworld.model.world import PROFILE_LABELS
    from train.eval import plateau
    from train.preempt import Preemption, worker_killed_by
    from train.step import NonFiniteError, optimization_step

    cfg, state, m = t.cfg, t.state, t.metrics
    heap.freeze()  # the model library's imports and the built run, before the loaders' workers fork
    stop = Preemption(t.c.accelerator).install()  # SIGTERM / SIGINT: stop after the current step (or eval), saved
    try:
        for line in t.start_lines():
            m.message(line)
        if state.step == 0 and cfg.train.eval.every and not t.run_eval():
            t.wait_for_saves()
            return stop.finish(state.step, cfg, t.save_and_wait, m)
        while state.step < cfg.train.max_steps and not plateau.stopping(state, cfg.train.eval.stop_on_plateau):
            epoch, start = divmod(state.step, t.per_epoch)
            batches = t.train_batches(epoch, start)
            for _ in range(start, min(t.per_epoch, start + cfg.train.max_steps - state.step)):
                t_data = time.perf_counter()
                try:
                    with record_function(PROFILE_LABELS["data"]):
                        micro = [next(batches) for _ in range(t.c.accum)]
                except RuntimeError as e:
                    if not worker_killed_by(e, stop):
                        raise
                    return stop.finish(state.step, cfg, t.save, m)  # nothing of this step was taken: it saves as is
                t.prof.before(state.step)
                t0 = time.perf_counter()
                out = optimization_step(t.c, state, micro)
                t1 = time.perf_counter()
                t.window.add(out, data_s=t0 - t_data, train_s=t1 - t0)
                t.prof.after(state.step)
                m.advance(
                    loss=out["loss"],
                    lr=out["lr"],
                    step_s=t1 - t_data,
                    samples_per_s=cfg.train.global_batch_size / max(t1 - t_data, 1e-9),
                    tokens_per_s=out["real_tokens"] / max(t1 - t_data, 1e-9),
                )
                if cfg.train.optimizer.grad_norm_warn and out["grad_norm"] > cfg.train.optimizer.grad_norm_warn:
                    m.message(
                        f"warning: step {state.step}: gradient norm {out['grad_norm']:.1f} "
                        f"> train.optimizer.grad_norm_warn {cfg.train.optimizer.grad_norm_warn}"
                    )
                if state.step % cfg.train.logging.every == 0 or state.step == cfg.train.max_steps:
                    m.log(
                        {
                            "step": state.step,
                            **t.window.flush(cfg.train.global_batch_size),
                            "nonfinite_total": state.nonfinite_steps,
                            "epoch": epoch,
                        }
                    )
                # the last step's eval comes after its checkpoint and final/ (Trainer.finish): it cannot lose them
                last = state.step == cfg.train.max_steps
                if not last and cfg.train.eval.every and state.step % cfg.train.eval.every == 0:
                    t.run_eval()  # a cut one is followed by the stop below
                if state.step % cfg.train.checkpoint.every == 0:
                    t.save()
                if stop.requested():
                    t.wait_for_saves()
                    return stop.finish(state.step, cfg, t.save_and_wait, m)
                if plateau.stopping(state, cfg.train.eval.stop_on_plateau):
                    break  # saved and exported by t.finish
        return t.finish(stop)
    except NonFiniteError as e:
        m.close()
        _log.error(str(e))
        return 3
    except BaseException:
        m.close()  # the progress bar ends its line before the error is printed
        raise
    finally:
        stop.restore()


if __name__ == "__main__":
    sys.exit(main())
