"""python -m tools.profile_report: self times and parts from a Chrome trace (exact on a hand-made one), and the report
of a real trace written by `profile:` in a tiny run."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import base_args, one_error_line, train_config, train_inproc
from theworld.core.errors import UserError
from tools import profile_report


def ev(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_self_times_and_parts_add_up_on_a_hand_made_trace():
    events = [
        ev("theworld:language_model", 0, 100, "user_annotation"),
        ev("aten::mm", 10, 50),
        ev("aten::add", 20, 10),  # add inside mm: mm's self time is 40
        ev("theworld:optimizer", 200, 30, "user_annotation"),
        ev("aten::mul", 205, 20),
        ev("autograd::engine::evaluate_function: MmBackward0", 300, 40, tid=2),
        ev("aten::mm", 305, 30, tid=2),
        ev("gloo:all_reduce", 400, 25),
        ev("aten::copy_", 500, 5),
    ]
    ops, parts, wall = profile_report.host_times(events)
    assert ops["aten::mm"] == [2, 40 + 30] and ops["aten::add"] == [1, 10] and ops["aten::mul"] == [1, 20]
    assert parts == {"language_model": 100, "optimizer": 30, "backward": 40, "communication": 25, "other": 5}
    assert wall == 505


def test_advice_names_the_part_that_stands_out():
    said = "\n".join(profile_report.advice({"data": 0.4, "language_model": 0.3, "backward": 0.3}))
    assert "data wait takes 40%" in said and "train.loader.num_workers" in said and "compute-bound" in said
    assert profile_report.advice({"language_model": 0.3, "other": 0.7}) == [
        "- no part stands out: the step is balanced"
    ]


def test_report_of_a_tiny_runs_trace(trained_run, tmp_path, capsys):
    from train.loop import main

    out = tmp_path / "run"
    sets = {
        "cache_dir": trained_run["cache"],
        "output_dir": out,
        "model.dtype": "float32",
        "train.max_steps": 3,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 8,
        "train.eval.samples": 8,
        "train.loader.num_workers": 0,
        "trackers": "[]",
        "train.eval.every": 0,
        "train.eval.captions": 0,
        "profile.enabled": "true",
        "profile.start_step": 1,
        "profile.steps": 2,
    }
    assert main([a for k, v in sets.items() for a in ("--set", f"{k}={v}")]) == 0
    capsys.readouterr()
    assert profile_report.main([str(out), "--top", "5"]) == 0
    text = capsys.readouterr().out
    rows = {
        ln.split("|")[1].strip(): float(ln.split("|")[2])
        for ln in text.splitlines()
        if ln.startswith("| ") and not ln.startswith("| ---") and ln.count("|") == 4 and "time (ms)" not in ln
    }
    for part in ("language model forward", "backward", "world projector", "optimizer", "data wait"):
        assert rows.get(part, 0) > 0, (part, text)
    assert "## Top 5 operations by self time" in text and "`aten::" in text and "## What it suggests" in text
    total = json.loads((out / "profile" / "trace-rank0.json").read_text())
    assert total["traceEvents"]


def test_a_run_without_a_trace_is_a_one_line_error(tmp_path, capsys):
    assert profile_report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "profile.enabled: true" in err
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "trace-rank0.json").write_text("{not json")
    assert profile_report.main([str(tmp_path)]) == 2
    assert "not a readable Chrome trace" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["nccl:all_reduce", "c10d::allreduce_", "record_param_comms"])
def test_communication_is_known_by_name(name):
    assert profile_report.part_of([], name) == "communication"


def test_profile_window_and_report_arguments_are_checked(tmp_path, trained_run, capsys):
    for sets, words in (
        (["profile.steps=-1"], ["profile.steps", ">= 1"]),
        (["profile.start_step=-2"], ["profile.start_step", ">= 0"]),
        (["profile.top=0"], ["profile.top"]),
    ):
        with pytest.raises(UserError) as e:
            train_config(*sets)
        assert all(w in str(e.value) for w in words)
    args = base_args(trained_run["cache"], tmp_path / "out", steps=3)
    assert train_inproc(args + ["--set", "profile.enabled=true", "--set", "profile.start_step=10"]) == 2
    one_error_line(capsys, "profile.start_step", "3 steps", "<= 0")
    assert not (tmp_path / "out" / "final").exists()

    from tools import profile_report

    assert profile_report.main([str(tmp_path), "--top", "-3"]) == 2
    one_error_line(capsys, "--top must be >= 1")
    (tmp_path / "profile").mkdir()
    os.mkfifo(tmp_path / "profile" / "trace-rank0.json")
    assert profile_report.main([str(tmp_path)]) == 2
    one_error_line(capsys, "trace-rank0.json is a FIFO")
