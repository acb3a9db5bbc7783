"""`accelerate launch -m train.loop --config configs/stage1.yaml` (or `python -m train.loop ...`): train from the cache.

Thin on purpose: parse and validate the config, build the components (train/data.py, train/optim.py,
train/checkpoint.py, train/metrics.py), run the loop. See docs/training.md.
"""
from __future__ import annotations

import sys
import time

import torch

from theworld.errors import cli_entry
from train import checkpoint, data, optim
from theworld.config import to_dict
from train.config import accumulation_steps, load, run_hash, to_yaml
from train.metrics import Metrics, ProfileWindow, summary
from train.step import LoopState, NonFiniteError, evaluate, optimization_step


@cli_entry
def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    cfg, args = load(argv)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    reader, plan = data.open_cache(cfg)  # everything checkable without a model is checked before loading one
    if cfg.train.eval_samples >= len(reader):
        data.split(reader, cfg.train.eval_samples)  # raises, naming the key
    data.steps_per_epoch(len(reader) - cfg.train.eval_samples, cfg.train.global_batch_size)
    resume_from = checkpoint.resolve_resume(cfg)
    if cfg.init_from:
        checkpoint.resolve_weights(cfg.init_from)
    if cfg.train.cpu_threads:
        torch.set_num_threads(cfg.train.cpu_threads)
    acc = optim.make_accelerator(cfg)
    accum = accumulation_steps(cfg, acc.num_processes)
    reports = []
    c = optim.build(cfg, acc, accum, (lambda m: reports.append(checkpoint.init_from(m, cfg.init_from)))
                    if cfg.init_from else None)
    data.verify_fingerprint(cfg, c.raw, reader, plan)
    ctx = data.DataContext.build(cfg, reader, plan, c.processor)
    per_epoch = data.steps_per_epoch(len(ctx.train_indices), cfg.train.global_batch_size)
    state = LoopState(parent=cfg.init_from)
    if resume_from is not None:
        saved = checkpoint.load(c, resume_from)
        state = LoopState.from_json(saved)
        state.history.append(str(resume_from))
        if saved.get("config_hash") != run_hash(cfg) and acc.is_main_process:
            print(f"warning: {resume_from} was written under a different config", file=sys.stderr)
    m = Metrics(acc, cfg.output_dir, {**to_dict(cfg), "run_hash": run_hash(cfg)}, state.step, cfg.train.max_steps,
                cfg.trackers)
    for r in reports:
        parts = lambda names: sorted({".".join(n.split(".")[:3]) for n in names})  # noqa: E731
        m.message(f"init_from {cfg.init_from}: {r.summary()}; loaded {parts(r.loaded)}, new (from the base model) "
                  f"{parts(r.new)}, ignored {parts(r.ignored)}")
    m.message(f"{'resumed from ' + str(resume_from) if resume_from else 'fresh start'} at step {state.step}; "
              f"{len(ctx.train_indices)} train / {len(ctx.eval_indices)} eval samples, {per_epoch} steps/epoch, "
              f"{acc.num_processes} process(es) x {accum} micro-batches of {cfg.train.micro_batch_size}; "
              f"latents {'cached' if plan.cached_latents else 'live'}, image tokens "
              f"{'cached' if plan.cached_siglip else 'live'}")
    eval_loader = data.build_eval_loader(cfg, ctx, acc.process_index, acc.num_processes)
    prof = ProfileWindow(cfg.profile, cfg.output_dir, acc.process_index)

    def run_eval():
        state.last_eval = evaluate(c, eval_loader)
        m.log({"step": state.step, **state.last_eval})

    def save():
        acc.wait_for_everyone()
        if acc.is_main_process:
            epoch, cursor = divmod(state.step, per_epoch)
            checkpoint.save(c, state, cfg.output_dir, cfg.train.keep_last,
                            {"epoch": epoch, "data_cursor": {"epoch": epoch, "batch_in_epoch": cursor},
                             "config_hash": run_hash(cfg), "num_processes": acc.num_processes})
        acc.wait_for_everyone()

    if state.step == 0 and cfg.train.eval_every:
        run_eval()
    # seconds in optimization_step and waiting for the loader over this run; window: the steps since the last log
    steps_run, train_time, data_time, window, t_log = 0, 0.0, 0.0, [], time.perf_counter()
    try:
        while state.step < cfg.train.max_steps:
            epoch, start = divmod(state.step, per_epoch)
            batches = iter(data.build_train_loader(cfg, ctx, acc.process_index, acc.num_processes, epoch, start))
            for _ in range(start, min(per_epoch, start + cfg.train.max_steps - state.step)):
                t_data = time.perf_counter()
                micro = [next(batches) for _ in range(accum)]
                prof.before(state.step)
                t0 = time.perf_counter()
                data_time += t0 - t_data
                out = optimization_step(c, state, micro)
                train_time += time.perf_counter() - t0
                steps_run += 1
                prof.after(state.step)
                m.advance()
                window.append({**out, "data_wait_s": t0 - t_data})
                if cfg.train.grad_norm_warn and out["grad_norm"] > cfg.train.grad_norm_warn:
                    m.message(f"warning: step {state.step}: gradient norm {out['grad_norm']:.1f} "
                              f"> train.grad_norm_warn {cfg.train.grad_norm_warn}")
                if state.step % cfg.train.log_every == 0 or state.step == cfg.train.max_steps:
                    ok = [w["loss"] for w in window if not w["skipped"]]
                    now = time.perf_counter()
                    m.log({"step": state.step, "loss": sum(ok) / len(ok) if ok else float("nan"), "lr": out["lr"],
                           "grad_norm": out["grad_norm"], "samples_per_s": len(window) *
                           cfg.train.global_batch_size / (now - t_log), "skipped": len(window) - len(ok),
                           "nonfinite_total": state.nonfinite_steps, "epoch": epoch,
                           "data_wait": sum(w["data_wait_s"] for w in window) / (now - t_log)})
                    window, t_log = [], now
                if cfg.train.eval_every and state.step % cfg.train.eval_every == 0:
                    run_eval()
                if state.step % cfg.train.save_every == 0:
                    save()
    except NonFiniteError as e:
        m.close()
        print(f"error: {e}", file=sys.stderr)
        return 3
    if state.last_eval is None or not cfg.train.eval_every or state.step % cfg.train.eval_every:
        run_eval()
    if state.step % cfg.train.save_every:
        save()
    if acc.is_main_process:
        final = checkpoint.export_final(c, state, to_yaml(cfg), cfg.output_dir)
    m.close()
    if acc.is_main_process:
        print(f"final weights: {final}\n" + summary(state, time.time() - t_start, steps_run, train_time, data_time))
    return 0


if __name__ == "__main__":
    sys.exit(main())
