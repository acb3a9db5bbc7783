"""The results table of a stage's model card (final/README.md): one row per benchmark, task and protocol, written or
updated by `theworld.evaluate` whenever it evaluates a local run's final/ folder."""

from __future__ import annotations

import shlex
from pathlib import Path

HEADING = "## Evaluation results"
COLUMNS = ["benchmark", "task", "protocol", "n", "model", "shuffled world", "baselines", "command"]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def row(summary: dict, data: str, task: str, argv: list[str]) -> list[str]:
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
    return [
        Path(data).name,
        task,
        protocol,
        str(summary["n"]),
        model,
        shuffled,
        base or "-",
        f"`{command.replace('|', '%7C')}`",
    ]


def update(card: Path, new: list[str]) -> None:
    """Put `new` into the card's results table, replacing a row for the same benchmark, task and protocol."""
    text = card.read_text() if card.is_file() else ""
    head, found, rest = text.partition(HEADING)
    rows, tail = [], ""
    if found:
        lines = rest.splitlines(keepends=True)
        k = 1  # the heading line's end
        while k < len(lines) and (not lines[k].strip() or lines[k].startswith("|")):
            if lines[k].startswith("|"):
                rows.append(_cells(lines[k]))
            k += 1
        tail = "".join(lines[k:])
        rows = rows[2:]  # the header and the rule
    rows = [r for r in rows if r[:3] != new[:3]] + [new]
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]
    section = f"{HEADING}\n\n" + "\n".join(table) + "\n" + ("\n" + tail if tail else "")
    tmp = card.with_name(card.name + ".tmp")
    tmp.write_text(head.rstrip("\n") + "\n\n" + section if head.strip() else section)
    tmp.replace(card)
