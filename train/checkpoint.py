"""Checkpoints: where a run resumes from, what it restores, and what a save writes:
written to a temporary folder and renamed; old ones deleted only afterwards. The folders' layout (file names and what
each holds) is theworld/checkpoint_layout.py.

The learning-rate schedule is a pure function of the step and the data cursor a pure function of (seed, step), so
nothing else needs saving. Under FSDP (train.sharding: fsdp) every file holds whole tensors, gathered to the main
process (`gather`), with the same names and layout as a one-process run: see docs/training.md, "Sharding".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from theworld import hub, log, lora
from theworld.arch import FREEZABLE
from theworld.checkpoint_layout import (
    CARD,
    CHECKPOINT_RE,
    CONFIG,
    EMA,
    FINAL,
    OPTIMIZER,
    PROMPT,
    RNG,
    STATE,
    SUMS,
    WEIGHTS,
    check_finite,
    read_config,
    save_weights,
    state_digest,
    sums,
    verify,
    write_sums,
)
from theworld.config import to_yaml
from theworld.errors import OutOfSpace, UserError, no_space_message, out_of_space
from theworld.launch import gather_ints
from theworld.model import LoadReport, local_like, read_weights
from theworld.paths import REGULAR, path_kind
from theworld.text import DEFAULT_PROMPT as DESCRIBE_PROMPT
from train import checkpoint_migrations, sharding
from train.config import run_hash
from train.plateau import next_step
from train.step import LoopState

if TYPE_CHECKING:
    from accelerate import Accelerator

    from train.components import Components
    from train.config import TrainConfig

PARTIAL_RE = re.compile(r"^\.(tmp|old)-(.+)-\d+$")  # .tmp-<name>-<pid>: being written; .old-<name>-<pid>: replaced

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
    p = Path(cfg.resume)
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
    records its own digest; see train/checkpoint_migrations.py for older checkpoints), its step is the folder's and
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
    """A fresh LoopState, or the checkpoint's (weights, optimiser, EMA and RNG restored into `components`). `cache`:
    what `cache_identity` says of the cache now, compared with what the checkpoint recorded."""
    if resume_from is None:
        return LoopState(parent=components.cfg.init_from)
    saved = load(components, resume_from)
    state = LoopState.from_json(saved)
    state.history.append(str(resume_from))
    if components.accelerator.is_main_process:
        if saved.get("config_hash") != run_hash(components.cfg):
            _log.warning(f"{resume_from} was written under a different config")
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


def run_state(cfg: TrainConfig, step: int, steps_per_epoch: int, num_processes: int, cache: dict | None) -> dict:
    """What a checkpoint's state.json records besides the LoopState: where the data order is (a pure function of
    (seed, step)), the samples it orders, and the config and process count it was written under (compared on resume
    by `restore`)."""
    epoch, cursor = divmod(step, steps_per_epoch)
    return {
        "epoch": epoch,
        "data_cursor": {"epoch": epoch, "batch_in_epoch": cursor},
        "cache": cache,
        "config_hash": run_hash(cfg),
        "num_processes": num_processes,
        "format_version": checkpoint_migrations.FORMAT_VERSION,
    }


def save_run(components: Components, state: LoopState, steps_per_epoch: int, cache: dict | None = None) -> None:
    """Every process: gather the weights (a collective under FSDP), save a checkpoint from the main process, and wait
    for it there. `cache`: `cache_identity` of the cache trained on."""
    components.accelerator.wait_for_everyone()
    whole = gather(components)  # every process: under FSDP the shards are gathered to the main one
    if components.accelerator.is_main_process:
        save(
            components,
            state,
            components.cfg.output_dir,
            components.cfg.train.keep_last,
            run_state(components.cfg, state.step, steps_per_epoch, components.accelerator.num_processes, cache),
            whole,
        )
    components.accelerator.wait_for_everyone()


def remove_partial(output_dir: str | Path) -> list[Path]:
    """Clean up after a run killed while saving: a folder it had moved aside to replace goes back if its replacement
    never arrived; unfinished writes (each can be a full checkpoint in size) are deleted. Returns what was deleted."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(p, m) for p in out.iterdir() if (m := PARTIAL_RE.match(p.name)) and p.is_dir()]
    for p, m in found:
        if m.group(1) == "old" and not (out / m.group(2)).exists():
            os.replace(p, out / m.group(2))
    removed = [p for p, _ in found if p.exists()]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


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


def _write_dir(tmp: Path, files: dict) -> None:
    try:
        tmp.mkdir(parents=True)
        for name, writer in files.items():
            writer(tmp / name)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except Exception as e:  # safetensors and torch.save report a full disk in their own words
        if out_of_space(e, tmp.parent):
            raise OutOfSpace(no_space_message(tmp)) from None  # the rerun removes the unfinished folder
        raise


def _trainable_names(components: Components) -> list[str]:
    """Names of the trainable parameters, in the order of `components.params` and `components.ema`."""
    return [n for n, p in components.raw.named_parameters() if p.requires_grad]


@dataclass
class Whole:
    """What a checkpoint holds, as whole CPU tensors by name (the optimiser's state dict in torch's own layout)."""

    weights: dict[str, torch.Tensor]
    optimizer: dict
    ema: dict[str, torch.Tensor] | None


def gather(components: Components) -> Whole | None:
    """Every process calls this before a save: under FSDP it gathers the shards (a collective, one tensor at a time,
    so no process holds more than one extra whole tensor on its device). The main process gets the whole tensors,
    the others None."""
    keep = components.accelerator.is_main_process
    if not components.sharded and not keep:
        return None
    names = _trainable_names(components)
    weights = {n: sharding.whole(p, keep) for n, p in zip(names, components.params)}
    opt = components.optimizer.state_dict()
    opt["state"] = {
        i: {k: sharding.whole(v, keep) if torch.is_tensor(v) else v for k, v in st.items()}
        for i, st in sorted(opt["state"].items())
    }
    ema = {n: sharding.whole(t, keep) for n, t in zip(names, components.ema)} if components.ema is not None else None
    return Whole(weights, opt, ema) if keep else None


def _ema_writer(whole: Whole):
    return lambda p: save_file(whole.ema, str(p))


def _publish(out: Path, name: str, files: dict) -> Path:
    """Write `files` into a temporary folder, fsync them, then rename it to out/name: it appears only complete."""
    final, tmp, old = out / name, out / f".tmp-{name}-{os.getpid()}", out / f".old-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _write_dir(tmp, files)
    if final.exists():  # written before (final/ of a rerun): moved aside whole, so a kill here loses neither
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def save(
    components: Components,
    state: LoopState,
    output_dir: str | Path,
    keep_last: int,
    extra_state: dict,
    whole: Whole | None = None,
) -> Path:
    """Main process only, with what `gather` returned there (required under FSDP). Returns the checkpoint folder;
    deletes the oldest beyond keep_last after the rename."""
    out = Path(output_dir)
    whole = whole or gather(components)
    files = {
        WEIGHTS: lambda p: save_weights(whole.weights, p),
        OPTIMIZER: lambda p: torch.save(whole.optimizer, p),
        RNG: lambda p: save_file({"torch_cpu": torch.get_rng_state()}, str(p)),
        CONFIG: lambda p: p.write_text(to_yaml(components.cfg)),
    }
    if components.ema is not None:
        files[EMA] = _ema_writer(whole)
    # last, so it can record every other file's sha256 (checked by check_resumable)
    files[STATE] = lambda p: p.write_text(
        json.dumps(
            _sealed({**state.to_json(), **extra_state, "time": time.time(), "sha256": sums(p.parent, STATE)}), indent=1
        )
    )
    final = _publish(out, f"checkpoint-{state.step}", files)
    for old in list_checkpoints(out)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _sealed(state: dict) -> dict:
    return {**state, "state_sha256": state_digest(state)}


def load(components: Components, path: Path) -> dict:
    """Restore weights, optimiser, EMA and RNG from a checkpoint; returns its state.json."""
    state = _read(path / STATE, lambda p: json.loads(p.read_text()))
    components.raw.load_trainable(path / WEIGHTS, strict=True)
    _read(path / OPTIMIZER, lambda p: _load_optimizer(components, torch.load(p, weights_only=True, map_location="cpu")))
    if components.ema is not None:
        if not (path / EMA).is_file():
            raise UserError(f"resume: {path} has no {EMA} but train.ema is on")
        ema = _read(path / EMA, lambda p: load_file(str(p)))
        check_finite(ema, path / EMA)
        for t, n in zip(components.ema, _trainable_names(components)):
            t.copy_(local_like(t, ema[n]))
    torch.set_rng_state(_read(path / RNG, lambda p: load_file(str(p)))["torch_cpu"])
    return state


def _load_optimizer(components: Components, saved: dict) -> None:
    """Whole-tensor state (any sharding, any process count) into this run's optimiser: each process keeps its slice.
    The learning-rate multipliers are the config's, not the checkpoint's."""
    params = [p for g in components.optimizer.param_groups for p in g["params"]]
    saved = checkpoint_migrations.optimizer(components, saved)
    saved["state"] = {
        i: {
            k: local_like(params[i], v) if torch.is_tensor(v) and v.shape == params[i].shape else v
            for k, v in st.items()
        }
        for i, st in saved["state"].items()
    }
    components.optimizer.load_state_dict(saved)
    for g in components.optimizer.param_groups:
        if "part" in g:
            g["lr_multiplier"] = getattr(components.cfg.train.lr_multipliers, g["part"])


def _read(path: Path, reader):
    try:
        return reader(path)
    except Exception as e:  # a damaged checkpoint is a one-line error that says which file and what to do
        raise UserError(
            f"resume: cannot read {path} ({type(e).__name__}: {str(e)[:200]}); move this checkpoint "
            "out of output_dir and resume: auto takes the one before it"
        ) from e


MODEL_CARD = """# TheWorld: {name}

Trainable weights of a TheWorld stage (Gemma 3 + Cosmos VAE world encoder + world projector).

- base Gemma 3: `{gemma}`; VAE: `{vae}`; image resolution {resolution} px
- trained: {trained}
- steps: {step} (global batch {batch}, {samples} samples), lr {lr} ({schedule})
- started from: {parent}
- final eval loss {eval_loss}, with world latents shuffled {eval_shuffled} (gap {gap})

Load it and describe an image (the base models are read from where `config.yaml` names them):

```python
from theworld.model import TheWorld

model, processor = TheWorld.from_pretrained("{out}")
print(model.generate(["image.png"], {prompt})[0])
```

or `python -m theworld.describe --model {out} --image image.png`, and score it on a multiple-choice set with
`python -m theworld.evaluate --model {out} --data FILE` (docs/inference.md).

`trainable.safetensors` holds only the trained tensors, by their names in `theworld.model.TheWorld`
(`ema.safetensors`, when present, their EMA: `from_pretrained(..., ema=True)`); start the next stage from them with
`init_from: {out}`. `config.yaml` is the resolved training config.
"""


def export_final(
    components: Components,
    state: LoopState,
    cfg_yaml: str,
    output_dir: str | Path,
    whole: Whole | None = None,
    prompt: str = DESCRIBE_PROMPT,
) -> Path:
    """Main process only, with what `gather` returned there (required under FSDP)."""
    cfg = components.cfg
    whole = whole or gather(components)
    out = Path(output_dir)
    files = {
        WEIGHTS: lambda p: save_weights(whole.weights, p),
        CONFIG: lambda p: p.write_text(cfg_yaml),
        CARD: lambda p: p.write_text(_card(components, state, out, prompt)),
        PROMPT: lambda p: p.write_text(prompt + "\n", encoding="utf-8"),
    }
    if components.ema is not None:
        files[EMA] = _ema_writer(whole)
    if cfg.lora is not None:  # final/ is also a peft adapter folder for the base Gemma
        files.update(lora.adapter_files(cfg.lora, cfg.model.gemma, whole.weights))
    # last: it covers the rest but the card, which evaluate adds its results to
    files[SUMS] = lambda p: write_sums(p.parent)
    return _publish(out, FINAL, files)


def _replace_file(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def record_eval(components: Components, state: LoopState, output_dir: str | Path) -> None:
    """Main process, after the last eval (which runs once checkpoint-<step> and final/ are saved): the checkpoint's
    state.json (resealed) and final/'s model card take its numbers, each file replaced whole."""
    out = Path(output_dir)
    ckpt = out / f"checkpoint-{state.step}"
    if (ckpt / STATE).is_file():
        saved = json.loads((ckpt / STATE).read_text())
        _replace_file(ckpt / STATE, json.dumps(_sealed({**saved, "last_eval": state.last_eval}), indent=1))
    final = out / FINAL
    prompt = (final / PROMPT).read_text(encoding="utf-8").removesuffix("\n")
    _replace_file(final / CARD, _card(components, state, out, prompt))


def _card(components: Components, state: LoopState, out: Path, prompt: str) -> str:
    cfg = components.cfg
    ev = state.last_eval or {}
    fmt = lambda x: "n/a" if x is None else f"{x:.4f}"
    gap = (ev["eval_loss_shuffled_world"] - ev["eval_loss"]) if ev else None
    trained = ["world projector"] + [n for n in FREEZABLE if not getattr(cfg.freeze, n)]
    trained += [f"{n} (LoRA r {cfg.lora.r})" for n in (cfg.lora.parts if cfg.lora else ())]
    card = MODEL_CARD.format(
        name=out.name,
        gemma=cfg.model.gemma,
        vae=cfg.model.vae,
        resolution=cfg.image.resolution,
        trained=", ".join(trained),
        step=state.step,
        batch=cfg.train.global_batch_size,
        samples=state.samples_seen,
        lr=cfg.train.lr,
        schedule=cfg.train.schedule,
        parent=state.parent or "the base models",
        eval_loss=fmt(ev.get("eval_loss")),
        eval_shuffled=fmt(ev.get("eval_loss_shuffled_world")),
        gap=fmt(gap),
        out=out / FINAL,
        prompt=json.dumps(prompt),
    )  # a Python string literal
    if state.eval_history:
        card += (
            "\n"
            + next_step(
                state.plateau_step, str(out / FINAL), cfg.train.stop_on_plateau and state.plateau_step is not None
            )
            + "\n"
        )
    return card
