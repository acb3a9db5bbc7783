"""The layout of a trained stage's folders, read by training (train/state/checkpoint.py), loading
(`TheWorld.from_pretrained`) and inference: one place for the file names and for what each holds.

    <output_dir>/checkpoint-<step>/trainable.safetensors  trainable parameters, by their model names
    <output_dir>/checkpoint-<step>/state.json             step, epoch, samples seen, data cursor, the cache's samples,
                                                          config hash, parent, sha256 of every other file (checked
                                                          before resuming)
    <output_dir>/checkpoint-<step>/optimizer.pt           AdamW state dict (tensors and numbers: weights_only=True)
    <output_dir>/checkpoint-<step>/rng.safetensors        torch CPU RNG state of the main process
    <output_dir>/checkpoint-<step>/ema.safetensors        EMA of the trainable weights (when train.optimizer.ema > 0)
    <output_dir>/checkpoint-<step>/config.yaml            the resolved config (defines the model: SECTIONS)
    <output_dir>/final/                                   trainable.safetensors (+ ema), config.yaml, README.md,
                                                          prompt.txt (the prompt the training samples carried),
                                                          sha256.json: the sha256 of every other file but the
                                                          card (README.md, which evaluate adds its results to)

Every trainable.safetensors written now says in its header (RECORDS_KEY) that its folder has these sha256 records, so
a folder missing them is refused (`recorded_sha256`); one from before them loads with a note.

A stage folder (final/ or checkpoint-N/) holds the trained tensors and the run's resolved config; the base models come
from where that config names them (`tiny`, a local folder or a hub id).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from theworld.core import atomic, hub, log
from theworld.core.config import from_dict
from theworld.core.errors import UserError
from theworld.core.paths import REGULAR, path_kind
from theworld.model.config import (
    DEFAULT_PROMPT,
    FreezeConfig,
    ImageConfig,
    LoraConfig,
    ModelConfig,
    WorldConfig,
    check_lora,
)

_log = log.get(__name__)

WEIGHTS = "trainable.safetensors"
EMA = "ema.safetensors"
CONFIG = "config.yaml"
STATE = "state.json"
OPTIMIZER = "optimizer.pt"
RNG = "rng.safetensors"
CARD = "README.md"
RESULTS = "results.jsonl"  # final/: the card's evaluation rows, which the card's table is rendered from
SUMS = "sha256.json"  # final/'s record of its files' sha256 but the card's (a checkpoint's is in its state.json)
PROMPT = "prompt.txt"  # final/: the prompt the run trained with, the default of describe and caption evaluation
FINAL = "final"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
SECTIONS = ("model", "image", "world", "freeze", "lora")  # the parts of a run's config that define the model


@dataclass
class ModelSections:
    model: ModelConfig = field(default_factory=ModelConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    lora: LoraConfig | None = None  # adapters on frozen parts (theworld/model/lora.py)

    def __post_init__(self) -> None:
        check_lora(self.freeze, self.lora)


def resolve(path: str | Path) -> Path:
    """The folder holding the weights and config: `path` itself, or `path/final` for a run's output_dir; a hub repo id
    (user/name[@revision]) is its snapshot folder (theworld/core/hub.py)."""
    p = hub.resolve(path)
    if atomic.is_partial(p.resolve().name):  # an export, a build or a checkpoint that never finished: never trusted
        raise UserError(
            f"model {p}: an unfinished write (its writer was stopped; the next run to the same place removes it): "
            "give the finished folder"
        )
    if not p.is_dir():
        raise UserError(f"model {p}: not a folder (expected a final/ or checkpoint-N/ folder, or a run's output_dir)")
    folder = p if (p / WEIGHTS).is_file() else p / FINAL
    if not (folder / WEIGHTS).is_file():
        raise UserError(
            f"model {p}: no {WEIGHTS} there or in {p / FINAL} (expected a final/ or checkpoint-N/ "
            "folder, or the output_dir of a finished run)"
        )
    if not (folder / CONFIG).is_file():
        raise UserError(
            f"model {folder}: no {CONFIG} (a checkpoint written before checkpoints carried their config: "
            f"use the run's final/ folder, or copy the run's config there as {CONFIG})"
        )
    try:
        verify(folder)
    except UserError as e:
        raise UserError(f"model {e}") from None
    return folder


def state_digest(state: dict) -> str:
    """The digest a checkpoint's state.json records of its own content (every key but this one), so a hand edit of
    the step or the data cursor is caught like a changed weights file."""
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# In the header of every trainable.safetensors written since stage folders carry sha256 records: the folder's own
# statement that it has them, so a deleted, emptied or replaced record is refused rather than taken for an older folder
RECORDS_KEY, RECORDS_VERSION = "theworld.sha256_records", "1"
_noted: set[Path] = set()


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A stage folder's trainable.safetensors, its header saying the folder records its files' sha256."""
    from safetensors.torch import save_file

    # one key only: safetensors writes its metadata map in hash order, and two keys would make the bytes of the same
    # weights differ from one process to the next
    save_file(tensors, str(path), metadata={RECORDS_KEY: RECORDS_VERSION})


def sums(folder: Path, *but: str) -> dict[str, str]:
    """sha256 of every file in `folder` but those named (the record being written, final/'s model card)."""
    from theworld.cache_format import sha256_file

    return {f.name: sha256_file(f) for f in sorted(folder.iterdir()) if f.name not in but}


def write_sums(folder: Path) -> None:
    """final/'s (or an export's) sha256.json: every other file's sha256 but the card's and its results record's
    (evaluate adds rows to both)."""
    (folder / SUMS).write_text(json.dumps(sums(folder, SUMS, CARD, RESULTS), indent=1))


def _says_recorded(weights: Path) -> bool:
    """Whether the weights' header says its folder was written with sha256 records."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), "pt") as f:
            return (f.metadata() or {}).get(RECORDS_KEY) is not None
    except Exception:  # noqa: BLE001  unreadable or not safetensors: loading it says so in its own line
        return False


def _read_record(path: Path) -> object:
    kind = path_kind(path)
    if kind != REGULAR:  # never opened: a FIFO blocks, /dev/zero never ends
        raise UserError(f"{path} is {kind}, not the file of the folder's sha256 records (replaced or damaged)")
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read it ({type(e).__name__}: {str(e)[:200]})") from None


def recorded_sha256(folder: Path) -> dict[str, str] | None:
    """The sha256 a stage folder recorded of its files (a checkpoint's state.json, final/'s sha256.json), or None for
    a folder written before such records existed. A folder that says it was written with them (a checkpoint's
    format_version 2, the header of its weights) must have them: missing, empty, null or not a file is refused."""
    state, record_file = folder / STATE, folder / SUMS
    if path_kind(state) is not None:
        data = _read_record(state)
        record = data.get("sha256") if isinstance(data, dict) else None
        required = not isinstance(data, dict) or data.get("format_version", 1) != 1
        where = f"{state} (its sha256 of the other files)"
    elif path_kind(record_file) is not None:
        record, required, where = _read_record(record_file), True, str(record_file)
    else:
        record, required, where = None, False, f"{record_file} (or a checkpoint's {STATE})"
    required = required or _says_recorded(folder / WEIGHTS)
    if record is None and not required:
        return None
    if not (isinstance(record, dict) and record and all(isinstance(v, str) for v in record.values())):
        raise UserError(
            f"{where}: not a sha256 record (missing, empty or hand-edited), though {folder} was written "
            "with one; its files cannot be checked: restore the record, or use the run's other folder"
        )
    if WEIGHTS not in record and (folder / WEIGHTS).exists():
        raise UserError(f"{where}: records no sha256 of {WEIGHTS} (hand-edited); its weights cannot be checked")
    return record


def verify(folder: Path, names: list[str] | None = None) -> None:
    """The files of a stage folder are the ones it recorded (all of them, or `names`); a damaged, truncated, missing
    or unreadable one is a one-line error naming it. A folder from before the records: a one-line note."""
    from theworld.cache_format import sha256_file

    record = recorded_sha256(folder)
    # the note is for a stage folder (a loose weights file, e.g. init_from's, never had records)
    if record is None and (folder / CONFIG).is_file() and folder.resolve() not in _noted:
        _noted.add(folder.resolve())
        _log.info(f"note: {folder} has no sha256 records (written before they existed): its files are used unverified")
    for name, digest in (record or {}).items():
        if names is not None and name not in names:
            continue
        f = folder / name
        where = STATE if (folder / STATE).exists() else SUMS
        try:
            ok = path_kind(f) == REGULAR and sha256_file(f) == digest
        except OSError as e:
            raise UserError(f"{f}: cannot read it ({e.strerror})") from None
        if not ok:
            raise UserError(
                f"{f} is {'damaged' if f.is_file() else 'missing'} (its sha256 is not the one {where} recorded)"
            )


def check_finite(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Trained weights hold finite numbers: a NaN or inf tensor gives a model that scores and describes nothing, with
    no error of its own."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise UserError(
                f"{path}: tensor {name} holds {bad} non-finite value(s) (NaN or inf) of {t.numel()}; "
                "these weights cannot be used"
            )


def read_yaml(folder: Path) -> dict:
    """A stage folder's config.yaml as a mapping; text that is not UTF-8, not YAML, nested too deeply or not a
    mapping is one line naming the file."""
    path = folder / CONFIG
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except RecursionError:
        raise UserError(f"{path} is nested too deeply to be a config") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level must be a mapping")
    return data


@dataclass
class Stage:
    """A stage folder with its config read once: the model's sections and the run's seed (the projector's start)."""

    folder: Path
    sections: ModelSections
    seed: int = 0


def read_stage(folder: Path) -> Stage:
    path = folder / CONFIG
    data = read_yaml(folder)
    try:
        sections = from_dict(ModelSections, {k: data[k] for k in SECTIONS if k in data})
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    inside = folder / sections.model.gemma  # an exported folder holds its own Gemma (theworld.export)
    if not Path(sections.model.gemma).is_absolute() and (inside / "config.json").is_file():
        sections.model.gemma = str(inside.resolve())
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"{path}: seed {seed!r} is not an integer")
    return Stage(folder, sections, seed)


def read_config(folder: Path) -> ModelSections:
    return read_stage(folder).sections


def trained_prompt(folder: Path) -> str:
    """The prompt the stage was trained with (final/prompt.txt), or DEFAULT_PROMPT for a folder without one (a
    checkpoint-N/, or a run from before the file existed)."""
    path = folder / PROMPT
    try:
        text = path.read_text(encoding="utf-8").strip("\n") if path_kind(path) == REGULAR else ""
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the stage's prompt ({getattr(e, 'strerror', None) or e})") from None
    return text or DEFAULT_PROMPT
