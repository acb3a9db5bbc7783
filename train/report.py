"""`python -m train.report RUN [RUN ...] --out report.html [--eval FILE ...]`: one self-contained HTML page (pictures
inline as data: URIs, nothing fetched) to look at runs side by side: the training loss, the eval loss with its own
world and with the world shuffled on one axis (the comparison the project is about), the world gap and the throughput
(real tokens/s and the padding share, where the run logged them) of every run on shared axes, a summary per run, the
evaluation tables (each run's final/README.md results, the benchmarks logged during training, and
`theworld.evaluate --json` / `--out` files), and the caption samples of each run's last eval with their pictures.
Each figure is also written as a PNG (1600 x 900) in <out stem>_files/ beside the page, for slides. The step-0 eval
(before training) is left out of the curves, whose range it would set, and shown in the summary; the step axis has its
ticks at the eval steps.

A run whose config's `init_from` is another reported run's folder (that run, its final/ or a checkpoint) is drawn
after that run's last step, so stage 1 -> 2 -> 3 read left to right; other runs start at their own step 0."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from theworld.core import atomic, log, paths
from theworld.core.config import ArgParser
from theworld.core.errors import UserError, cli_entry, one_line
from theworld.model import stage_layout as layout
from train.metrics import METRICS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# curve name: what it is, in the page's words
CURVES = {
    "loss": "training loss",
    "eval_loss": "eval loss (own world)",
    "eval_loss_shuffled_world": "eval loss (world shuffled)",
    "gap": "world gap",
    "tokens_per_s": "real tokens/s",
    "padding_share": "padding share",
}
# figure name: (title, y axis label, PNG file name, its curves with their line styles); one colour per stage
FIGURES = {
    "loss": (
        "training loss (each point: the mean over the steps since the previous log line)",
        "loss (nats/token)",
        "loss.png",
        (("loss", "-"),),
    ),
    "eval": (
        "eval loss: own world (solid) vs world shuffled (dashed)",
        "loss (nats/token)",
        "eval_loss.png",
        (("eval_loss", "-"), ("eval_loss_shuffled_world", "--")),
    ),
    "gap": ("world gap: eval loss shuffled minus own world", "nats/token", "gap.png", (("gap", "-"),)),
    "throughput": (
        "real tokens per second (no padding, world blocks included; each point: the steps since the previous log line)",
        "tokens/s",
        "tokens_per_s.png",
        (("tokens_per_s", "-"),),
    ),
    "padding": (
        "padding share of the steps' token slots",
        "share of token slots",
        "padding_share.png",
        (("padding_share", "-"),),
    ),
}
FIGSIZE, DPI = (16, 9), 100  # 1600 x 900 px: a slide's width
MAX_TICKS = 16  # eval steps on the step axis; more evals than this: every k-th one
THUMB = 256  # a caption sample's picture is shown this many pixels on its long side (small ones enlarged)
MAX_STEP = 2**53  # a step beyond what a float holds exactly (JSON's 1e400 is inf, 10**400 an int): not a record

_log = log.get(__name__)


@dataclass
class Stage:
    """One stage's records of a run folder (a folder whose log restarts at step 0 holds several)."""

    label: str
    records: list[dict]
    offset: int = 0  # where its step 0 lies on the shared x axis
    after: str | None = None  # the stage it continues, drawn before it
    branch: int | None = None  # the step of `after` it starts from (init_from a checkpoint); None: its last step

    @property
    def last_step(self) -> int:
        return max(r["step"] for r in self.records)


@dataclass
class Run:
    arg: str  # as given on the command line
    folder: Path
    stages: list[Stage] = field(default_factory=list)
    unreadable: int = 0  # lines of metrics.jsonl that are not a record (a killed run's half line, damage)
    why: str = ""  # why it has no metrics, when it has none


def _number(v: object) -> bool:
    """A JSON number that converts to a float (NaN and inf included; an integer too large for a float is not)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def read_records(path: Path) -> tuple[list[dict], int]:
    """metrics.jsonl's records in file order (objects with an integer step), and how many lines were not one."""
    records, bad = [], 0
    for line in path.read_bytes().split(b"\n"):  # newlines only: JSON text may hold U+2028 and the like
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is a ValueError
            bad += 1
            continue
        step = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP:
            records.append(rec)
        else:
            bad += 1
    return records, bad


def split_stages(records: list[dict]) -> list[list[dict]]:
    """A log's records per stage: a new stage starts where the steps go back to 0 (a resume continues from its
    checkpoint's step, never from 0, so its repeated steps stay in the stage they belong to)."""
    stages: list[list[dict]] = []
    top = -1
    for r in records:
        if not stages or (r["step"] == 0 and top > 0):
            stages.append([])
            top = -1
        stages[-1].append(r)
        top = max(top, r["step"])
    return stages


def series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """Each curve's (steps, values) in step order; a step logged more than once (lines a resumed run repeats) keeps
    its last record. gap: eval_loss_shuffled_world - eval_loss of the same eval line."""
    by_step: dict[str, dict[int, float]] = {name: {} for name in CURVES}
    for r in records:
        for name in ("loss", "eval_loss", "eval_loss_shuffled_world", "tokens_per_s", "padding_share"):
            if _number(r.get(name)):
                by_step[name][r["step"]] = float(r[name])
        if _number(r.get("eval_loss")) and _number(r.get("eval_loss_shuffled_world")):
            by_step["gap"][r["step"]] = float(r["eval_loss_shuffled_world"]) - float(r["eval_loss"])
    return {name: (sorted(d), [d[s] for s in sorted(d)]) for name, d in by_step.items()}


def last_samples(records: list[dict]) -> tuple[int, list[dict]] | None:
    """(step, rows) of the last caption samples record, rows with string caption / own_world / shuffled_world."""
    for r in reversed(records):
        rows = r.get("samples")
        if isinstance(rows, list) and rows and all(isinstance(x, dict) for x in rows):
            return r["step"], rows
    return None


def last_benchmarks(records: list[dict]) -> tuple[int, dict[str, dict[str, float]]] | None:
    """(step, {benchmark: {n, accuracy, accuracy_shuffled_world}}) of the last eval that logged
    train.eval.benchmarks."""
    for r in reversed(records):
        found: dict[str, dict[str, float]] = {}
        for k, v in r.items():
            if k.startswith("bench/") and k.count("/") >= 2 and _number(v):
                name, metric = k[len("bench/") :].rsplit("/", 1)
                found.setdefault(name, {})[metric] = v
        if found:
            return r["step"], found
    return None


def load_run(arg: str) -> Run:
    """The run folder `arg` (a stage folder, final/ or checkpoint-N/, stands for its run) with its stages; a run
    without metrics has none. Not a folder: UserError."""
    folder = Path(arg)
    kind = paths.path_kind(folder)
    if kind != "a directory":
        raise UserError(
            f"train.report: RUN {arg} is {kind or 'not there'}: give a run's output_dir (the folder holding {METRICS})"
        )
    if paths.path_kind(folder / METRICS) is None and (
        folder.name == layout.FINAL or layout.CHECKPOINT_RE.match(folder.name)
    ):
        folder = folder.parent
    run = Run(arg.rstrip("/") or arg, folder)
    log = folder / METRICS
    kind = paths.path_kind(log)
    if kind != paths.REGULAR:  # never opened otherwise: a FIFO would block
        run.why = f"no {METRICS}" if kind is None else f"its {METRICS} is {kind}"
        return run
    try:
        records, run.unreadable = read_records(log)
    except OSError as e:
        run.why = f"{METRICS} unreadable ({e.strerror})"
        return run
    parts = split_stages(records)
    for i, part in enumerate(parts):
        label = run.arg if len(parts) == 1 else f"{run.arg} (stage {i + 1} of its log)"
        run.stages.append(Stage(label, part, after=run.stages[-1].label if run.stages else None))
    return run


def has_metrics(run: Run) -> bool:
    """Whether any stage of the run logged a point of any curve."""
    return any(steps for s in run.stages for steps, _ in series(s.records).values())


def _config(folder: Path) -> dict:
    """The run's resolved config (final/config.yaml, else its newest checkpoint's); {} when none is readable."""
    import yaml

    ckpts = sorted(
        (int(m.group(1)), p) for p in folder.glob("checkpoint-*") if (m := layout.CHECKPOINT_RE.match(p.name))
    )
    for cand in [folder / layout.FINAL / layout.CONFIG] + [p / layout.CONFIG for _, p in reversed(ckpts)]:
        if paths.path_kind(cand) == paths.REGULAR:
            try:
                cfg = yaml.safe_load(cand.read_text(encoding="utf-8"))
            except (OSError, ValueError, yaml.YAMLError):
                continue
            return cfg if isinstance(cfg, dict) else {}
    return {}


def place(runs: list[Run]) -> None:
    """Each stage's offset on the shared step axis: after the stage it continues (the previous stage of the same log,
    or the reported run its config's init_from names), else 0."""
    by_folder = {os.path.realpath(r.folder): r for r in runs if r.stages}
    stages = {s.label: s for r in runs for s in r.stages}
    for r in runs:
        init = _config(r.folder).get("init_from") if r.stages else None
        if isinstance(init, str) and init:
            target = os.path.realpath(init)
            parent = by_folder.get(target) or by_folder.get(os.path.dirname(target))
            if parent is not None and parent is not r:
                r.stages[0].after = parent.stages[-1].label
                m = layout.CHECKPOINT_RE.match(os.path.basename(target))
                r.stages[0].branch = int(m.group(1)) if m else None

    def offset(s: Stage, seen: frozenset = frozenset()) -> int:
        if s.after is None or s.after in seen or s.after not in stages:  # a cycle of init_from: drawn from 0
            return 0
        before = stages[s.after]
        return offset(before, seen | {s.label}) + (before.last_step if s.branch is None else s.branch)

    for s in stages.values():
        s.offset = offset(s)


def plain(text: str) -> str:
    """`text` as matplotlib draws it literally: a `$` would start mathtext (a run folder named `$\\frac{$` fails)."""
    return text.replace("$", r"\$")


def after_step_0(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """A curve less its step-0 point (the eval before training, far above the rest) when it has later points."""
    if len(steps) > 1 and steps[0] == 0:
        return steps[1:], values[1:]
    return steps, values


def tick_steps(stages: list[Stage]) -> list[int]:
    """The eval steps after step 0 on the shared axis, at most MAX_TICKS of them (every k-th); none when fewer than
    two (the axis then gets matplotlib's integer ticks)."""
    xs = sorted({x + s.offset for s in stages for x in series(s.records)["eval_loss"][0] if x > 0})
    return xs[:: math.ceil(len(xs) / MAX_TICKS)] if len(xs) > 1 else []


def draw(name: str, stages: list[Stage]) -> Figure | None:
    """The matplotlib Figure `name` of FIGURES for every stage that logged its curves (None when none did): one colour
    per stage, the same in every figure, a line style per curve; a dotted line where a stage that continues another
    starts; ticks at the eval steps."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    title, ylabel, _, curves = FIGURES[name]
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    ax = fig.subplots()
    drawn = left_out = False
    for i, s in enumerate(stages):
        colour = f"C{i % 10}"
        for curve, style in curves:
            steps, values = series(s.records)[curve]
            shown, values = after_step_0(steps, values)
            left_out |= len(shown) < len(steps)
            if not shown:
                continue
            x = [step + s.offset for step in shown]
            label = plain(s.label) + (f" ({CURVES[curve]})" if len(curves) > 1 else "")
            marker = "o" if len(x) <= 50 else None
            ax.plot(x, values, label=label, color=colour, linestyle=style, marker=marker, markersize=4)
            drawn = True
        if s.after is not None:
            ax.axvline(s.offset, color=colour, linestyle=":", linewidth=1)
    if not drawn:
        return None
    if name == "gap":
        ax.axhline(0.0, color="0.5", linewidth=0.8)
    if name in ("throughput", "padding"):
        ax.set_ylim(bottom=0)  # from zero: the layouts' ratio reads off the heights
    if name == "padding":
        from matplotlib.ticker import PercentFormatter

        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    notes = ["a stage that continues another is drawn after it"] if any(s.after is not None for s in stages) else []
    notes += ["step 0, before training, left out: see the summary"] if left_out else []
    ax.set_title(title, fontsize="x-large")
    ax.set_xlabel("step" + (f" ({'; '.join(notes)})" if notes else ""), fontsize="large")
    ax.set_ylabel(ylabel, fontsize="large")
    ticks = tick_steps(stages)
    if ticks:
        ax.set_xticks(ticks)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize="large")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="large")
    return fig


def figure(name: str, stages: list[Stage]) -> bytes | None:
    """`draw`'s figure as PNG bytes."""
    fig = draw(name, stages)
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation files


def read_eval(path: str) -> dict:
    """The summary of a `theworld.evaluate` output file: its `--json` object (stdout saved to a file) as it is, or its
    `--out` records (one JSON line per item) summarised as evaluate summarises them."""
    kind = paths.path_kind(path)
    if kind != paths.REGULAR:
        raise UserError(f"--eval {path} is {kind or 'not there'}: give a file theworld.evaluate --json or --out wrote")
    try:
        lines = [json.loads(x) for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]
    except (OSError, ValueError) as e:
        raise UserError(f"--eval {path}: not theworld.evaluate's --json or --out output ({one_line(e, 200)})") from None
    summary = None
    if len(lines) == 1 and isinstance(lines[0], dict) and "n" in lines[0] and "item" not in lines[0]:
        summary = lines[0]
    elif lines and all(isinstance(r, dict) and "item" in r and isinstance(r.get("outputs"), dict) for r in lines):
        summary = _summarize(path, lines)
    if summary is not None:
        try:
            eval_text(summary)
            return summary
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise UserError(f"--eval {path}: a summary without evaluate's figures ({type(e).__name__}: {e})") from None
    raise UserError(
        f"--eval {path}: not theworld.evaluate's --json or --out output (neither one summary object nor "
        "one JSON line per item)"
    )


def _summarize(path: str, records: list[dict]) -> dict:
    try:
        if all("references" in r for r in records):
            from theworld.infer import captions

            return captions.summarize(records)
        from theworld.infer import scoring

        generated = any(isinstance(v, str) for r in records for v in r["outputs"].values())
        conds = {c for r in records for c in r.get("preds", {})} - {"model", "shuffled_world"}
        return scoring.summarize(records, sorted(conds), "generate" if generated else "loglik")
    except ImportError as e:
        raise UserError(f"--eval {path}: caption scores need {e.name} (pip install -e '.[eval]')") from None
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise UserError(f"--eval {path}: a record lacks what evaluate writes ({type(e).__name__}: {e})") from None


def eval_text(summary: dict) -> str:
    """The summary as `theworld.evaluate` prints it."""
    if summary.get("task") == "caption":
        from theworld.infer.captions import format_report
    else:
        from theworld.infer.scoring import format_report
    return format_report(summary)


# ----------------------------------------------------------------------------------------------------------------------
# The page

STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.warn { color: #a00; }
figure { display: block; margin: 0 0 1.5em 0; }
figure img { width: 100%; max-width: 1400px; }
pre { background: #f6f6f6; padding: 0.6em; }
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _fmt(v: float | None) -> str:
    return "-" if v is None else ("nan" if math.isnan(v) else f"{v:.4f}")


def _count(v: float | None) -> str:
    """A logged count (a benchmark's n) as a whole number; NaN or infinite as it is."""
    return "-" if v is None else (str(int(v)) if math.isfinite(v) else _fmt(v))


def _table(header: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    """A table of cells already escaped."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _window(steps: list[int]) -> str:
    """The steps the last logged training loss averages: those since the previous log line."""
    first = steps[-2] + 1 if len(steps) > 1 else 1
    return f"step {steps[-1]}" if first >= steps[-1] else f"steps {first}-{steps[-1]}"


def _stage_row(s: Stage, unreadable: int) -> list[str]:
    c = series(s.records)
    last = {name: values[-1] if values else None for name, (_, values) in c.items()}
    finite = [(v, step) for step, v in zip(*c["eval_loss"]) if math.isfinite(v)]
    best = min(finite, default=None)
    at_0 = [v for name in ("eval_loss", "eval_loss_shuffled_world") for step, v in zip(*c[name]) if step == 0]
    loss_steps = c["loss"][0]
    return [
        _e(s.label),
        _e(s.after or "-"),
        str(s.last_step),
        _fmt(last["loss"]) + (f" ({_window(loss_steps)})" if loss_steps else ""),
        *(_fmt(last[name]) for name in ("eval_loss", "eval_loss_shuffled_world", "gap")),
        "-" if best is None else f"{_fmt(best[0])} (step {best[1]})",
        " / ".join(_fmt(v) for v in at_0) if len(at_0) == 2 else "-",
        str(unreadable),
    ]


def summary_table(runs: list[Run]) -> str:
    """One row per stage: its last figures, its best eval loss, its step-0 eval, the log's unreadable lines; a note
    says which window the training loss is."""
    header = ["run", "continues", "last step", "training loss (mean of the last log window)", "eval loss"]
    header += ["shuffled world", "gap", "best eval loss", "step-0 eval loss (own / shuffled)", "unreadable lines"]
    rows = [_stage_row(s, r.unreadable) for r in runs for s in r.stages]
    note = (
        "<p>Training loss: the last logged value, the mean over the steps since the previous log line "
        "(<code>train.logging.every</code>; the window in brackets). The training console's <code>last</code> is "
        "the final step's loss alone, so the two differ.</p>"
    )
    return _table(header, rows, numeric={2, 3, 4, 5, 6, 9}) + note


def results_section(run: Run) -> str:
    """The run's final/README.md results table and the benchmarks its last eval logged."""
    from theworld.infer import card

    parts = [f"<h3>{_e(run.arg)}</h3>"]
    path = run.folder / layout.FINAL / layout.CARD
    try:
        rows = card.results(path) if paths.path_kind(path) is not None else []
    except UserError as e:
        rows, parts = [], parts + [f'<p class="warn">{_e(e)}</p>']
    if rows:
        cols = [c for c in card.COLUMNS if any(c in row for row in rows)]
        cells = [[_e(row.get(c, "-")).replace("`", "") for c in cols] for row in rows]
        parts.append(f"<p>{_e(path)}:</p>" + _table(cols, cells))
    else:
        parts.append(
            f"<p>No results in {_e(path)} (<code>python -m theworld.evaluate --model {_e(run.arg)} --data FILE</code> "
            "adds them).</p>"
        )
    for s in run.stages:
        bench = last_benchmarks(s.records)
        if bench:
            step, found = bench
            cells = [
                [_e(n), _count(m.get("n")), _fmt(m.get("accuracy")), _fmt(m.get("accuracy_shuffled_world"))]
                for n, m in sorted(found.items())
            ]
            parts.append(f"<p>train.eval.benchmarks at step {step} of {_e(s.label)}:</p>")
            parts.append(_table(["benchmark", "n", "accuracy", "shuffled world"], cells, numeric={1, 2, 3}))
    return "\n".join(parts)


def eval_section(path: str, summary: dict) -> str:
    about = ", ".join(f"{k} {_e(summary[k])}" for k in ("model", "data") if isinstance(summary.get(k), str))
    return f"<h3>{_e(path)}</h3>" + (f"<p>{about}</p>" if about else "") + f"<pre>{_e(eval_text(summary))}</pre>"


def picture(folder: Path, name: object) -> bytes | None:
    """A caption sample's logged picture (a file inside the run folder) as a PNG thumbnail; None when there is none
    or it does not decode."""
    if not isinstance(name, str) or not name:
        return None
    path = os.path.realpath(folder / name)
    if os.path.commonpath([path, os.path.realpath(folder)]) != os.path.realpath(folder):
        return None  # a log that names a file outside its run folder: not read
    if paths.path_kind(path) != paths.REGULAR:
        return None
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            im.thumbnail((THUMB, THUMB))
            if max(im.size) < THUMB:  # a 64 px scene: enlarged whole-pixel, so it is seen and stays sharp
                k = THUMB // max(im.size)
                im = im.resize((im.width * k, im.height * k), Image.Resampling.NEAREST)
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            return buf.getvalue()
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError):
        return None


def samples_section(run: Run) -> str:
    parts = []
    for s in run.stages:
        found = last_samples(s.records)
        if found is None:
            continue
        step, rows = found
        cells = []
        for row in rows:
            png = picture(run.folder, row.get("image"))
            cells.append(
                [_img(png, row.get("caption", "")) if png else "(no picture logged)"]
                + [_e(row.get(k, "")) or "<i>(nothing)</i>" for k in ("caption", "own_world", "shuffled_world")]
            )
        parts.append(f"<h3>{_e(s.label)}, step {step} (its last eval)</h3>")
        parts.append(_table(["picture", "true caption", "own world", "shuffled world"], cells))
    return "\n".join(parts)


def alignment_section(run: Run) -> str:
    """The last alignment picture of a run with `train.eval.alignment` (train/eval/alignment.py): world tokens and a
    sample of Gemma's vocabulary in the plane of their top two principal axes, with the last eval's align/* metrics;
    '' for a run without one."""
    import json

    from matplotlib.figure import Figure

    from train.eval.alignment import FOLDER

    found = sorted(
        (int(p.stem.removeprefix("step-")), p)
        for p in (run.folder / FOLDER).glob("step-*.json")
        if p.stem.removeprefix("step-").isdigit()
    )
    if not found:
        return ""
    step, path = found[-1]
    try:
        pic = json.loads(path.read_text())
    except (OSError, ValueError):
        return f"<p>{_e(run.arg)}: {_e(path.name)} unreadable</p>"
    fig = Figure(figsize=(5, 4), dpi=100, layout="constrained")
    ax = fig.subplots()
    for key, colour, size in (("vocab", "0.7", 4), ("world", "C3", 8)):
        if pic.get(key):
            xs, ys = zip(*pic[key])
            ax.scatter(xs, ys, s=size, color=colour, label=f"{key} ({len(xs)})")
    ax.set_title(f"{run.arg}: world tokens vs vocabulary, step {step} (PCA)")
    ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    last = [r for s in run.stages for r in s.records if r.get("step") == step and "align/world_norm" in r]
    rows = [[_e(k.removeprefix("align/")), _fmt(v)] for k, v in (last[-1] if last else {}).items() if k != "step"]
    return _img(buf.getvalue(), f"world tokens vs vocabulary, step {step} (PCA)") + (
        _table(["metric", "value"], rows, {1}) if rows else ""
    )


def page(runs: list[Run], missing: list[str], figures: dict[str, bytes], files_dir: str, evals: dict) -> str:
    drawn = [r for r in runs if r.stages]
    body = ["<h1>TheWorld run report</h1>", f"<p>Runs: {_e(', '.join(r.arg for r in drawn))}.</p>"]
    if missing:
        body.append(f'<p class="warn">No metrics in: {_e(", ".join(missing))}.</p>')
    body += ["<h2>Summary</h2>", summary_table(drawn), "<h2>Curves</h2>"]
    for name, png in figures.items():
        title, _, file, _ = FIGURES[name]
        body.append(f"<figure>{_img(png, title)}<figcaption>{_e(files_dir)}/{_e(file)}</figcaption></figure>")
    absent = [FIGURES[n][0] for n in FIGURES if n not in figures]
    if absent:
        body.append(f"<p>No run logged: {_e(', '.join(absent))}.</p>")
    body.append("<h2>Evaluation results</h2>")
    body += [results_section(r) for r in drawn]
    body += [eval_section(path, summary) for path, summary in evals.items()]
    body += ["<h2>Caption samples</h2>", *(samples_section(r) for r in drawn)]
    if aligned := [a for r in drawn if (a := alignment_section(r))]:
        body += ["<h2>World tokens against the vocabulary</h2>", *aligned]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>TheWorld run report</title>'
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# ----------------------------------------------------------------------------------------------------------------------
# The command


def _write(path: Path, data: bytes) -> None:
    """Through a temporary file beside it, renamed over it: a reader never sees half a file."""
    try:
        atomic.write_bytes(path, data)
    except OSError as e:
        raise UserError(f"--out: cannot write {path} ({e.strerror})") from None


def check_out(out: Path, runs: list[str], evals: list[str]) -> Path:
    """--out is a file path, never an input; its figures' folder (<stem>_files/) is a folder or absent. Returns the
    figures' folder."""
    kind = paths.path_kind(out)
    if kind not in (None, paths.REGULAR):
        raise UserError(f"--out {out} is {kind}: give the path of the HTML file to write")
    files = out.with_name(out.stem + "_files")
    inputs = {**{f"the run {r}": r for r in runs}, **{f"the --eval file {e}": e for e in evals}}
    paths.check_not_input(out, inputs)
    paths.check_not_input(files, inputs)
    if paths.path_kind(files) not in (None, "a directory"):
        raise UserError(f"--out {out}: {files} (where the figures' PNGs go) is {paths.path_kind(files)}; move it away")
    if paths.path_kind(out.parent) != "a directory":
        raise UserError(f"--out {out}: its folder {out.parent} is {paths.path_kind(out.parent) or 'not there'}")
    return files


def build(run_args: list[str], out: Path, eval_args: list[str] = ()) -> tuple[list[Run], list[str]]:
    """Write the page and its figures' PNGs; (the runs, the runs without metrics). No run with metrics: UserError."""
    try:
        import matplotlib  # noqa: F401  (a dependency; an install from before it lacks it)
    except ImportError:
        raise UserError("train.report draws with matplotlib, which is not installed: pip install matplotlib") from None
    files = check_out(out, run_args, list(eval_args))
    runs, seen = [], set()
    for a in run_args:  # a run named twice (by another path to it) is reported once
        run = load_run(a)
        if os.path.realpath(run.folder) not in seen:
            seen.add(os.path.realpath(run.folder))
            runs.append(run)
    evals = {e: read_eval(e) for e in eval_args}
    for r in runs:
        if not has_metrics(r):
            r.why = r.why or "no loss or eval lines"
            r.stages = []
    missing = [f"{r.arg} ({r.why})" for r in runs if not r.stages]
    if len(missing) == len(runs):
        raise UserError(f"train.report: no metrics in {', '.join(missing)}: nothing to draw")
    place(runs)
    stages = [s for r in runs for s in r.stages]
    figures = {name: png for name in FIGURES if (png := figure(name, stages)) is not None}
    try:
        files.mkdir(exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot make {files} ({e.strerror})") from None
    for name, png in figures.items():
        _write(files / FIGURES[name][2], png)
    _write(out, page(runs, missing, figures, files.name, evals).encode("utf-8"))
    return runs, missing


@cli_entry
def main(argv: list[str] | None = None) -> int:
    p = ArgParser(
        prog="python -m train.report",
        description="One self-contained HTML page of runs' curves, evaluation tables and caption samples.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run's output_dir (holding metrics.jsonl)")
    p.add_argument("--out", required=True, help="the HTML file to write; the figures' PNGs go to <stem>_files/")
    p.add_argument(
        "--eval", nargs="+", default=[], metavar="FILE", help="theworld.evaluate --json or --out files to show"
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    runs, missing = build(args.runs, out, args.eval)
    if missing:
        _log.warning(f"train.report: no metrics in {', '.join(missing)}: left out, the rest drawn")
    drawn = ", ".join(r.arg for r in runs if r.stages)
    _log.info(f"wrote {out} (runs {drawn}; the figures' PNGs in {out.with_name(out.stem + '_files')}/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
