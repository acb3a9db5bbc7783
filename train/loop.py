"""`accelerate launch -m train.loop --config configs/stage1.yaml` (or `python -m train.loop ...`): train from the cache.

Thin on purpose: parse and validate the config, build the components (train/order.py, train/data.py,
train/optim.py, train/checkpoint.py, train/metrics.py), run the loop. See docs/training.md.
"""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import torch

from theworld import run_lock
from theworld.config import to_dict
from theworld.errors import UserError, cli_entry
from train import checkpoint, data, optim, order, sharding
from train.benchmarks import BenchmarkEval
from train.config import accumulation_steps, load, run_hash, to_yaml
from train.metrics import Metrics, ProfileWindow, StepWindow, check_metrics_file, check_trackers, summary
from train.preempt import EXIT_CODES, EvalCut, Preemption, cut_message
from train.step import NonFiniteError, evaluate, optimization_step

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    from accelerate import Accelerator

    from theworld.cache_format import CacheReader
    from theworld.model import LoadReport
    from train.config import TrainConfig


@cli_entry
def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    cfg, args = load(argv)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    # everything checkable without a model is checked before loading one
    sharding_plan = sharding.resolve(cfg)
    check_trackers(cfg.trackers)
    check_metrics_file(cfg.output_dir)
    reader, plan = data.open_cache(cfg)
    if cfg.init_from:
        checkpoint.resolve_weights(cfg.init_from)
    bench = BenchmarkEval.load(cfg)
    if cfg.train.cpu_threads:
        torch.set_num_threads(cfg.train.cpu_threads)
    accelerator = optim.make_accelerator(cfg, sharding_plan)
    split = order.split(reader, cfg.train.eval_samples)
    per_epoch = order.check_sizes(cfg, reader, split[0], accelerator.num_processes)
    accum = accumulation_steps(cfg, accelerator.num_processes)
    # one run per output_dir: a second one would take this run's unfinished saves for a killed run's and delete them
    with run_lock.hold(cfg.output_dir, accelerator):
        code = _train(cfg, accelerator, reader, plan, split, per_epoch, accum, t_start, bench)
    # not after an error, when another process may still be in a collective (see precompute's main); a preempted run
    # stopped on every rank after the same step
    if code == 0 or code in EXIT_CODES.values():
        accelerator.state.destroy_process_group()
    return code


def _train(cfg: TrainConfig, accelerator: Accelerator, reader: CacheReader, plan: data.InputPlan,
           split: tuple[np.ndarray, np.ndarray], per_epoch: int, accum: int, t_start: float,
           bench: BenchmarkEval | None) -> int:
    """From the clean-up after a killed run to the final weights, with output_dir held."""
    removed, resume_from = checkpoint.resume_point(cfg, accelerator)
    reports = []
    init = (lambda m: reports.append(checkpoint.init_from(m, cfg.init_from))) if cfg.init_from else None
    components = optim.build(cfg, accelerator, accum, init,
                             check=lambda m, p: data.verify_fingerprint(cfg, m, p, reader, plan))
    ctx = data.DataContext.build(cfg, reader, plan, components.processor, split)
    cache = checkpoint.cache_identity(reader)
    state = checkpoint.restore(components, resume_from, cache)
    m = Metrics(accelerator, cfg.output_dir, {**to_dict(cfg), "run_hash": run_hash(cfg)}, state.step,
                cfg.train.max_steps, cfg.trackers)
    for line in _start_lines(cfg, components, reader, plan, ctx, removed, reports, resume_from, state.step, per_epoch,
                             accum):
        m.message(line)
    rank, world_size = accelerator.process_index, accelerator.num_processes
    eval_loader = data.build_eval_loader(cfg, ctx, rank, world_size) if len(ctx.eval_indices) else None
    prof = ProfileWindow(cfg.profile, cfg.output_dir, rank)

    def run_eval() -> bool:
        """The eval of this step; False when a stop request cut it short (then nothing of it is logged)."""
        try:
            if eval_loader is not None:
                state.last_eval = {"step": state.step, **evaluate(components, eval_loader)}
                m.log(state.last_eval)
            if bench is not None:
                m.log({"step": state.step, **bench.run(components)})
        except EvalCut:
            m.message(cut_message(state.step, stop.signum))
            return False
        return True

    def save():
        checkpoint.save_run(components, state, per_epoch, cache)

    window = StepWindow()
    stop = Preemption(accelerator).install()  # SIGTERM / SIGINT: stop after the current step (or eval), saved
    try:
        if state.step == 0 and cfg.train.eval_every and not run_eval():
            return stop.finish(state.step, cfg, save, m)
        while state.step < cfg.train.max_steps:
            epoch, start = divmod(state.step, per_epoch)
            batches = iter(data.build_train_loader(cfg, ctx, rank, world_size, epoch, start))
            for _ in range(start, min(per_epoch, start + cfg.train.max_steps - state.step)):
                t_data = time.perf_counter()
                micro = [next(batches) for _ in range(accum)]
                prof.before(state.step)
                t0 = time.perf_counter()
                out = optimization_step(components, state, micro)
                window.add(out, data_s=t0 - t_data, train_s=time.perf_counter() - t0)
                prof.after(state.step)
                m.advance(loss=out["loss"])
                if cfg.train.grad_norm_warn and out["grad_norm"] > cfg.train.grad_norm_warn:
                    m.message(f"warning: step {state.step}: gradient norm {out['grad_norm']:.1f} "
                              f"> train.grad_norm_warn {cfg.train.grad_norm_warn}")
                if state.step % cfg.train.log_every == 0 or state.step == cfg.train.max_steps:
                    m.log({"step": state.step, **window.flush(cfg.train.global_batch_size),
                           "nonfinite_total": state.nonfinite_steps, "epoch": epoch})
                # the last step's eval comes after its checkpoint and final/ (_finish): it cannot lose them
                last = state.step == cfg.train.max_steps
                if not last and cfg.train.eval_every and state.step % cfg.train.eval_every == 0:
                    run_eval()  # a cut one is followed by the stop below
                if state.step % cfg.train.save_every == 0:
                    save()
                if stop.requested():
                    return stop.finish(state.step, cfg, save, m)
        if window.steps_run and state.step % cfg.train.save_every:  # (a finished run's rerun has its checkpoint)
            save()
        return _finish(cfg, components, state, m, window, t_start, run_eval, stop)
    except NonFiniteError as e:
        m.close()
        print(f"error: {e}", file=sys.stderr)
        return 3
    except BaseException:
        m.close()  # the progress bar ends its line before the error is printed
        raise
    finally:
        stop.restore()


def _finish(cfg: TrainConfig, components: optim.Components, state, m: Metrics, window: StepWindow, t_start: float,
            run_eval, stop: Preemption) -> int:
    """After the last step's checkpoint: final/, then the last eval, which the checkpoint and final/ then record. An
    eval that fails or is cut short loses nothing: the rerun of the same command repeats only the eval."""
    accelerator = components.accelerator
    whole = checkpoint.gather(components)
    if accelerator.is_main_process:
        final = checkpoint.export_final(components, state, to_yaml(cfg), cfg.output_dir, whole)
    if state.last_eval is None or state.last_eval.get("step") != state.step:
        try:
            done = run_eval()
        except Exception as e:
            m.close()
            print(f"error: the eval after the last step failed ({type(e).__name__}: {str(e)[:300]}); checkpoint-"
                  f"{state.step} and final/ are saved, without it; rerunning the same command repeats only the eval",
                  file=sys.stderr)
            if isinstance(e, UserError):
                return 2
            raise
        if not done:
            m.close()
            return stop.exit_code
        if accelerator.is_main_process:
            checkpoint.record_eval(components, state, cfg.output_dir)
    m.close()
    if accelerator.is_main_process:
        print(f"final weights: {final}\n" + summary(state, time.time() - t_start, window))
    return 0


def _start_lines(cfg: TrainConfig, components: optim.Components, reader: CacheReader, plan: data.InputPlan,
                 ctx: data.DataContext, removed: list[Path], reports: list[LoadReport], resume_from: Path | None,
                 step: int, per_epoch: int, accum: int) -> list[str]:
    """What the run prints before its first step: clean-up, cache and init_from notes, where it starts, the data."""
    lines = []
    for p in removed:
        lines.append(f"removed {p}, an unfinished save of a killed run")
    if not reader.checksummed:
        lines.append(f"note: cache {cfg.cache_dir} has no per-member checksums (written before they existed): "
                     "damaged latents would go unnoticed; rebuild it to add them")
    for r in reports:
        lines.append(checkpoint.describe_init(cfg.init_from, r))
    lines.append(f"{'resumed from ' + str(resume_from) if resume_from else 'fresh start'} at step {step}; "
                 f"{len(ctx.train_indices)} train / {len(ctx.eval_indices)} eval samples, {per_epoch} steps/epoch, "
                 f"{components.world_size} process(es) x {accum} micro-batches of {cfg.train.micro_batch_size}; "
                 f"latents {'cached' if plan.cached_latents else 'live'}, image tokens "
                 f"{'cached' if plan.cached_siglip else 'live'}; {components.sharding}")
    if buckets := ctx.describe_buckets():
        lines.append(f"{buckets}; each global batch holds one shape, a shape's last < "
                     f"{cfg.train.global_batch_size} samples of an epoch are left out of it")
    return lines


if __name__ == "__main__":
    sys.exit(main())
