"""The results table of a stage's model card (final/README.md): one row per evaluated set, written or updated by
`theworld.evaluate` whenever it evaluates a local run's final/ folder.

The rows live in a record beside the card (final/results.jsonl, one JSON object of {column: cell} per row, with the
sha256 of the weights it measured), and the card's table is rendered from it: a rerun of the training that rewrites
final/ carries the record over and renders the same rows again (`carried`, `section`). A card written before the
record existed gives its table's rows instead.

A row is keyed by what it measured: the set's content (`set sha256`, not its file name, which another set may share),
the split, `--limit`, the task and the protocol. A new result replaces only the row of the same key: another set of the
same name, or a run on part of the set, gets a row of its own."""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

from theworld.core import atomic, paths
from theworld.core.errors import UserError
from theworld.model.stage_layout import RESULTS

HEADING = "## Evaluation results"
COLUMNS = [
    "benchmark",
    "set sha256",
    "split",
    "limit",
    "task",
    "protocol",
    "n",
    "model",
    "shuffled world",
    "baselines",
    "command",
]
KEY = ("set sha256", "split", "limit", "task", "protocol")
RECORD = RESULTS  # beside the card; like the card, not in final/'s sha256.json (evaluate adds to it)
WEIGHTS_KEY = "weights sha256"  # in the record: which weights a row measured (a run extended later has others)
EARLIER = " (earlier weights)"  # after the benchmark name of a row that measured weights final/ no longer holds


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def fingerprint(data: str | Path) -> str:
    """sha256 (16 hex digits) of a set's content: a file's bytes, or a folder's files (names and bytes; a latent
    cache: its manifest, which records every shard's checksum)."""
    from theworld.cache_format import MANIFEST, sha256_file

    p = Path(data)
    if not p.is_dir():
        return sha256_file(p)[:16]
    files = [p / MANIFEST] if (p / MANIFEST).is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(p)}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()[:16]


def _local(data: str | Path) -> Path:
    """A set's local path: a cache in object storage is read through its stand-in folder, which holds its manifest."""
    from theworld.cache_format import storage

    return storage.open_cache(data)[0]  # a local path as it is


def row(summary: dict, data: str, task: str, argv: list[str], split: str = "val", limit: int = 0) -> list[str]:
    """A table row for an evaluation's summary (multiple choice: accuracies; caption: BLEU-4 / ROUGE-L / CIDEr)."""
    if task == "caption":
        model = " / ".join(f"{summary[k]:.4f}" for k in ("bleu4", "rouge_l", "cider"))
        shuffled = " / ".join(f"{summary[k + '_shuffled_world']:.4f}" for k in ("bleu4", "rouge_l", "cider"))
        protocol = "generate (BLEU-4 / ROUGE-L / CIDEr)"
    else:
        model, shuffled = f"{summary['accuracy']:.4f}", f"{summary['accuracy_shuffled_world']:.4f}"
        protocol = summary.get("protocol", "loglik")
    base = ", ".join(f"{b} {s['accuracy']:.4f} (p {s['p_value']:.2g})" for b, s in summary.get("baselines", {}).items())
    command = "python -m theworld.evaluate " + " ".join(shlex.quote(a) for a in argv)
    local = _local(data)
    one_file = not local.is_dir() and local.suffix != ".parquet"  # JSONL: no splits
    return [
        str(data).rstrip("/").rsplit("/", 1)[-1].replace("|", "%7C"),
        fingerprint(local),
        "-" if one_file else split,
        f"first {limit}" if limit else "all",
        task,
        protocol,
        str(summary["n"]),
        model,
        shuffled,
        base or "-",
        f"`{command.replace('|', '%7C')}`",
    ]


def _read(card: Path) -> str:
    kind = paths.path_kind(card)
    if kind is None:
        return ""
    if kind != paths.REGULAR:
        raise UserError(
            f"{card} (the model card the results go into) is {kind}, not a file: move it away and rerun (the "
            "evaluation's numbers are printed above)"
        )
    try:
        return card.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{card}: cannot read the model card ({getattr(e, 'strerror', None) or e})") from None


def _table_rows(rest: str) -> tuple[list[dict[str, str]], str]:
    """The rows of the table after the heading, as {column: cell} by the table's own header (a card written with
    other columns keeps its rows), and the text after the table."""
    lines = rest.splitlines(keepends=True)
    k, table = 1, []  # line 0: the heading line's end
    while k < len(lines) and (not lines[k].strip() or lines[k].startswith("|")):
        if lines[k].startswith("|"):
            table.append(_cells(lines[k]))
        k += 1
    header, body = (table[0], table[2:]) if table else ([], [])
    return [dict(zip(header, r)) for r in body], "".join(lines[k:])


def results(card: Path) -> list[dict[str, str]]:
    """The card's results rows as {column: cell} (none when it has no results table): what train.report shows."""
    return rows(card.parent, card.name)


def rows(folder: Path, card_name: str = "README.md") -> list[dict[str, str]]:
    """The results rows of stage folder `folder`: its record, or the table of a card written before records."""
    record = folder / RECORD
    kind = paths.path_kind(record)
    if kind is None:
        _, found, rest = _read(folder / card_name).partition(HEADING)
        return _table_rows(rest)[0] if found else []
    if kind != paths.REGULAR:
        raise UserError(f"{record} (the record of the model card's results) is {kind}, not a file: move it away")
    try:
        lines = record.read_text(encoding="utf-8").splitlines()
        got = [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{record}: cannot read the results record ({getattr(e, 'strerror', None) or e})") from None
    if not all(isinstance(r, dict) for r in got):
        raise UserError(f"{record}: a line is not a results row (a JSON object of the table's columns)")
    return got


def section(got: list[dict[str, str]], weights: str | None = None) -> str:
    """The card's results section for `got` (empty without rows); `weights`: the sha256 of the weights the folder
    holds now, against which each row's own is shown."""
    if not got:
        return ""
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in got:
        cells = [r.get(c, "-") for c in COLUMNS]
        if weights and r.get(WEIGHTS_KEY, weights) != weights:
            cells[0] += EARLIER
        table.append("| " + " | ".join(cells) + " |")
    return f"{HEADING}\n\n" + "\n".join(table) + "\n"


def render(text: str, got: list[dict[str, str]], weights: str | None = None) -> str:
    """A card's text (`text`: the card above its results) with the results section of `got`."""
    head, found, rest = text.partition(HEADING)
    tail = _table_rows(rest)[1] if found else ""  # what a hand wrote after the table stays after it
    table = section(got, weights)
    if not table:
        return head + tail
    table += "\n" + tail if tail else ""
    return head.rstrip("\n") + "\n\n" + table if head.strip() else table


def record_text(got: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in got)


def weights_digest(folder: Path) -> str | None:
    """The sha256 final/ records for its trainable weights (None when it records none)."""
    from theworld.model.stage_layout import SUMS, WEIGHTS

    try:
        return json.loads((folder / SUMS).read_text()).get(WEIGHTS)
    except (OSError, ValueError, AttributeError):
        return None


def update(card: Path, new: list[str]) -> None:
    """Put `new` into the card's results record and table, replacing only a row of the same KEY (set content, split,
    limit, task, protocol)."""
    folder = card.parent
    got = rows(folder, card.name)
    weights = weights_digest(folder)
    fresh = dict(zip(COLUMNS, new), **({WEIGHTS_KEY: weights} if weights else {}))
    got = [r for r in got if [r.get(k) for k in KEY] != [fresh[k] for k in KEY]] + [fresh]
    # the record first: a kill between the two leaves a card that the next write renders again from it
    _write(folder / RECORD, record_text(got), "the results record")
    _write(card, render(_read(card), got, weights), "the model card")


def _write(path: Path, text: str, what: str) -> None:
    atomic.remove_stale(path.parent, path.name)  # one a killed evaluation left
    try:
        atomic.write_text(path, text)
    except OSError as e:
        raise UserError(f"{path}: cannot write {what} ({e.strerror}); the numbers are printed above") from None
