"""Metrics: metrics.jsonl, Accelerate trackers, the progress bar, an optional profiler window, the final summary."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from theworld.core import atomic, log, paths
from train.eval.plateau import next_step
from train.flops import mfu

METRICS = "metrics.jsonl"
SAMPLES_DIR = "samples"  # the caption samples' pictures, beside METRICS

_log = log.get(__name__)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _step_of(line: bytes) -> int:
    """The step of a metrics.jsonl line; -1 for a line a killed run left half-written, or one that is not UTF-8 JSON
    (edited or damaged by hand)."""
    try:
        return int(json.loads(line.decode("utf-8"))["step"])
    except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
        return -1


def check_output_paths(cfg) -> None:
    """Before any model loads: what the run writes in output_dir is absent or of the kind it writes there: its
    metrics log a file; the trackers' folders (TensorBoard's <output_dir>/<project>/, W&B's <output_dir>/wandb/) and
    the profiler's profile/ folders."""
    from theworld.core.errors import UserError

    out = Path(cfg.output_dir)
    wanted = {out / METRICS: (paths.REGULAR, "its metrics log")}
    if cfg.trackers:
        project = cfg.wandb.project if "wandb" in cfg.trackers else "theworld"
        wanted[out / project] = ("a directory", "the trackers' logs")
    if "wandb" in cfg.trackers:
        wanted[wandb_dir(out) / "wandb"] = ("a directory", "W&B's run files")
    if cfg.profile.enabled:
        wanted[out / "profile"] = ("a directory", "the profiler's traces")
    if cfg.train.eval.captions:
        wanted[out / SAMPLES_DIR] = ("a directory", "the caption samples' pictures")
    for path, (kind, what) in wanted.items():
        found = paths.path_kind(path)
        if found not in (None, kind):
            raise UserError(
                f"output_dir {cfg.output_dir}: {path} is {found}, where the run writes {what}; move it away or use "
                "another output_dir"
            )


def check_trackers(trackers: list[str]) -> None:
    """Every tracker asked for is installed: Accelerate would only warn and train for days without it."""
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    from theworld.core.errors import UserError

    available = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}
    for t in trackers:
        if not available[t]():
            raise UserError(
                f"config key 'trackers': {t} is not installed (pip install {t}), or leave it out of trackers"
            )


class Metrics:
    """Main-process sink for log and eval events. On resume, lines past the resumed step (from the interrupted
    run) are dropped so the file reads as one uninterrupted run."""

    def __init__(
        self,
        accelerator,
        output_dir: str | Path,
        config: dict,
        start_step: int,
        max_steps: int,
        trackers: list[str],
        wandb: dict | None = None,
    ):
        """`wandb`: wandb_init(...)'s project and init kwargs, when trackers holds wandb."""
        self.acc, self.main = accelerator, accelerator.is_main_process
        self.path = Path(output_dir) / METRICS
        self.bar = None
        self.smoothed = SmoothedLoss()
        self.pictures_saved = False
        if not self.main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.is_file() and start_step > 0:  # split on newlines only: JSON text may hold U+2028 and the like
            kept = [ln for ln in self.path.read_bytes().split(b"\n") if 0 <= _step_of(ln) <= start_step]
        self.path.write_bytes(b"".join(ln + b"\n" for ln in kept))
        if trackers:
            # TensorBoard logs go to <output_dir>/theworld/ (<output_dir>/<wandb.project>/ with W&B). Its hparams
            # (accelerate's store_init_configuration) would add a folder named by the clock there on every (re)start;
            # the config goes in as text instead.
            project, kwargs = wandb or ("theworld", {})
            accelerator.init_trackers(project, init_kwargs=kwargs)
            for t in accelerator.trackers:
                if t.name == "tensorboard":
                    t.writer.add_text("config", "    " + json.dumps(config, indent=1).replace("\n", "\n    "))
                else:
                    t.store_init_configuration(_flat(config))
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=max_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=1.0
        )
        self.postfix: dict[str, str] = {}
        self.trackers = bool(trackers)
        self.warm = False  # the first step (compile, warm-up) is left out of the progress bar's rate and ETA

    def log(self, event: dict) -> None:
        if not self.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")
        if self.trackers:
            self.acc.log({k: v for k, v in event.items() if k != "step"}, step=event["step"])
        if "eval_loss" in event:  # evals are rare and the figure people wait for: on the console as they happen
            gap = event["eval_loss_shuffled_world"] - event["eval_loss"]
            self.message(
                f"eval at step {event['step']}: eval_loss {event['eval_loss']:.4f}, "
                f"eval_loss_shuffled_world {event['eval_loss_shuffled_world']:.4f}, gap {gap:+.4f}"
            )

    def message(self, text: str) -> None:
        if self.main:
            _log.info(text)  # through tqdm.write: the progress bar keeps its line

    def log_samples(self, step: int, rows: list[dict], images: list) -> None:
        """Captions generated at an eval (train/eval/samples.py): metrics.jsonl (with each picture's file, saved once
        under
        <output_dir>/samples/ for train.report), TensorBoard (a table as text, each image with its captions), W&B (a
        table), and the first one on the console."""
        if not self.main or not rows:
            return
        files = self._save_pictures(images)
        logged = [{**row, "image": name} if name else row for row, name in zip(rows, files)]
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "samples": logged}) + "\n")
        first = rows[0]
        self.message(
            f"sample at step {step}: true {first['caption']!r}; own world {first['own_world']!r}; "
            f"shuffled world {first['shuffled_world']!r}"
        )
        for t in self.acc.trackers if self.trackers else ():
            if t.name == "tensorboard":
                t.writer.add_text("samples", samples_markdown(rows), global_step=step)
                for i, (row, img) in enumerate(zip(rows, images)):
                    if img is not None:
                        t.writer.add_image(f"samples/{i}", img, global_step=step, dataformats="HWC")
                        t.writer.add_text(f"samples/{i}", samples_markdown([row]), global_step=step)
                t.writer.flush()
            elif t.name == "wandb":
                import wandb

                data = [
                    [
                        wandb.Image(img, caption=row["own_world"]) if img is not None else None,
                        row["caption"],
                        row["own_world"],
                        row["shuffled_world"],
                    ]
                    for row, img in zip(rows, images)
                ]
                t.log_table("samples", columns=["image", *SAMPLE_COLUMNS], data=data, step=step)

    def _save_pictures(self, images: list) -> list[str | None]:
        """Each sample's picture as <output_dir>/samples/<i>.png, written at this process's first eval (the samples
        are the same at every eval): its name relative to output_dir, None for a sample without one."""
        names = [f"{SAMPLES_DIR}/{i}.png" if img is not None else None for i, img in enumerate(images)]
        if self.pictures_saved:
            return names
        from PIL import Image

        folder = self.path.parent / SAMPLES_DIR
        folder.mkdir(exist_ok=True)
        for name, img in zip(names, images):
            if name is not None:
                target = self.path.parent / name
                with atomic.file(target, fsync=False) as tmp:
                    Image.fromarray(img).save(tmp, format="PNG")
        self.pictures_saved = True
        return names

    def advance(
        self,
        n: int = 1,
        loss: float | None = None,
        lr: float | None = None,
        samples_per_s: float | None = None,
        step_s: float | None = None,
        tokens_per_s: float | None = None,
    ) -> None:
        """`n` more steps done; the last one's `loss` (shown smoothed), `lr` and throughput on the progress bar."""
        if self.bar is None:
            return
        if loss is not None and self.smoothed.add(loss):
            self.postfix["loss"] = f"{self.smoothed.value:.4f}"
        if lr is not None:
            self.postfix["lr"] = f"{lr:.2e}"
        if samples_per_s is not None and self.warm:
            self.postfix["sps"] = f"{samples_per_s:.0f}"
        if tokens_per_s is not None and self.warm:
            self.postfix["tps"] = f"{tokens_per_s:.0f}"
        self.bar.set_postfix(self.postfix, refresh=False)
        if self.warm:
            self.bar.update(n)
            return
        # tqdm's rate would average the first step's compile and warm-up in for the rest of the run
        self.warm = True
        took = step_s if step_s is not None else time.time() - self.bar.start_t
        self.message(f"first step: {took:.1f}s (compile and warm-up; left out of the progress bar's rate and ETA)")
        self.bar.n += n
        self.bar.initial = self.bar.n
        self.bar.start_t = self.bar.last_print_t = time.time()
        self.bar.refresh()

    def close(self) -> None:
        """Ends the progress bar's line and the trackers; closing twice is harmless."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.main and self.trackers:
            self.acc.end_training()
            self.trackers = False


SAMPLE_COLUMNS = ["caption", "own_world", "shuffled_world"]


def samples_markdown(rows: list[dict]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + " --- |" * len(SAMPLE_COLUMNS)
    return "\n".join([head] + ["| " + " | ".join(cell(r[c]) for c in SAMPLE_COLUMNS) + " |" for r in rows])


def new_wandb_run_id(length: int = 8) -> str:
    """A fresh W&B run id: `length` random base-36 digits, W&B's own id alphabet. Made here because W&B offers no
    public function for it (`wandb.util.generate_id` is internal and gone in wandb 0.31); `wandb.init(id=...)` takes
    any such string."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(length))


def wandb_dir(output_dir: str | Path) -> Path:
    """Where W&B puts its wandb/ folder: WANDB_DIR when the user set it (a scratch or home folder of their choice),
    else output_dir, beside the run's other logs."""
    return Path(os.environ.get("WANDB_DIR") or output_dir)


def wandb_init(wandb_cfg, run_id: str, output_dir: str | Path) -> tuple[str, dict]:
    """(project, Accelerator.init_trackers init_kwargs): the run id is the checkpointed one, so a resumed run continues
    the same W&B run; its files go under `wandb_dir`."""
    kwargs = {
        "id": run_id,
        "resume": "allow",
        "dir": str(wandb_dir(output_dir)),
        "name": wandb_cfg.run_name,
        "entity": wandb_cfg.entity,
        "tags": list(wandb_cfg.tags) or None,
    }
    return wandb_cfg.project, {"wandb": {k: v for k, v in kwargs.items() if v is not None}}


class SmoothedLoss:
    """Exponential moving average of the per-step loss (bias-corrected, as TensorBoard's smoothing): the progress bar
    shows a trend that moves every step instead of one log line's window mean. Non-finite steps are left out."""

    def __init__(self, beta: float = 0.9):
        self.beta, self.avg, self.n = beta, 0.0, 0

    def add(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return False
        self.avg = self.beta * self.avg + (1 - self.beta) * loss
        self.n += 1
        return True

    @property
    def value(self) -> float:
        return self.avg / (1 - self.beta**self.n) if self.n else float("nan")


class ProfileWindow:
    """torch.profiler over steps [start, start + steps): writes a Chrome trace and prints the top operations."""

    def __init__(self, cfg, output_dir: str | Path, rank: int):
        self.cfg, self.rank = cfg, rank
        self.dir = Path(output_dir) / "profile"
        self.prof = None

    def before(self, step: int) -> None:
        if self.cfg.enabled and step == self.cfg.start_step and self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self.prof.__enter__()

    def after(self, step: int) -> None:  # `step`: steps done
        if self.prof is not None and step >= self.cfg.start_step + self.cfg.steps:
            self.prof.__exit__(None, None, None)
            self.dir.mkdir(parents=True, exist_ok=True)
            trace = self.dir / f"trace-rank{self.rank}.json"
            self.prof.export_chrome_trace(str(trace))
            if self.rank == 0:
                sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
                _log.info(self.prof.key_averages().table(sort_by=sort, row_limit=self.cfg.top))
                _log.info(f"profile trace: {trace}")
            self.prof = None


class StepWindow:
    """The steps since the last training log line, and this run's totals (for the summary). `flops` (set by the
    trainer): the run's train/flops.py counter; `peak`: the device's peak TFLOP/s, None where there is no mfu (a CPU,
    an unknown GPU)."""

    def __init__(self, flops=None, peak: float | None = None, processes: int = 1):
        self.flops, self.peak, self.processes = flops, peak, processes
        self.outs: list[dict] = []
        self.start = time.perf_counter()
        self.data_s = 0.0  # the window's time waiting for the loader
        self.save_s = 0.0  # and the time saves held the loop
        self.steps_run, self.train_total_s, self.data_total_s = 0, 0.0, 0.0

    def add(self, out: dict, data_s: float, train_s: float) -> None:
        self.outs.append(out)
        self.data_s += data_s
        self.steps_run += 1
        self.train_total_s += train_s
        self.data_total_s += data_s

    def saved(self, seconds: float) -> None:
        """A save held the loop for `seconds` (logged with the window's line as checkpoint_s)."""
        self.save_s += seconds

    def flush(self, global_batch: int) -> dict:
        """The log line's figures (loss: mean over the window's finite steps), then a new window."""
        ok = [o["loss"] for o in self.outs if not o["skipped"]]
        now, last = time.perf_counter(), self.outs[-1]
        took = now - self.start
        line = {
            "loss": sum(ok) / len(ok) if ok else float("nan"),
            "lr": last["lr"],
            "grad_norm": last["grad_norm"],
            "samples_per_s": len(self.outs) * global_batch / took,
            "skipped": len(self.outs) - len(ok),
            "data_wait": self.data_s / took,
            **throughput(self.outs, took, self.flops, self.peak, self.processes),
            **peak_memory(),
        }
        if self.save_s:
            line["checkpoint_s"] = self.save_s
        self.outs, self.start, self.data_s, self.save_s = [], now, 0.0, 0.0
        return line


def throughput(outs: list[dict], seconds: float, flops=None, peak: float | None = None, processes: int = 1) -> dict:
    """tokens_per_s (real tokens, world blocks included, no padding), padding_share (of all the steps' positions)
    and, with a FLOP counter and a peak, mfu (train/flops.py) of the steps `outs` (optimization_step's results) done
    in `seconds`."""
    real, positions = sum(o["real_tokens"] for o in outs), sum(o["positions"] for o in outs)
    line = {"tokens_per_s": real / seconds, "padding_share": 1 - real / positions if positions else 0.0}
    if flops is not None and peak:
        done = sum(flops.step(o["real_tokens"], o["rows"], o["tokens"], o["images"], o["world_tokens"]) for o in outs)
        line["mfu"] = mfu(done, seconds, peak, processes)
    return line


def peak_memory() -> dict:
    """peak_memory_gb: on a GPU the most this process's tensors took (and peak_memory_reserved_gb, what the caching
    allocator held); on the CPU the process's peak resident memory."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
            "peak_memory_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
        }
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9}


def summary(
    state, elapsed: float, window: StepWindow, stop_on_plateau: bool = False, final: str | Path = "final"
) -> str:
    ev = state.last_eval or {}
    n = window.steps_run
    lines = [
        f"steps {state.step} ({n} this run) in {elapsed:.1f}s"
        + (
            f", {1000 * window.train_total_s / n:.1f} ms/step, waiting for data "
            f"{1000 * window.data_total_s / n:.1f} ms/step"
            if n
            else ""
        )
    ]
    if state.first_loss is not None:
        lines.append(f"train loss: first {state.first_loss:.4f} -> last {state.last_loss:.4f}")
    if ev:
        gap = ev["eval_loss_shuffled_world"] - ev["eval_loss"]
        lines.append(
            f"eval_loss {ev['eval_loss']:.4f}, eval_loss_shuffled_world {ev['eval_loss_shuffled_world']:.4f}, "
            f"gap {gap:+.4f} nats/token"
        )
    if state.nonfinite_steps:
        lines.append(f"non-finite steps skipped: {state.nonfinite_steps}")
    if state.eval_history:
        lines.append(next_step(state.plateau_step, str(final), stop_on_plateau and state.plateau_step is not None))
    return "\n".join(lines)
