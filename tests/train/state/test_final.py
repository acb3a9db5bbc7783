"""train.state.final: final/'s results rows (written by theworld.evaluate) live in final/results.jsonl, which the card
is rendered from, so no rerun of the training loses them; a finished run rerun with another cache, model or stage is
refused in one line and final/ is left as it was."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import (
    base_args,
    evaluate_main,
    one_error_line,
    train_inproc,
)
from theworld.cache_format import sha256_file
from theworld.core.errors import UserError
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


def _damage_record(folder: Path, how: str) -> None:
    sums = folder / "sha256.json"
    sums.unlink()
    if how == "empty":
        sums.write_text("{}")
    elif how == "null":
        sums.write_text("null")
    elif how == "directory":
        sums.mkdir()
    elif how == "dev-zero":
        sums.symlink_to("/dev/zero")
    elif how == "fifo":
        os.mkfifo(sums)


@pytest.mark.parametrize("how", ["deleted", "empty", "null", "directory", "dev-zero", "fifo"])
def test_a_final_folder_written_with_records_must_have_them(run_copy, trained_run, how, capsys):
    from theworld import export
    from theworld.model.world import TheWorld

    final = run_copy / "final"
    _damage_record(final, how)
    with pytest.raises(UserError, match="sha256"):
        TheWorld.from_pretrained(final)
    assert evaluate_main("--model", run_copy, "--data", trained_run["mc"]) == 2
    one_error_line(capsys, "sha256.json")
    assert export.main(["--model", str(run_copy), "--merge", "--out", str(run_copy.parent / "exported")]) == 2
    one_error_line(capsys, "sha256.json")
    assert not (run_copy.parent / "exported").exists()


def test_an_older_folder_without_records_loads_with_a_note(run_copy, capsys):
    from safetensors.torch import load_file, save_file

    from theworld.model.world import TheWorld

    final = run_copy / "final"
    weights = final / "trainable.safetensors"
    save_file(load_file(str(weights)), str(weights))  # as written before: no header saying records exist
    (final / "sha256.json").unlink()
    TheWorld.from_pretrained(final)
    err = capsys.readouterr().err
    assert err.count("no sha256 records") == 1 and "unverified" in err


def _tamper_weights(path: Path, value: float) -> None:
    """What an adversary's tool writes: a valid safetensors file with one value of one tensor replaced."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(path))


def _reseal(folder: Path) -> None:
    """An adversary who also rewrites final/'s sha256 record to match."""
    record = {f.name: sha256_file(f) for f in sorted(folder.iterdir()) if f.name not in ("sha256.json", "README.md")}
    (folder / "sha256.json").write_text(json.dumps(record))


def test_final_is_hashed_and_damaged_or_non_finite_weights_are_refused_by_every_reader(cache, tmp_path, capsys):
    from safetensors.torch import load_file

    from theworld import describe, evaluate
    from theworld.core.errors import UserError
    from theworld.infer import benchmark_items
    from theworld.model.world import TheWorld

    out = tmp_path / "run"
    assert train_inproc(base_args(cache, out, steps=2)) == 0
    final = out / "final"
    record = json.loads((final / "sha256.json").read_text())
    assert record == {f.name: sha256_file(f) for f in final.iterdir() if f.name not in ("sha256.json", "README.md")}
    assert {"trainable.safetensors", "config.yaml", "prompt.txt"} <= set(record)
    weights = final / "trainable.safetensors"
    good = weights.read_bytes()
    first = sorted(load_file(str(weights)))[0]
    data = tmp_path / "mc.jsonl"
    benchmark_items.make_synthetic(data, 4, seed=1)
    image = tmp_path / "a.png"
    from PIL import Image

    Image.new("RGB", (64, 64), "red").save(image)
    readers = {
        "describe": lambda: describe.main(["--model", str(out), "--image", str(image)]),
        "evaluate": lambda: evaluate.main(["--model", str(out), "--data", str(data)]),
        "init_from": lambda: train_inproc(base_args(cache, tmp_path / "next", steps=1, **{"init_from": final})),
    }
    capsys.readouterr()
    for damage, words in (
        ("bit", ["damaged", "sha256"]),
        ("nan", [first, "non-finite"]),
        ("inf", [first, "non-finite"]),
    ):
        weights.write_bytes(good)
        if damage == "bit":
            raw = bytearray(good)
            raw[-5] ^= 0x10
            weights.write_bytes(bytes(raw))
        else:
            _tamper_weights(weights, float(damage))
            _reseal(final)  # past the record: the finite check is what refuses it
        with pytest.raises(UserError) as e:
            TheWorld.from_pretrained(out)
        assert all(w in str(e.value) for w in words), str(e.value)
        for name, run in readers.items():
            assert run() == 2, (damage, name)
            one_error_line(capsys, *words)
        _reseal(final)
    assert not (tmp_path / "next" / "final").exists()
