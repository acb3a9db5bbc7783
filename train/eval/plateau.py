"""When to move on: has the eval loss plateaued? A pure function of the eval history (LoopState.eval_history, kept in
each checkpoint's state.json, so a resumed run judges as an uninterrupted one would).

The multi-stage guide's rule: less than 1% improvement of the validation loss over the last 5,000 steps. With
`train.eval.plateau.window_evals: 0` the window is the evals covering the last 5,000 steps, or a quarter of the run when
that is shorter (a 1,000-step demo stage would otherwise never be judged). `train.eval.plateau.min_steps` holds a
plateau (and a stop on it) back until that step: the plan's minimum run before a stage may move on.
"""

from __future__ import annotations

import math

GUIDE_WINDOW_STEPS = 5000
RUN_FRACTION = 4  # a run shorter than 4 x 5,000 steps is judged over its last quarter


def window_evals(configured: int, eval_every: int, max_steps: int) -> int:
    """The number of evals the improvement is measured over (0: never judged, when evals run only at the end)."""
    if configured:
        return configured
    if not eval_every:
        return 0
    steps = min(GUIDE_WINDOW_STEPS, max_steps // RUN_FRACTION)
    return max(2, math.ceil(steps / eval_every))


def improvement(losses: list[float], window: int) -> float | None:
    """Relative improvement of the best loss of the last `window` evals over the best one before them; None while
    the history is shorter than window + 1 evals."""
    if window < 1 or len(losses) <= window:
        return None
    before, recent = min(losses[:-window]), min(losses[-window:])
    if not (math.isfinite(before) and before > 0):
        return None
    return (before - recent) / before


def plateaued(losses: list[float], window: int, min_improvement: float) -> bool:
    gain = improvement(losses, window)
    return gain is not None and gain < min_improvement


def next_step(plateau_step: int | None, final_dir: str, stopped: bool) -> str:
    """The guide's advice for the summary and final/README.md."""
    if plateau_step is None:
        return (
            "The eval loss was still improving when the run ended: the guide's next step is to continue this "
            "stage (raise train.max_steps and resume) before moving on."
        )
    how = "; the run stopped there (train.eval.stop_on_plateau)" if stopped else ""
    return (
        f"The eval loss plateaued at step {plateau_step} (train.eval.plateau){how}: the guide's next step is the next "
        f"stage, started from these weights with `init_from: {final_dir}`."
    )


def record(state, plateau_cfg, eval_every: int, max_steps: int, eval_loss: float) -> dict:
    """Adds this eval to `state.eval_history` (one entry per step) and sets `state.plateau_step` at the first eval
    that finds a plateau at or after `plateau_cfg.min_steps` (before it, a flat eval line is only reported: a stage
    may not stop that early). Returns the eval line's `plateaued` (and `plateau_improvement` once it can be
    measured)."""
    state.eval_history = [e for e in state.eval_history if e[0] != state.step] + [[state.step, eval_loss]]
    window = window_evals(plateau_cfg.window_evals, eval_every, max_steps)
    gain = improvement([loss for _, loss in state.eval_history], window)
    flat = gain is not None and gain < plateau_cfg.min_improvement
    if flat and state.plateau_step is None and state.step >= plateau_cfg.min_steps:
        state.plateau_step = state.step
    return {"plateaued": flat} if gain is None else {"plateaued": flat, "plateau_improvement": gain}


def stopping(state, stop_on_plateau: bool) -> bool:
    return stop_on_plateau and state.plateau_step is not None
