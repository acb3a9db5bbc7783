"""One training run's state, built once and driven by train/loop.py: `Checked` holds what is settled before any model
loads (the resolved config, the cache, the held-out split, the benchmarks), `Trainer` everything from the clean-up
after a killed run to the final weights (components, data, loop state, metrics, evaluation, saves)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from theworld.core import log
from theworld.core.config import to_dict
from theworld.core.errors import UserError
from train import flops, params
from train.components import Components, Launch, build, build_model, resolve_launch
from train.config import run_hash, to_yaml
from train.data import cache as data
from train.data import loader, order
from train.eval import heldout
from train.eval.alignment import Alignment
from train.eval.benchmarks import BenchmarkEval
from train.eval.evaluator import Evaluator, evaluators
from train.eval.samples import CaptionSamples
from train.metrics import (
    Metrics,
    ProfileWindow,
    StepWindow,
    check_output_paths,
    check_trackers,
    new_wandb_run_id,
    summary,
    wandb_init,
)
from train.preempt import EvalCut, Preemption, cut_message
from train.state import checkpoint, final, hub_upload
from train.state.hub_upload import HubUploader
from train.state.shards import ShardedSaver
from train.step import LoopState

_log = log.get(__name__)

if TYPE_CHECKING:
    from accelerate import Accelerator

    from theworld.cache_format import CacheReader
    from theworld.model.world import LoadReport
    from train.config import TrainConfig


def device_peak(device: torch.device, configured: float) -> float | None:
    """The peak TFLOP/s the logged mfu is measured against: a GPU's (train/flops.py), none on the CPU."""
    if device.type != "cuda":
        return None
    return flops.peak_tflops(torch.cuda.get_device_name(device), configured)


@dataclass
class Checked:
    """Everything checkable without a model, checked: a refusal costs no model load."""

    cfg: TrainConfig
    launch: Launch
    reader: CacheReader
    inputs: data.InputSources
    split: tuple[np.ndarray, np.ndarray]  # train / held-out sample indices
    per_epoch: int  # optimisation steps per epoch
    bench: BenchmarkEval | None
    sets: list[heldout.OpenSet] = field(default_factory=list)  # train.eval.sets, opened

    @classmethod
    def of(cls, cfg: TrainConfig, opened: tuple[CacheReader, data.InputSources] | None = None) -> Checked:
        """`opened`: data.open_cache(cfg), when the caller opened the cache already."""
        launch = resolve_launch(cfg)
        check_trackers(cfg.trackers)
        check_output_paths(cfg)
        reader, inputs = opened or data.open_cache(cfg)
        if cfg.init_from:
            checkpoint.resolve_weights(cfg.init_from)
        bench = BenchmarkEval.load(cfg)
        sets = [heldout.OpenSet.of(cfg, entry) for entry in cfg.train.eval.sets]
        if cfg.train.hardware.cpu_threads:
            torch.set_num_threads(cfg.train.hardware.cpu_threads)
        split = data.split_data(cfg, reader)
        per_epoch = order.check_sizes(cfg, reader, split[0], launch.processes, data.mixture_draw(cfg, reader, split[0]))
        cfg.train.max_steps = order.total_steps(cfg.train, per_epoch)
        cfg.profile.check_window(cfg.train.max_steps)
        return cls(cfg, launch, reader, inputs, split, per_epoch, bench, sets)


@dataclass
class Trainer:
    """The run from its first line to its final weights, with output_dir held; `Trainer.start` builds it."""

    checked: Checked
    c: Components
    ctx: loader.DataContext
    state: LoopState
    metrics: Metrics
    evaluators: list[Evaluator]  # caption samples, held-out loss, benchmarks, alignment: each configured one, in order
    prof: ProfileWindow
    t_start: float
    cache: dict  # checkpoint.cache_identity of the cache trained on
    removed: list[Path] = field(default_factory=list)  # unfinished saves of a killed run, deleted
    reports: list[LoadReport] = field(default_factory=list)  # what init_from loaded
    resume_from: Path | None = None
    window: StepWindow = field(default_factory=StepWindow)
    hub: HubUploader | None = None  # main process, with hub.model_id
    saver: ShardedSaver | None = None  # sharded checkpoints (checkpoint.saver_for)

    @classmethod
    def start(cls, checked: Checked, accelerator: Accelerator, t_start: float) -> Trainer:
        """Clean up after a killed run, load the model (+ init_from, then the cache's full fingerprint check), build
        the components, the data and the metrics, restore the checkpoint to continue."""
        cfg = checked.cfg
        removed, resume_from = checkpoint.resume_point(cfg, accelerator)
        model, processor = build_model(cfg)
        reports = [checkpoint.init_from(model, cfg.init_from)] if cfg.init_from else []
        data.verify_fingerprint(cfg, model, processor, checked.reader, checked.inputs)
        for s in checked.sets:
            data.verify_fingerprint(cfg, model, processor, s.reader, s.inputs)
        c = build(cfg, accelerator, checked.launch.accum, built=(model, processor))
        ctx = loader.DataContext.build(cfg, checked.reader, checked.inputs, c.processor, checked.split)
        cache = checkpoint.cache_identity(checked.reader)
        state = checkpoint.restore(c, resume_from, cache)
        if "wandb" in cfg.trackers and state.wandb_run_id is None:
            state.wandb_run_id = new_wandb_run_id()  # kept in the checkpoints: a resumed run continues it
        rank, world_size = accelerator.process_index, accelerator.num_processes
        held_out = len(ctx.eval_indices) > 0
        evals = evaluators(
            CaptionSamples(cfg, ctx, cfg.train.eval.captions) if cfg.train.eval.captions and held_out else None,
            held := heldout.build(cfg, ctx, checked.sets, rank, world_size),
            checked.bench,
            Alignment(held.splits[0].loader, cfg.output_dir, accelerator.is_main_process)
            if cfg.train.eval.alignment and held is not None
            else None,
        )
        # last: what fails above is one error line, with no progress bar drawn before it
        metrics = Metrics(
            accelerator,
            cfg.output_dir,
            {**to_dict(cfg), "run_hash": run_hash(cfg)},
            state.step,
            cfg.train.max_steps,
            cfg.trackers,
            wandb_init(cfg.wandb, state.wandb_run_id, cfg.output_dir) if "wandb" in cfg.trackers else None,
        )
        window = StepWindow(
            flops.FlopCounter.of(c.raw, cfg.freeze, cfg.lora, checked.inputs.cached_siglip),
            device_peak(accelerator.device, cfg.train.hardware.peak_tflops),
            world_size,
        )
        return cls(
            checked,
            c,
            ctx,
            state,
            metrics,
            evals,
            ProfileWindow(cfg.profile, cfg.output_dir, rank),
            t_start,
            cache,
            removed,
            reports,
            resume_from,
            window=window,
            saver=checkpoint.saver_for(c),
            hub=hub_upload.for_run(cfg, accelerator, metrics.message),
        )

    @property
    def cfg(self) -> TrainConfig:
        return self.checked.cfg

    @property
    def per_epoch(self) -> int:
        return self.checked.per_epoch

    def train_batches(self, epoch: int, start: int):
        """This process's micro-batches of `epoch` from global batch `start` on."""
        return iter(loader.build_train_loader(self.cfg, self.ctx, self.c.rank, self.c.world_size, epoch, start))

    def run_eval(self) -> bool:
        """Every evaluator, run and logged in turn (train/eval/evaluator.py). False when a stop request cut it short
        (train/preempt.py): what it had not logged yet is dropped."""
        try:
            for e in self.evaluators:
                e.log(self.metrics, self.state, e.run(self.c))
        except EvalCut:
            self.metrics.message(cut_message(self.state.step))
            return False
        return True

    def save(self) -> None:
        t0 = time.perf_counter()
        checkpoint.save_run(self.c, self.state, self.per_epoch, self.cache, self.saver)
        self.window.saved(time.perf_counter() - t0)
        if self.hub is not None and self.cfg.hub.strategy == "every_save":
            step = self.state.step
            name = f"checkpoint-{step}"
            self.hub.submit(Path(self.cfg.output_dir) / name, name, name if self.cfg.hub.history else None)

    def save_and_wait(self) -> None:
        """A save the run ends with: complete (an asynchronous one written and sealed) on return."""
        self.save()
        self.wait_for_saves()

    def wait_for_saves(self) -> None:
        if self.saver is not None:
            self.saver.wait()

    def start_lines(self) -> list[str]:
        """What the run prints before its first step: clean-up, cache and init_from notes, where it starts, the data."""
        cfg, ctx, inputs = self.cfg, self.ctx, self.checked.inputs
        lines = [f"removed {p}, an unfinished save of a killed run" for p in self.removed]
        if not self.checked.reader.checksummed:
            lines.append(
                f"note: cache {self.checked.reader.cache_dir} has no per-member checksums "
                "(written before they existed): "
                "damaged latents would go unnoticed; rebuild it to add them"
            )
        if rollout := data.world_steps_note(cfg, self.checked.reader, inputs):
            lines.append(rollout)
        if window := data.window_note(cfg.storage, self.checked.reader):
            lines.append(window)
        nodes = self.c.world_size // int(os.environ.get("LOCAL_WORLD_SIZE") or self.c.world_size)
        if groups := data.node_groups_note(cfg, self.checked.reader, max(1, nodes)):
            lines.append(groups)
        for r in self.reports:
            lines.append(checkpoint.describe_init(cfg.init_from, r))
        lines.append(
            f"{'resumed from ' + str(self.resume_from) if self.resume_from else 'fresh start'} at step "
            f"{self.state.step}; {len(ctx.train_indices)} train / {len(ctx.eval_indices)} eval samples, "
            f"{self.per_epoch} steps/epoch, {self.c.world_size} process(es) x {self.c.accum} micro-batches "
            f"of {cfg.train.micro_batch_size}; latents {'cached' if inputs.cached_latents else 'live'}, "
            f"image tokens {'cached' if inputs.cached_siglip else 'live'}; {self.c.sharding}"
        )
        lines.append(params.describe(self.c.raw))
        if self.saver is not None:
            how = "in the background (train.checkpoint.async)" if self.saver.asynchronous else "each by its process"
            lines.append(f"checkpoints: per-process shards (torch.distributed.checkpoint), written {how}")
        elif cfg.train.checkpoint.async_:
            lines.append(
                "note: train.checkpoint.async applies to sharded checkpoints (FSDP over several processes); this run's "
                "checkpoints hold whole tensors and are written while the loop waits"
            )
        if cfg.train.epochs:
            lines.append(
                f"train.epochs {cfg.train.epochs:g}: {cfg.train.max_steps} steps of {self.per_epoch} per epoch"
            )
        if mixture := ctx.describe_mixture(cfg):
            lines.append(mixture)
        if ctx.truncation:
            lines.append(ctx.truncation)
        if buckets := ctx.describe_buckets():
            lines.append(
                f"{buckets}; each global batch holds one shape, a shape's last < "
                f"{cfg.train.global_batch_size} samples of an epoch are left out of it"
            )
        return lines

    def finish(self, stop: Preemption) -> int:
        """After the last step: its checkpoint where still missing, the final weights, then the last eval, which the
        checkpoint and final/ then record. An eval that fails or is cut short loses no steps: the rerun of the same
        command repeats only the eval."""
        state, accelerator = self.state, self.c.accelerator
        # (a finished run's rerun has its checkpoint)
        if self.window.steps_run and state.step % self.cfg.train.checkpoint.every:
            self.save()
        self.wait_for_saves()  # final/ and the last eval's records follow a sealed checkpoint
        whole = final.gather(self.c)
        if accelerator.is_main_process:
            folder = final.export_final(
                self.c,
                state,
                to_yaml(self.cfg),
                self.cfg.output_dir,
                whole,
                data.trained_prompt(self.checked.reader, self.ctx.train_indices),
            )
        if state.last_eval is None or state.last_eval.get("step") != state.step:
            code = self._last_eval(stop)
            if code:
                return code
        self.metrics.close()
        if accelerator.is_main_process:
            print(
                f"final weights: {folder}\n"
                + summary(state, time.time() - self.t_start, self.window, self.cfg.train.eval.stop_on_plateau, folder)
            )
            hub_upload.finish(self.hub, folder)
        return 0

    def _last_eval(self, stop: Preemption) -> int:
        """The eval after the saves, recorded into them; an exit code when it did not complete."""
        try:
            done = self.run_eval()
        except Exception as e:
            self.metrics.close()  # the progress bar ends its line before the error is printed
            _log.error(
                f"the eval after the last step failed ({type(e).__name__}: {str(e)[:300]}); checkpoint-"
                f"{self.state.step} and final/ are saved, without it; rerunning the same command repeats only the "
                "eval"
            )
            if isinstance(e, UserError):
                return 2
            raise
        if not done:
            self.metrics.close()
            return stop.exit_code
        if self.c.accelerator.is_main_process:
            final.record_eval(self.c, self.state, self.cfg.output_dir)
            keep = self.cfg.train.checkpoint  # the last eval may have found a new best checkpoint
            checkpoint.prune(self.cfg.output_dir, keep.keep_last, keep.keep_best)
        return 0
