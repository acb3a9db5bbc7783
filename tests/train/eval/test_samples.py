"""train/eval/samples.py: captions generated at every eval (metrics.jsonl, TensorBoard), with the eval gap
and stop_on_plateau in the same watched run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import metrics, watched_args


def test_a_run_logs_captions_and_the_gap_and_stops_on_plateau_for_good(trained_run, tmp_path, capsys):
    """min_improvement 10 (1000%): the first eval that can be judged (step 1, one eval back) is a plateau."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train.loop import main

    out = tmp_path / "run"
    args = watched_args(
        trained_run["cache"],
        out,
        **{
            "train.eval.plateau.window_evals": 1,
            "train.eval.plateau.min_improvement": 10,
            "train.eval.stop_on_plateau": "true",
            "trackers": "[tensorboard]",
        },
    )
    assert main(args) == 0
    cap = capsys.readouterr()
    err = cap.err
    events = metrics(out)
    evals = [e for e in events if "eval_loss" in e]
    assert [e["step"] for e in evals] == [0, 1] and [e["plateaued"] for e in evals] == [False, True]
    assert all(e["eval_gap"] == pytest.approx(e["eval_loss_shuffled_world"] - e["eval_loss"]) for e in evals)
    samples = [e for e in events if "samples" in e]
    assert [e["step"] for e in samples] == [0, 1]
    for e in samples:
        assert len(e["samples"]) == 2
        assert all(set(r) == {"caption", "own_world", "shuffled_world", "image"} and r["caption"] for r in e["samples"])
        assert all((out / r["image"]).is_file() for r in e["samples"])  # each sample's picture, for train.report
    assert "the eval loss has plateaued" in err and "stopping: train.eval.stop_on_plateau" in err
    assert "plateaued at step 1" in cap.out and "init_from:" in cap.out  # the summary
    assert "plateaued at step 1" in (out / "final" / "README.md").read_text()
    assert (out / "checkpoint-1").is_dir()
    state = json.loads((out / "checkpoint-1" / "state.json").read_text())
    assert state["plateau_step"] == 1 and [s for s, _ in state["eval_history"]] == [0, 1]

    tb = EventAccumulator(str(out / "theworld"), size_guidance={"images": 0, "tensors": 0})
    tb.Reload()
    assert {"eval_gap", "eval_loss", "eval_loss_shuffled_world"} <= set(tb.Tags()["scalars"])
    assert {"samples/0", "samples/1"} <= set(tb.Tags()["images"])
    assert "samples/text_summary" in tb.Tags()["tensors"]

    # a rerun resumes at the plateau and stops there again: no step trained, no line added
    assert main(args) == 0
    assert metrics(out) == events
