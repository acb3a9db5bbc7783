"""The results table of a stage's model card (final/README.md): one row per evaluated set, written or updated by
`theworld.evaluate` whenever it evaluates a local run's final/ folder.

A row is keyed by what it measured: the set's content (`set sha256`, not its file name, which another set may share),
the split, `--limit`, the task and the protocol. A new result replaces only the row of the same key: another set of the
same name, or a run on part of the set, gets a row of its own."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

from theworld.core import atomic, paths
from theworld.core.errors import UserError

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
    _, found, rest = _read(card).partition(HEADING)
    return _table_rows(rest)[0] if found else []


def update(card: Path, new: list[str]) -> None:
    """Put `new` into the card's results table, replacing only a row of the same KEY (set content, split, limit,
    task, protocol)."""
    text = _read(card)
    head, found, rest = text.partition(HEADING)
    rows, tail = _table_rows(rest) if found else ([], "")
    fresh = dict(zip(COLUMNS, new))
    rows = [r for r in rows if [r.get(k) for k in KEY] != [fresh[k] for k in KEY]] + [fresh]
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)] + [
        "| " + " | ".join(r.get(c, "-") for c in COLUMNS) + " |" for r in rows
    ]
    section = f"{HEADING}\n\n" + "\n".join(table) + "\n" + ("\n" + tail if tail else "")
    atomic.remove_stale(card.parent, card.name)  # one a killed evaluation left
    try:
        atomic.write_text(card, head.rstrip("\n") + "\n\n" + section if head.strip() else section)
    except OSError as e:
        raise UserError(f"{card}: cannot write the model card ({e.strerror}); the numbers are printed above") from None
