"""The model card of a run's final/ folder (final/README.md): what was trained, from what, for how long, its last eval
and how to load it. `theworld.evaluate` later adds its results table to the same file (theworld/infer/card.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from theworld.model.arch import FREEZABLE
from theworld.model.stage_layout import FINAL
from train.eval.plateau import next_step
from train.state import best
from train.state.checkpoint import list_checkpoints

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.step import LoopState

MODEL_CARD = """# TheWorld: {name}

Trainable weights of a TheWorld stage (Gemma 3 + Cosmos VAE world encoder + world projector).

- base Gemma 3: `{gemma}`; VAE: `{vae}`; image resolution {resolution} px
- trained: {trained}
- steps: {step} (global batch {batch}, {samples} samples), lr {lr} ({schedule})
- started from: {parent}
- final eval loss {eval_loss}, with world latents shuffled {eval_shuffled} (gap {gap})
{best}
Load it and describe an image (the base models are read from where `config.yaml` names them):

```python
from theworld.model.world import TheWorld
model, processor = TheWorld.from_pretrained("{out}")
print(model.generate(["image.png"], {prompt})[0])
```

or `python -m theworld.describe --model {out} --image image.png`, and score it on a multiple-choice set with
`python -m theworld.evaluate --model {out} --data FILE` (docs/inference.md).

`trainable.safetensors` holds only the trained tensors, by their names in `theworld.model.TheWorld`
(`ema.safetensors`, when present, their EMA: `from_pretrained(..., ema=True)`); start the next stage from them with
`init_from: {out}`. `config.yaml` is the resolved training config.
"""


def card(cfg: TrainConfig, state: LoopState, out: Path, prompt: str) -> str:
    """The card of output_dir `out`'s final/ for the run at `state` (its last eval, its plateau advice)."""
    ev = state.last_eval or {}
    fmt = lambda x: "n/a" if x is None else f"{x:.4f}"
    gap = (ev["eval_loss_shuffled_world"] - ev["eval_loss"]) if ev else None
    trained = ["world projector"] + [n for n in FREEZABLE if not getattr(cfg.freeze, n)]
    trained += [f"{n} (LoRA r {cfg.lora.r})" for n in (cfg.lora.parts if cfg.lora else ())]
    text = MODEL_CARD.format(
        name=out.name,
        gemma=cfg.model.gemma,
        vae=cfg.model.vae,
        resolution=cfg.image.resolution,
        trained=", ".join(trained),
        step=state.step,
        batch=cfg.train.global_batch_size,
        samples=state.samples_seen,
        lr=cfg.train.optimizer.lr,
        schedule=cfg.train.lr_schedule.decay,
        parent=state.parent or "the base models",
        eval_loss=fmt(ev.get("eval_loss")),
        eval_shuffled=fmt(ev.get("eval_loss_shuffled_world")),
        gap=fmt(gap),
        best=best.card_line(out, list_checkpoints(out), cfg.train.checkpoint.keep_best),
        out=out / FINAL,
        prompt=json.dumps(prompt),
    )  # a Python string literal
    if state.eval_history:
        text += (
            "\n"
            + next_step(
                state.plateau_step, str(out / FINAL), cfg.train.eval.stop_on_plateau and state.plateau_step is not None
            )
            + "\n"
        )
    return text
