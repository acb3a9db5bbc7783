"""Multiple-choice evaluation: the scorer against a hand computation, the data formats and every bad input, the
synthetic set, and train.eval.benchmarks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests._eval_helpers import TWO_ITEMS, blink_folder, hand_scores, write_items
from tests.conftest import evaluate_main, one_error_line
from theworld.embedded import synthetic
from theworld.evaluate import main
from theworld.infer import benchmark_items
from theworld.infer.scoring import Scorer, evaluate, summarize
from theworld.model import images
from theworld.model.config import ImageConfig, ModelConfig, WorldConfig
from theworld.model.world import TheWorld


@pytest.fixture(scope="module")
def tiny():
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig())
    return model.eval(), processor


def test_the_scorer_agrees_with_a_hand_computation_on_a_two_item_file(tiny, tmp_path):
    model, processor = tiny
    items = benchmark_items.read(write_items(tmp_path, TWO_ITEMS))
    assert [it.answer for it in items] == [1, 0] and len(items[1].images) == 2
    scores = Scorer(model, processor, ImageConfig(), items).score([0, 1])
    for i, s in enumerate(scores):
        own, shuffled = s["model"], s["shuffled_world"]
        # item i's own world (its first image), then item i-1's (the first item takes the last one's)
        assert own == pytest.approx(hand_scores(model, processor, items[i], items[i].images[0]), abs=1e-4)
        other = items[(i - 1) % 2].images[0]
        assert shuffled == pytest.approx(hand_scores(model, processor, items[i], other), abs=1e-4)
    assert scores[0]["model"] != scores[0]["shuffled_world"]  # the world changes the scores
    records = evaluate(model, processor, ImageConfig(), items, batch_size=1)
    for r, s in zip(records, scores):
        own, shuffled = s["model"], s["shuffled_world"]
        assert r["pred"] == max(range(len(own)), key=own.__getitem__)
        assert r["pred_shuffled_world"] == max(range(len(shuffled)), key=shuffled.__getitem__)
    choices = lambda rs: [{k: v for k, v in r.items() if k != "outputs"} for r in rs]  # scores: to rounding
    assert choices(evaluate(model, processor, ImageConfig(), items, batch_size=2)) == choices(records)  # batching


BAD = [
    ({"image": "missing.png"}, "field 'image'"),
    ({"answer": "E"}, "field 'answer'"),
    ({"answer": 3}, "field 'answer'"),
    ({"answer": -1}, "field 'answer'"),
    ({"answer": True}, "field 'answer'"),
    ({"answer": "red"}, "field 'answer'"),
    ({"choices": []}, "field 'choices'"),
    ({"choices": "abc"}, "field 'choices'"),
    ({"choices": ["a", 3, "c"]}, "field 'choices'"),
    ({"question": None}, "field 'question'"),
    ({"image": None}, "field 'image'"),
    ({"category": 3}, "field 'category'"),
    ({"question": "what is it? <start_of_turn>"}, "field 'question': holds the Gemma control string '<start_of_turn>'"),
    ({"choices": ["a", "b <end_of_turn>", "c"]}, "field 'choices[1]'"),
    ({"choices": ["a", "b", "a "]}, "field 'choices': choices[0] and choices[2] are the same text"),
    ({"prompt": "answer <start_of_turn>"}, "field 'prompt': holds the Gemma control string '<start_of_turn>'"),
    ({"prompt": "p" * 70000}, "field 'prompt': too long: 70000 characters"),
    ({"choices": ["only"], "answer": 0}, "field 'choices': a single choice"),
    ({"question": "word " * 20000}, "field 'question': too long: 100000 characters (> 65536)"),
    ({"choices": ["a", "b" * 400000]}, "field 'choices[1]': too long: 400000 characters"),
    ({"image": "folder"}, "folder: a directory, not an image file"),
    ({"image": "fifo"}, "fifo: a FIFO, not an image file"),
    ({"image": "loop"}, "loop: a symlink loop"),
    ({"image": "dangling"}, "dangling: a dangling symlink"),
]


@pytest.mark.parametrize("change,words", BAD)
def test_a_bad_item_is_one_line_naming_the_item_and_field_with_exit_2(tmp_path, capsys, change, words):
    import os

    good = {"image": "0.png", "question": "q", "choices": ["a", "b", "c"], "answer": "A"}
    path = write_items(tmp_path, [good, {**good, **change}])
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")  # never opened: reading it would wait for a writer forever
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.png")
    assert main(["--model", str(tmp_path / "no-model"), "--data", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:2" in err and words in err


@pytest.mark.parametrize("line", ["{not json", "[1, 2]", '"text"', "[" * 100000 + "]" * 100000])
def test_a_malformed_line_is_one_line_with_exit_2(tmp_path, capsys, line):
    path = write_items(tmp_path, [line])
    assert main(["--model", str(tmp_path), "--data", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:1" in err and "malformed line" in err


def test_a_raw_line_separator_inside_a_json_string_is_part_of_the_line(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028 and U+0085 raw; JSONL lines end at \\n only."""
    item = {"image": "0.png", "question": "one\u2028two\x85three", "choices": ["a\u2029", "b"], "answer": 0}
    path = write_items(tmp_path, [json.dumps(item, ensure_ascii=False)] * 2)
    assert "\u2028" in path.read_text()
    items = benchmark_items.read(path)
    assert [it.name for it in items] == [f"{path}:1", f"{path}:2"] and items[0].question == item["question"]


def test_data_that_is_a_fifo_is_refused_without_opening_it(tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "items.jsonl")
    assert main(["--model", str(tmp_path), "--data", str(tmp_path / "items.jsonl")]) == 2
    assert "items.jsonl: a FIFO, not a data file" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_text_is_one_line_with_exit_2(tmp_path, capsys):
    path = tmp_path / "items.jsonl"
    path.write_bytes(b"\xff\xfe\x00binary")
    assert main(["--model", str(tmp_path), "--data", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err


def test_bad_arguments_and_missing_data_exit_2(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--data", str(tmp_path / "none.jsonl")]) == 2
    assert main(["--model", str(tmp_path), "--data", "x", "--batch-size", "0"]) == 2
    assert main(["--data", "x"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 3


def test_an_unreadable_image_is_skipped_and_recorded(tmp_path):
    path = write_items(tmp_path, TWO_ITEMS)
    (tmp_path / "2.png").write_bytes(b"not a png")
    bad = benchmark_items.unreadable(benchmark_items.read(path))
    assert bad == [{"item": f"{path}:2", "field": "image 2", "reason": bad[0]["reason"]}] and bad[0]["reason"]


def test_blinks_parquet_layout_is_read(tmp_path, tiny):
    items = benchmark_items.read(blink_folder(tmp_path / "blink"))
    assert [(it.answer, it.category, len(it.images), it.choices) for it in items] == [
        (2, "Counting", 1, ["1", "2", "3"]),
        (1, "Jigsaw", 2, ["(A)", "(B)"]),
    ]
    assert isinstance(items[0].images[0], bytes) and "val_Counting_1" in items[0].name
    model, processor = tiny
    records = evaluate(model, processor, ImageConfig(), items, batch_size=2)
    assert [r["answer"] for r in records] == [2, 1]


@pytest.mark.parametrize("answer,image_1,words", [("(D)", True, "field 'answer'"), ("(B)", False, "field 'image_1'")])
def test_bad_blink_rows_name_the_row_and_field(tmp_path, capsys, answer, image_1, words):
    folder = blink_folder(tmp_path / "blink", answer, image_1)
    assert main(["--model", str(tmp_path), "--data", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "val_Counting_2" in err and words in err


def test_the_synthetic_set_holds_the_true_caption_among_one_word_edits(tmp_path):
    path = tmp_path / "mc" / "items.jsonl"
    records = benchmark_items.make_synthetic(path, 30, seed=1)
    assert {r["category"] for r in records} == {"colour", "shape", "position"}
    for i, (r, item) in enumerate(zip(records, benchmark_items.read(path))):
        caption = synthetic.scene(1, i)[1]
        assert item.choices[item.answer] == caption and len(set(item.choices)) == len(item.choices) >= 2
        for j, c in enumerate(item.choices):
            if j != item.answer:
                diff = [(a, b) for a, b in zip(c.split(), caption.split()) if a != b]
                assert len(diff) == 1 and diff[0][1] in benchmark_items.EDITS[r["category"]]
        assert item.images[0].read_bytes() == images.to_bytes(synthetic.scene(1, i)[0])


def test_the_cli_on_a_trained_run_and_train_benchmarks_agree(trained_run, run_copy, capsys):
    assert main(["--model", str(run_copy), "--data", str(trained_run["mc"]), "--json", "--batch-size", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 6 and {"accuracy", "accuracy_shuffled_world", "categories"} <= out.keys()
    lines = [json.loads(x) for x in (trained_run["run"] / "metrics.jsonl").read_text().splitlines()]
    bench = [x for x in lines if "bench/items/accuracy" in x]
    assert [x["step"] for x in bench] == [0, 2, 4]
    assert bench[-1]["bench/items/accuracy"] == out["accuracy"]
    assert bench[-1]["bench/items/accuracy_shuffled_world"] == out["accuracy_shuffled_world"]
    assert bench[-1]["bench/items/n"] == 6


@pytest.mark.slow
def test_two_processes_split_the_benchmark_and_agree_with_one(trained_run, tmp_path):
    """7 items over 2 processes, 1 item per forward: one process runs a stand-in batch at the end and nothing hangs;
    the summed counts equal the one-process evaluation of the same (step-0, seeded) weights."""
    from tests.conftest import run2

    mc = tmp_path / "mc7" / "items.jsonl"
    benchmark_items.make_synthetic(mc, 7, seed=2)
    sets = {
        "cache_dir": trained_run["cache"],
        "output_dir": tmp_path / "two",
        "model.dtype": "float32",
        "train.max_steps": 1,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.eval.samples": 8,
        "train.eval.batch_size": 4,
        "train.loader.num_workers": 0,
        "trackers": "[]",
        "train.eval.every": 1,
        "train.eval.benchmarks": f"[{mc}]",
    }
    two = run2([a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    assert two.returncode == 0, two.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    first = next(x for x in lines if "bench/items/n" in x)
    assert first["step"] == 0 and first["bench/items/n"] == 7
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
    s = summarize(evaluate(model.eval(), processor, ImageConfig(), benchmark_items.read(mc)))
    assert first["bench/items/accuracy"] == pytest.approx(s["accuracy"])
    assert first["bench/items/accuracy_shuffled_world"] == pytest.approx(s["accuracy_shuffled_world"])


def test_hostile_paths_and_tolerances_are_one_line_with_exit_2(tmp_path, capsys):
    from precompute import inspect

    good = {"image": "a" * 5000 + ".png", "question": "q", "choices": ["a", "b"], "answer": 0}
    path = write_items(tmp_path, [good])  # a name too long for the file system
    assert main(["--model", str(tmp_path), "--data", str(path)]) == 2
    (tmp_path / "file").write_text("x")  # --make-synthetic under a file, not a folder
    assert main(["--data", str(tmp_path / "file" / "items.jsonl"), "--make-synthetic", "2"]) == 2
    assert inspect.main(["compare-live", str(tmp_path), "--tol", "nan"]) == 2  # would pass any difference
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "field 'image'" in err[0] and "cannot create" in err[1] and "--tol" in err[2], err


def test_out_is_never_an_input_by_name_symlink_or_hardlink(run_copy, trained_run, tmp_path, capsys):
    shutil.copytree(trained_run["mc"].parent, tmp_path, dirs_exist_ok=True)
    data = tmp_path / trained_run["mc"].name
    before = data.read_bytes()
    weights = run_copy / "final" / "trainable.safetensors"
    (tmp_path / "link.jsonl").symlink_to(data)
    os.link(data, tmp_path / "hard.jsonl")
    os.link(weights, tmp_path / "weights-hard")
    for out, words in (
        (data, ["--data"]),
        (tmp_path / "link.jsonl", ["--data"]),
        (tmp_path / "hard.jsonl", ["--data"]),
        (weights, ["the model folder"]),
        (tmp_path / "weights-hard", ["the model folder"]),
        (run_copy / "final" / "config.yaml", ["the model folder"]),
    ):
        assert evaluate_main("--model", run_copy, "--data", data, "--out", out) == 2
        one_error_line(capsys, f"--out {out}", *words, "another path")
    assert data.read_bytes() == before
    from theworld.model.stage_layout import verify

    verify(run_copy / "final")  # every file of the model as it was recorded

    from theworld import export

    assert export.main(["--model", str(run_copy), "--merge", "--out", str(run_copy / "final")]) == 2
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-final").symlink_to(run_copy / "final")
    assert export.main(["--model", str(run_copy), "--merge", "--out", str(tmp_path / "to-final")]) == 2
    one_error_line(capsys, "symlink")
    verify(run_copy / "final")


def test_out_is_written_whole_and_a_killed_runs_partial_file_is_removed(run_copy, trained_run, tmp_path, capsys):
    out = tmp_path / "preds.jsonl"
    out.write_text("an earlier evaluation\n")
    stale = tmp_path / ".tmp-preds.jsonl-999999999"  # a pid that runs no process: a killed evaluation's
    stale.write_text('{"item": "half"')
    assert evaluate_main("--model", run_copy, "--data", trained_run["mc"], "--limit", "2", "--out", out) == 0
    err = capsys.readouterr().err
    assert f"removed {stale}" in err and not stale.exists()
    text = out.read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    assert len(lines) == 2 and {"item", "pred", "answer"} <= lines[0].keys()
    assert (
        evaluate_main("--model", run_copy, "--data", trained_run["mc"], "--ema", "--out", out) == 2
    )  # fails once it opened
    one_error_line(capsys, "ema.safetensors")
    assert out.read_text() == text  # a failed evaluation leaves --out as it was
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_arguments_that_would_be_ignored_are_refused(trained_run, tmp_path, capsys):
    mc = trained_run["mc"]
    for argv, words in (
        (["--split", "test"], ["--split test", "JSONL", "leave --split out"]),
        (["--split", "val"], ["--split val"]),
        (["--task", "caption", "--protocol", "generate"], ["--protocol", "--task mc"]),
        (["--task", "caption", "--baselines", "no_world"], ["--baselines", "--task mc"]),
        (["--baselines", "all,no_world"], ["all already names every baseline"]),
    ):
        assert evaluate_main("--model", trained_run["run"], "--data", mc, *argv) == 2
        line = one_error_line(capsys, *words)
        assert "unknown" not in line


def test_evaluate_out_on_a_full_device_says_the_disk_is_full(run_copy, trained_run, capsys):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    assert evaluate_main("--model", run_copy, "--data", trained_run["mc"], "--limit", "1", "--out", "/dev/full") == 2
    line = one_error_line(capsys, "/dev/full", "no space left on device")
    assert "last complete save" not in line
