"""Checkpoints: where a run resumes from, and the checkpointer: it saves the states it is given (each part of the run
state says how it saves and loads itself: train/state/states.py) into a temporary folder, seals it (state.json last,
with
every other file's sha256 and its own digest) and renames it into place; old ones are deleted only afterwards. A
resume loads each part back from its file. The folders' layout (file names and what each holds) is
theworld/model/stage_layout.py; final/ and its model card are train/state/final.py and train/state/model_card.py.

Under FSDP (train.hardware.sharding: fsdp) every file holds whole tensors, gathered to the main process by the parts'
state_dict(), with the same names and layout as a one-process run: see docs/training.md, "Sharding".
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from theworld.core import atomic, hub, log
from theworld.core.errors import OutOfSpace, UserError, no_space_message, out_of_space
from theworld.core.paths import REGULAR, path_kind
from theworld.core.process_group import gather_ints
from theworld.model import lora
from theworld.model.stage_layout import (
    CHECKPOINT_RE,
    CONFIG,
    OPTIMIZER,
    STATE,
    WEIGHTS,
    check_finite,
    read_config,
    state_digest,
    sums,
    verify,
)
from theworld.model.world import LoadReport, read_weights
from train.config import run_hash
from train.state import best, changes, shards
from train.state import migrations as checkpoint_migrations
from train.state.states import Stateful, run_states
from train.step import LoopState

if TYPE_CHECKING:
    from accelerate import Accelerator

    from train.components import Components
    from train.config import KeepBest, TrainConfig

_log = log.get(__name__)


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (renamed into place, state.json present), oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in out.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and (p / STATE).is_file()
    ]
    return [p for _, p in sorted(found)]


def _check_states(output_dir: str | Path, newest: Path | None) -> None:
    """A checkpoint newer than `newest` (the newest complete one) whose state.json is there but no regular file (a
    FIFO, a directory, a device) is named, not passed over for an older one: reading it could block or never end."""
    out = Path(output_dir)
    if not out.is_dir():
        return
    least = int(CHECKPOINT_RE.match(newest.name).group(1)) if newest is not None else -1
    for p in out.iterdir():
        m = CHECKPOINT_RE.match(p.name)
        if not m or int(m.group(1)) <= least:
            continue
        kind = path_kind(p / STATE)
        if kind not in (None, REGULAR):
            raise UserError(
                f"resume: {p / STATE} is {kind}, not a checkpoint's state file; move {p} out of output_dir and "
                "resume: auto takes the one before it"
            )


def resolve_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint to continue, or None for a fresh start. A run never writes into an output_dir that holds
    checkpoints it does not continue: they would interleave with its own, and keep_last would delete some."""
    ckpts = list_checkpoints(cfg.output_dir)
    _check_states(cfg.output_dir, ckpts[-1] if ckpts else None)
    if cfg.resume == "auto":
        return ckpts[-1] if ckpts else None
    if cfg.resume is None:
        if ckpts:
            raise UserError(
                f"config key 'resume': null starts afresh, but output_dir {cfg.output_dir} holds "
                f"{ckpts[-1].name} of an earlier run; use resume: auto to continue it, or another "
                "output_dir"
            )
        return None
    p = hub.resolve(cfg.resume, "config key 'resume':")  # a local checkpoint, or user/name[@rev]:checkpoint-N
    if (kind := path_kind(p / STATE)) != REGULAR:
        what = f"no {STATE}" if kind is None else f"its {STATE} is {kind}"
        raise UserError(f"config key 'resume': {p} is not a checkpoint ({what})")
    if ckpts and p.resolve() != ckpts[-1].resolve():
        raise UserError(
            f"config key 'resume': {p} is not the newest checkpoint of output_dir {cfg.output_dir} "
            f"({ckpts[-1].name}); continuing it there would mix two runs: use another output_dir"
        )
    return p


def check_resumable(path: Path, max_steps: int, epochs: float = 0.0) -> dict:
    """Before any model loads: the checkpoint's files are the ones it recorded (sha256 in state.json, which also
    records its own digest; see train/state/migrations.py for older checkpoints), its step is the folder's and
    not past train.max_steps (set from `epochs` where > 0). Returns state.json."""
    advice = f"move {path} out of output_dir and resume: auto takes the one before it"
    state = _read(path / STATE, lambda p: json.loads(p.read_text()))
    if not isinstance(state, dict):
        raise UserError(f"resume: {path / STATE} holds no step; {advice}")
    state = checkpoint_migrations.state(state, path)
    try:
        verify(path)
    except UserError as e:
        raise UserError(f"resume: {e}; {advice}") from None
    if "state_sha256" in state and state["state_sha256"] != state_digest(state):
        raise UserError(
            f"resume: {path / STATE} was changed after it was written (its content does not match the "
            f"digest it recorded); {advice}"
        )
    step = state.get("step")
    folder = CHECKPOINT_RE.match(path.name)
    if type(step) is not int or step < 0 or (folder and step != int(folder.group(1))):
        raise UserError(
            f"resume: {path / STATE} holds step {step!r}, not the folder's "
            f"{folder.group(1) if folder else 'a step >= 0'}; {advice}"
        )
    if step > max_steps:
        if epochs:  # max_steps was set from train.epochs: the run is past that many epochs
            raise UserError(
                f"config key 'train.epochs': {epochs:g} epochs are {max_steps} steps, but {path} is already at step "
                f"{step}: the run in this output_dir is past that point (its final/ holds those later weights); "
                "use another output_dir, or as many epochs or more"
            )
        raise UserError(
            f"config key 'train.max_steps': {max_steps} is below step {step} of {path}, which would "
            "export weights trained past it; raise train.max_steps, or use another output_dir"
        )
    return state


def resume_point(cfg: TrainConfig, accelerator: Accelerator) -> tuple[list[Path], Path | None]:
    """Every process, before any model loads: the main process cleans up after a killed run (`remove_partial`), then
    the checkpoint to continue (checked by `check_resumable`) or None. Returns (what was deleted, that checkpoint)."""
    removed = remove_partial(cfg.output_dir) if accelerator.is_main_process else []  # before choosing where to
    accelerator.wait_for_everyone()  # resume: a folder a killed save had moved aside may come back
    resume_from = resolve_resume(cfg)
    step = -1 if resume_from is None else check_resumable(resume_from, cfg.train.max_steps, cfg.train.epochs)["step"]
    if resume_from is not None:
        changes.check_resume(cfg, resume_from, step)
    if accelerator.num_processes > 1:
        same_start(accelerator, cfg.output_dir, step)
    return removed, resume_from


def same_start(accelerator: Accelerator, output_dir: str | Path, step: int) -> None:
    """Every process continues the same checkpoint (`step`, -1 for none). Only the main process writes output_dir,
    so a node whose output_dir is its own local folder sees none of the checkpoints there: it would start afresh
    beside the others' resumed run, in silence. Refused on every process, naming the first that differs."""
    steps = gather_ints(accelerator, step)
    other = next((r for r, s in enumerate(steps) if s != steps[0]), None)
    if other is None:
        return
    seen = lambda s: "no checkpoint" if s < 0 else f"checkpoint-{s}"
    raise UserError(
        f"output_dir {output_dir}: process 0 sees {seen(steps[0])} there but process {other} sees "
        f"{seen(steps[other])}: every node must see the same output_dir (a shared file system), since only "
        "process 0 writes it"
    )


def restore(components: Components, resume_from: Path | None, cache: dict | None = None) -> LoopState:
    """A fresh LoopState, or the checkpoint's (every part of `states.run_states` restored into `components`).
    `cache`: what `cache_identity` says of the cache now, compared with what the checkpoint recorded. A weights-only
    checkpoint (train.checkpoint.save_optimizer: false) resumes with a fresh optimiser, said in one line."""
    if resume_from is None:
        return LoopState(parent=components.cfg.init_from)
    state = LoopState()
    if shards.is_sharded(resume_from):
        recorded = json.loads((resume_from / STATE).read_text())["shards"]
        with_optimizer = recorded["optimizer"]
        saved = load(resume_from, shards.small_parts(run_states(components, state, 1, cache, with_optimizer)))
        shards.load(components, resume_from, with_optimizer)
    else:
        with_optimizer = path_kind(resume_from / OPTIMIZER) is not None
        saved = load(resume_from, run_states(components, state, 1, cache, with_optimizer, source=resume_from))
    state.history.append(str(resume_from))
    if components.accelerator.is_main_process:
        if not with_optimizer:
            _log.info(
                f"note: {resume_from} holds no optimizer state (written with train.checkpoint.save_optimizer: "
                "false): the optimizer starts fresh, so the run continues but not exactly as an uninterrupted one would"
            )
        if saved.get("config_hash") != run_hash(components.cfg):
            then = changes.saved_config(resume_from)
            changed = changes.config_changes(then, components.cfg) if then is not None else []
            _log.warning(
                f"{resume_from} was written under a different config"
                + (f": {changes.describe(changed)}" if changed else "")
            )
        was = saved.get("cache")
        if cache and was and was != cache:  # rebuilt or extended: the same step indices name other samples
            _log.warning(
                f"{'the data mixture' if components.cfg.data else 'the cache ' + components.cfg.cache_dir} "
                f"holds other samples than when {resume_from} was "
                f"written ({was['samples']} then, {cache['samples']} now): the data order from here on is not the "
                "interrupted run's"
            )
        # allowed: the data order does not depend on it
        if saved.get("num_processes", components.world_size) != components.world_size:
            _log.info(
                f"note: {resume_from} was written by {saved['num_processes']} process(es), resumed by "
                f"{components.world_size}: same samples per step, numbers equal up to rounding"
            )
    return state


def cache_identity(reader) -> dict:
    """Which samples the data order's indices name: their count and a digest of their keys in cache order."""
    return {"samples": len(reader), "keys_sha256": reader.keys_digest()}


def saver_for(components: Components) -> shards.ShardedSaver | None:
    """Every process, once per run: the writer of sharded checkpoints where the run is sharded over processes and
    train.checkpoint.sharded (the default), else None (whole-tensor checkpoints)."""
    ckpt = components.cfg.train.checkpoint
    if components.sharded and components.world_size > 1 and ckpt.sharded:
        return shards.ShardedSaver(ckpt.async_)
    return None


def save_run(
    components: Components,
    state: LoopState,
    steps_per_epoch: int,
    cache: dict | None = None,
    saver: shards.ShardedSaver | None = None,
) -> None:
    """Every process: each part of the run state gives its state (under FSDP a collective: the shards are gathered
    to the main process), the main process saves the checkpoint, and every process waits for it there. `cache`:
    `cache_identity` of the cache trained on. With a `saver` (`saver_for`) each process writes its own shard instead
    (train/state/shards.py), in the background where it is asynchronous."""
    c = components
    c.accelerator.wait_for_everyone()
    if saver is not None:
        keep = c.cfg.train.checkpoint
        saver.save(
            c,
            state,
            steps_per_epoch,
            cache,
            lambda tmp, name, parts, given: seal_folder(
                c.cfg.output_dir, tmp, name, parts, given, keep.keep_last, keep.keep_best
            ),
        )
        return
    parts = run_states(c, state, steps_per_epoch, cache, c.cfg.train.checkpoint.save_optimizer)
    given = [part.state_dict() for part in parts]
    if c.accelerator.is_main_process:
        keep = c.cfg.train.checkpoint
        save(c.cfg.output_dir, f"checkpoint-{state.step}", parts, given, keep.keep_last, keep.keep_best)
    c.accelerator.wait_for_everyone()


def remove_partial(output_dir: str | Path) -> list[Path]:
    """Clean up after a run killed while saving (the run lock is held: every partial is stale): a folder it had
    moved aside to replace goes back if its replacement never arrived; unfinished writes (each can be a full
    checkpoint in size) are deleted. Returns what was deleted."""
    return [Path(p) for p in atomic.remove_stale(output_dir, only_dead=False, folders_only=True)]


def resolve_weights(path: str | Path) -> Path:
    """init_from: a final/ or checkpoint folder, a .safetensors file, or a hub repo id (user/name[@revision]);
    checked against the sha256 its folder recorded."""
    p = hub.resolve(path, "config key 'init_from':")
    if p.is_dir():
        p = p / WEIGHTS
    if not p.is_file():
        raise UserError(f"config key 'init_from': no weights at {p}")
    try:
        verify(p.parent, [p.name])
    except UserError as e:
        raise UserError(f"config key 'init_from': {e}") from None
    return p


def init_from(model, path: str | Path) -> LoadReport:
    """Previous stage's weights by name (shapes checked); parts it lacks keep the base model's weights. A LoRA
    stage's adapters go into a model without adapters merged into its base weights."""
    weights = resolve_weights(path)
    tensors = read_weights(weights)
    adapters = {n: t for n, t in tensors.items() if lora.is_adapter(n)}
    if not adapters or lora.adapted_layers(model.gemma):
        return model.load_tensors(tensors, weights, strict=False)
    if not (weights.parent / CONFIG).is_file():
        raise UserError(
            f"config key 'init_from': {weights} holds LoRA adapters but there is no {CONFIG} beside it "
            "to say their layout (lora.r, lora.alpha, ...); give the stage's final/ folder"
        )
    source = read_config(weights.parent).lora
    if source is None:
        raise UserError(
            f"config key 'init_from': {weights} holds LoRA adapters but {weights.parent / CONFIG} has no lora section"
        )
    merged = lora.merge_into(model.gemma, source, adapters)
    report = model.load_tensors({n: t for n, t in tensors.items() if n not in adapters}, weights, strict=False)
    report.merged = merged
    return report


def describe_init(path: str | Path, report: LoadReport) -> str:
    parts = lambda names: sorted({".".join(n.split(".")[:3]) for n in names})
    merged = f"; LoRA adapters of {report.merged} layers merged into their base weights" if report.merged else ""
    return (
        f"init_from {path}: {report.summary()}; loaded {parts(report.loaded)}, new (from the base model) "
        f"{parts(report.new)}, ignored {parts(report.ignored)}{merged}"
    )


def _write_dir(tmp: Path, files: dict, exists: bool = False) -> None:
    """`files` written into the folder `tmp` (made here unless it `exists`), then every file in it fsynced."""
    try:
        tmp.mkdir(parents=True, exist_ok=exists)
        for name, writer in files.items():
            writer(tmp / name)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except Exception as e:  # safetensors and torch.save report a full disk in their own words
        if out_of_space(e, tmp.parent):
            raise OutOfSpace(no_space_message(tmp)) from None  # the rerun removes the unfinished folder
        raise


def _write_state(record: dict):
    """state.json, written last so it can record every other file's sha256 (checked by check_resumable)."""
    return lambda p: p.write_text(
        json.dumps(seal({**record, "time": time.time(), "sha256": sums(p.parent, STATE)}), indent=1)
    )


def writer(part: Stateful, given: dict) -> Callable[[Path], None]:
    """How `part`'s state is written to its file, by the file's format (train/state/states.py)."""
    suffix = Path(part.file).suffix
    if suffix == ".safetensors":
        return lambda p: save_file(given, str(p), metadata=getattr(part, "metadata", None))
    if suffix == ".pt":
        return lambda p: torch.save(given, p)
    if suffix == ".yaml":
        return lambda p: p.write_text(given["text"])
    raise ValueError(f"no format for a checkpoint file named {part.file}")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(str(path))
    check_finite(tensors, path)
    return tensors


def _reader(name: str) -> Callable[[Path], object]:
    """How a checkpoint file is read back, by its format (the inverse of `writer`)."""
    suffix = Path(name).suffix
    if suffix == ".safetensors":
        return _tensors
    if suffix == ".pt":
        return lambda p: torch.load(p, weights_only=True, map_location="cpu")
    return lambda p: p.read_text()


def publish(out: Path, name: str, files: dict, tmp: Path | None = None) -> Path:
    """Write `files` into a partial folder, fsync them, then rename it to out/name: it appears only complete (one
    there before, final/ of a rerun, is moved aside whole first, so a kill loses neither). `tmp`: the partial folder,
    already holding other files (a sharded checkpoint's shards)."""
    if tmp is None:
        tmp = atomic.partial_path(out / name)
        shutil.rmtree(tmp, ignore_errors=True)
        _write_dir(tmp, files)
    else:
        _write_dir(tmp, files, exists=True)
    atomic.replace_folder(tmp, out / name)
    return out / name


def save(
    output_dir: str | Path,
    name: str,
    parts: list[Stateful],
    given: list,
    keep_last: int,
    keep_best: KeepBest | None = None,
) -> Path:
    """Main process only: the checkpoint output_dir/name of the states `parts` gave (`given`, in their order; the
    records of state.json merged into one object), sealed (state.json last, with every other file's sha256 and its
    own digest) and renamed into place. Deletes the oldest beyond keep_last (but the best by keep_best) after the
    rename."""
    return seal_folder(output_dir, None, name, parts, given, keep_last, keep_best)


def seal_folder(
    output_dir: str | Path,
    tmp: Path | None,
    name: str,
    parts: list[Stateful],
    given: list,
    keep_last: int,
    keep_best: KeepBest | None = None,
) -> Path:
    """`save`'s work, into the partial folder `tmp` where it already holds a sharded checkpoint's shards; `given`
    may hold one state.json record more than `parts` (the shards' own, train/state/shards.py)."""
    out = Path(output_dir)
    files, record = {}, {}
    for part, state in zip(parts, given):
        if part.file == STATE:
            record.update(state)
        else:
            files[part.file] = writer(part, state)
    for extra in given[len(parts) :]:
        record.update(extra)
    files[STATE] = _write_state(record)
    final = publish(out, name, files, tmp)
    prune(out, keep_last, keep_best)
    return final


def prune(output_dir: str | Path, keep_last: int, keep_best: KeepBest | None = None) -> None:
    """Deletes the checkpoints older than the last `keep_last`, but the best by `keep_best` (train/state/best.py)."""
    ckpts = list_checkpoints(output_dir)
    kept = best.best(output_dir, ckpts, keep_best)
    for old in ckpts[:-keep_last]:
        if kept is None or old != kept[0]:
            shutil.rmtree(old, ignore_errors=True)


def seal(state: dict) -> dict:
    """state.json's content with the digest of itself it records."""
    return {**state, "state_sha256": state_digest(state)}


def load(path: Path, parts: list[Stateful]) -> dict:
    """Every part of `parts` but those saved only (config.yaml) loads its state from its file of the checkpoint at
    `path`, in their order (state.json's records each from the whole object); returns state.json as written (checked
    and read as the current format by check_resumable before any model loaded)."""
    state = _read(path / STATE, lambda p: json.loads(p.read_text()))
    for part in parts:
        if getattr(part, "saved_only", False):
            continue
        if part.file == STATE:
            part.load_state_dict(state)
            continue
        f = path / part.file
        if path_kind(f) is None:
            raise UserError(f"resume: {path} has no {part.file}{getattr(part, 'missing', '')}")
        read = _reader(part.file)
        _read(f, lambda p, part=part, read=read: part.load_state_dict(read(p)))
    return state


def _read(path: Path, reader):
    try:
        return reader(path)
    except UserError:  # already one line naming the file (a non-finite tensor, weights of another trainable set)
        raise
    except Exception as e:  # a damaged checkpoint is a one-line error that says which file and what to do
        raise UserError(
            f"resume: cannot read {path} ({type(e).__name__}: {str(e)[:200]}); move this checkpoint "
            "out of output_dir and resume: auto takes the one before it"
        ) from e
