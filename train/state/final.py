"""A run's final/ folder: the last trainable weights (+ their EMA), the resolved config, the model card
(train/state/model_card.py), the prompt the run trained with and sha256.json, published like a checkpoint (temporary
folder,
then renamed); and, after the last eval, its figures recorded into the last checkpoint and the card. Not to be
confused with `python -m theworld.export`, which turns a finished stage into one self-contained folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from theworld.core import atomic
from theworld.infer import card as results
from theworld.model import lora
from theworld.model.config import DEFAULT_PROMPT as DESCRIBE_PROMPT
from theworld.model.stage_layout import CARD, CONFIG, FINAL, PROMPT, RESULTS, STATE, SUMS, WEIGHTS, write_sums
from train.state.checkpoint import publish, seal, writer
from train.state.model_card import card
from train.state.states import PLATEAU, Ema, Stateful, Trainables

if TYPE_CHECKING:
    from train.components import Components
    from train.step import LoopState

Whole = list[tuple[Stateful, dict]]  # the weights' parts and the whole tensors they gave


def gather(components: Components) -> Whole | None:
    """Every process calls this before `export_final`: under FSDP the parts' state_dict() gathers the shards (a
    collective). The main process gets the whole tensors, the others None."""
    parts = [Trainables(components)] + ([Ema(components)] if components.ema is not None else [])
    given = [(part, part.state_dict()) for part in parts]
    return given if components.accelerator.is_main_process else None


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
    files = {part.file: writer(part, given) for part, given in whole}
    files[CONFIG] = lambda p: p.write_text(cfg_yaml)
    kept = results.rows(out / FINAL) if (out / FINAL).is_dir() else []  # a rerun keeps what evaluate wrote
    if kept:
        files[RESULTS] = lambda p: p.write_text(results.record_text(kept), encoding="utf-8")
    # rendered once sha256.json exists, so the rows see which of them measured these weights
    files[CARD] = lambda p: p.write_text(_card(card(cfg, state, out, prompt), kept, p.parent), encoding="utf-8")
    files[PROMPT] = lambda p: p.write_text(prompt + "\n", encoding="utf-8")
    if cfg.lora is not None:  # final/ is also a peft adapter folder for the base Gemma
        weights = next(given for part, given in whole if part.file == WEIGHTS)
        files.update(lora.adapter_files(cfg.lora, cfg.model.gemma, weights))
    # it covers the rest but the card and its results, which evaluate adds to
    files = {**{k: v for k, v in files.items() if k != CARD}, SUMS: lambda p: write_sums(p.parent), CARD: files[CARD]}
    return publish(out, FINAL, files)


def record_eval(components: Components, state: LoopState, output_dir: str | Path) -> None:
    """Main process, after the last eval (which runs once checkpoint-<step> and final/ are saved): the checkpoint's
    state.json (resealed) and final/'s model card take its numbers, each file replaced whole."""
    out = Path(output_dir)
    ckpt = out / f"checkpoint-{state.step}"
    if (ckpt / STATE).is_file():
        saved = json.loads((ckpt / STATE).read_text())
        # with the plateau record the eval extended, so that a rerun's card gives the same advice as this one
        evals = {k: getattr(state, k) for k in ("last_eval", *PLATEAU)}
        atomic.write_text(ckpt / STATE, json.dumps(seal({**saved, **evals}), indent=1))
    final = out / FINAL
    prompt = (final / PROMPT).read_text(encoding="utf-8").removesuffix("\n")
    atomic.write_text(final / CARD, _card(card(components.cfg, state, out, prompt), results.rows(final), final))


def _card(text: str, kept: list[dict], folder: Path) -> str:
    """The card's text with the results rows `kept` rendered below it."""
    return results.render(text, kept, results.weights_digest(folder))
