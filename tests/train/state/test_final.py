"""train.state.final: final/'s results rows (written by theworld.evaluate) live in final/results.jsonl, which the card
is rendered from, so no rerun of the training loses them; a finished run rerun with another cache, model or stage is
refused in one line and final/ is left as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import base_args, train_inproc
from theworld.infer import card

ROW = ["scenes.jsonl", "00aa11bb22cc33dd", "-", "all", "mc", "loglik", "12", "0.5833", "0.2500", "-", "`python -m x`"]


def _files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def _err_lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(("error", "warning"))]


@pytest.mark.slow
def test_results_survive_every_rerun_and_a_finished_run_refuses_another_cache_or_stage(cache, tmp_path, capsys):
    out = tmp_path / "run"
    args = lambda c=cache, **kw: base_args(c, out, steps=2, **kw)
    assert train_inproc(args()) == 0
    final = out / "final"
    card.update(final / "README.md", ROW)
    rows = card.results(final / "README.md")
    assert [r["benchmark"] for r in rows] == ["scenes.jsonl"] and rows[0]["model"] == "0.5833"
    record = [json.loads(x) for x in (final / "results.jsonl").read_text().splitlines()]
    assert (
        record[0]["n"] == "12"
        and record[0]["weights sha256"] == json.loads((final / "sha256.json").read_text())["trainable.safetensors"]
    )
    kept = _files(final)
    # an identical rerun: nothing to train, final/ rewritten with the same bytes, rows included
    capsys.readouterr()
    assert train_inproc(args()) == 0
    assert _files(final) == kept
    # another cache (a copy elsewhere: another cache_dir), another stage: one line, final/ untouched
    other = tmp_path / "other-cache"
    shutil.copytree(cache, other)
    for given, words in (
        (args(other), "other-cache'"),  # cache_dir 'OLD' -> 'NEW' (a long path shortened in its middle)
        (args(**{"freeze.vision": "false"}), "freeze.vision True -> False"),
    ):
        capsys.readouterr()
        assert train_inproc(given) == 2
        lines = _err_lines(capsys)
        assert len(lines) == 1 and "holds a finished run (step 2" in lines[0] and words in lines[0], lines
        assert "trained with other settings: " + words.split(" ")[0] in lines[0] or "cache_dir '" in lines[0]
        assert "another output_dir" in lines[0] and "--set train.max_steps=N (above 2)" in lines[0]
        assert _files(final) == kept
    # the way forward: extend it on the other cache; the warning names what changed, the rows stay, marked as of
    # the weights they measured
    capsys.readouterr()
    assert train_inproc(base_args(other, out, steps=3)) == 0
    warned = [ln for ln in _err_lines(capsys) if "written under a different config" in ln]
    assert len(warned) == 1 and "train.max_steps 2 -> 3" in warned[0] and "cache_dir" in warned[0], warned
    text = (final / "README.md").read_text()
    assert "| scenes.jsonl (earlier weights) | 00aa11bb22cc33dd |" in text and "steps: 3" in text
    assert card.results(final / "README.md")[0]["n"] == "12"


def test_a_card_from_before_the_record_keeps_its_rows_and_hand_written_tail(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "README.md").write_text(
        "# TheWorld: run\n\n## Evaluation results\n\n| benchmark | n | model |\n| --- | --- | --- |\n"
        "| old.jsonl | 7 | 0.4286 |\n\nnotes by hand\n"
    )
    card.update(final / "README.md", ROW)
    text = (final / "README.md").read_text()
    assert [r["benchmark"] for r in card.results(final / "README.md")] == ["old.jsonl", "scenes.jsonl"]
    assert text.startswith("# TheWorld: run\n\n## Evaluation results") and text.rstrip().endswith("notes by hand")
    assert len((final / "results.jsonl").read_text().splitlines()) == 2
