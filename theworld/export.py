"""`python -m theworld.export --model RUN --merge --out DIR [--ema]`: a trained stage as one self-contained folder.

DIR is at once
- a plain Gemma 3 folder with every trained Gemma weight in it, LoRA adapters merged into their base weights
  (`Gemma3ForConditionalGeneration.from_pretrained(DIR)` and `AutoProcessor.from_pretrained(DIR)` read it), and
- a TheWorld stage folder: `trainable.safetensors` (the world projector, and the VAE when it trained) and a
  `config.yaml` whose `model.gemma` is DIR itself (and the stage's `prompt.txt`), so `TheWorld.from_pretrained(DIR)`
  reads it without peft.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import yaml

from theworld.core import atomic, log, paths
from theworld.core.config import ArgParser
from theworld.core.errors import UserError, cli_entry, sigterm_as_exit
from theworld.model import lora
from theworld.model import stage_layout as layout

_log = log.get(__name__)

HERE = "."  # model.gemma of an exported folder: the folder itself (checkpoint_layout.read_config resolves it)


def parse(argv: list[str] | None):
    p = ArgParser(prog="theworld.export", description="Export a trained stage with its LoRA adapters merged.")
    p.add_argument("--model", required=True, help="final/ or checkpoint-N/ folder, or a run's output_dir")
    p.add_argument("--out", required=True, help="folder to create (must not exist, or be empty)")
    p.add_argument("--merge", action="store_true", help="merge LoRA adapters into the base weights (required)")
    p.add_argument("--ema", action="store_true", help="export the EMA weights (ema.safetensors)")
    args = p.parse_args(argv)
    if not args.merge:
        raise UserError(
            "theworld.export: only the merged export exists (--merge); the unmerged LoRA adapters are "
            "already a peft adapter folder: the run's final/"
        )
    out = Path(args.out)
    if out.is_symlink():  # renaming the finished folder over it would fail after the whole export
        raise UserError(
            f"theworld.export: --out {out} is a symlink (to {os.readlink(out)}); give the folder it names, or a new "
            "path; nothing was written"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"theworld.export: --out {out} exists and is not an empty folder; nothing was written")
    folder = layout.resolve(args.model)  # before the model loads
    paths.check_not_input(out, {"the model folder": folder})
    return args


def exported_config(folder: Path) -> dict:
    """The stage's config.yaml as the exported folder's: Gemma read from the folder itself, every Gemma weight in
    it (so the vision and language parts count as frozen there), no LoRA section."""
    data = yaml.safe_load((folder / layout.CONFIG).read_text())
    data["model"] = {**data.get("model", {}), "gemma": HERE}
    data["freeze"] = {**data.get("freeze", {}), "vision": True, "language": True}
    data.pop("lora", None)
    data.pop("init_from", None)  # the weights are all here
    return data


def export(model_dir: str | Path, out: str | Path, ema: bool = False) -> Path:
    """Write the merged export of `model_dir` into `.tmp-NAME-PID` beside `out`, then rename it to `out`: a failed,
    full or killed export leaves no partial folder at `out` (its temporary one is removed at once, or for kill -9 by
    the next export to the same place)."""
    from theworld.model.world import TheWorld

    folder = layout.resolve(model_dir)
    out = Path(out)
    for stale in atomic.remove_stale(out.parent, out.name):
        _log.info(f"removed {stale} (the unfinished folder of a killed export)")
    model, processor = TheWorld.from_pretrained(folder, ema=ema, device="cpu")
    merged = lora.merge(model.gemma)
    params = dict(model.named_parameters())
    rest = {n: params[n].detach().cpu().contiguous() for n in _trained_outside_gemma(folder)}
    full = lambda tmp: (
        f"theworld.export: no space left on device writing {tmp} (the file system holding {out.parent} "
        "is full); free space there or export elsewhere; nothing was left at --out"
    )
    unwritable = lambda e, tmp: (
        f"theworld.export: cannot write {e.filename or tmp} ({e.strerror}); --out was not created"
    )
    with sigterm_as_exit(), atomic.folder(out, full, unwritable) as tmp:
        _write(tmp, folder, model, processor, rest)
    _log.info(
        f"exported {folder} to {out}: {merged} LoRA layers merged; {len(rest)} TheWorld tensors ({layout.WEIGHTS})"
    )
    return out


def _write(tmp: Path, folder: Path, model, processor, rest: dict) -> None:
    model.gemma.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    layout.save_weights(rest, tmp / layout.WEIGHTS)
    (tmp / layout.CONFIG).write_text(yaml.safe_dump(exported_config(folder), sort_keys=False))
    if (folder / layout.PROMPT).is_file():  # the prompt the stage trained with stays describe's default
        shutil.copyfile(folder / layout.PROMPT, tmp / layout.PROMPT)
    layout.write_sums(tmp)


def _trained_outside_gemma(folder: Path) -> list[str]:
    """Names of the stage's trained tensors that are not Gemma's: the projector, and the VAE's when it trained."""
    from safetensors import safe_open

    with safe_open(str(folder / layout.WEIGHTS), "pt") as f:
        return [n for n in f.keys() if not n.startswith("gemma.")]


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    export(args.model, args.out, ema=args.ema)
    return 0


if __name__ == "__main__":
    sys.exit(main())
