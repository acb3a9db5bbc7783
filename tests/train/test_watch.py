"""Watching a run: the plateau rule, stop_on_plateau, generated captions at every eval (metrics.jsonl, TensorBoard,
W&B), the eval gap as a scalar, and a W&B run that a resumed run continues (the real wandb package, offline)."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import base_args
from train.config import PlateauConfig
from train.eval import plateau


def run_args(cache: Path, out: Path, **extra) -> list[str]:
    """conftest's small run with an eval (and its sampled captions) every step and a checkpoint every second."""
    watched = {
        "train.global_batch_size": 8,
        "train.eval.samples": 8,
        "train.checkpoint.every": 2,
        "train.eval.every": 1,
    }
    watched |= {"train.lr_schedule.warmup_steps": 1, "train.eval.captions": 2, "train.eval.caption_tokens": 4}
    return base_args(cache, out, steps=4, **watched, **extra)


def lines(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------------------------------
# The rule


def test_the_default_window_is_the_guides_5000_steps_or_a_quarter_of_a_shorter_run():
    assert plateau.window_evals(0, eval_every=500, max_steps=100_000) == 10  # 5,000 steps
    assert plateau.window_evals(0, eval_every=250, max_steps=4000) == 4  # the last 1,000 of 4,000 steps
    assert plateau.window_evals(0, eval_every=250, max_steps=1000) == 2  # never fewer than two evals
    assert plateau.window_evals(0, eval_every=0, max_steps=1000) == 0  # evals only at the end: never judged
    assert plateau.window_evals(3, eval_every=0, max_steps=1000) == 3


@pytest.mark.parametrize(
    "losses,window,flat",
    [
        ([2.0, 1.5, 1.2, 1.0], 2, False),  # 1.5 -> 1.0: 33% better
        ([2.0, 1.0, 0.999, 0.995], 2, True),  # 0.5% better than 1.0 over the last two evals
        ([2.0, 1.0, 1.01, 1.02], 2, True),  # worse
        ([2.0, 1.0], 2, False),  # too short to judge
        ([1.0, 0.995], 1, True),
    ],
)
def test_plateaued_is_less_than_min_improvement_over_the_window(losses, window, flat):
    assert plateau.plateaued(losses, window, 0.01) is flat


def test_record_keeps_one_entry_per_step_and_the_first_plateau_step():
    state = SimpleNamespace(step=0, eval_history=[], plateau_step=None)
    cfg = PlateauConfig(window_evals=1, min_improvement=0.01)
    for step, loss in [(0, 2.0), (1, 1.0), (2, 0.999), (2, 0.999), (3, 0.5), (4, 0.499)]:
        state.step = step
        out = plateau.record(state, cfg, 1, 100, loss)
    assert [s for s, _ in state.eval_history] == [0, 1, 2, 3, 4]
    assert state.plateau_step == 2 and out["plateaued"] is True
    assert out["plateau_improvement"] == pytest.approx(0.002)


def test_plateau_config_is_checked():
    from theworld.core.errors import UserError

    with pytest.raises(UserError, match="train.eval.plateau.window_evals"):
        PlateauConfig(window_evals=-1)
    with pytest.raises(UserError, match="train.eval.plateau.min_improvement"):
        PlateauConfig(min_improvement=float("nan"))


# ----------------------------------------------------------------------------------------------------------------------
# A run


def test_a_run_logs_captions_and_the_gap_and_stops_on_plateau_for_good(trained_run, tmp_path, capsys):
    """min_improvement 10 (1000%): the first eval that can be judged (step 1, one eval back) is a plateau."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train.loop import main

    out = tmp_path / "run"
    args = run_args(
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
    events = lines(out)
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
    assert lines(out) == events


# ----------------------------------------------------------------------------------------------------------------------
# W&B (the real package, offline)


def wandb_records(run_dir: Path, timeout: float = 60.0) -> dict[str, list]:
    """The records of an offline run's transaction log (`run-<id>.wandb`), by kind, once it holds the run's `exit`
    record (W&B's service writes the log on its own thread, after `finish()` may have returned)."""
    deadline = time.monotonic() + timeout
    while "exit" not in (records := _wandb_log(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return records


def _wandb_log(run_dir: Path) -> dict[str, list]:
    """W&B's documented LevelDB-style log (a 7-byte header, 32 KiB blocks of crc32-checked chunks holding `Record`
    protobufs), read here rather than through wandb's internal reader, which moves between releases."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, block, head = path.read_bytes(), 32768, 7
    if not data:
        return {}
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out: dict[str, list] = {}
    pos, chunks = head, b""
    while pos + head <= len(data):
        if block - pos % block < head or data[pos : pos + head] == bytes(head):  # a block's zero-padded tail
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + head])
        body = data[pos + head : pos + head + length]
        if len(body) < length:  # the service is still writing
            break
        assert zlib.crc32(bytes([kind]) + body) == crc, f"{path}: a corrupt chunk at byte {pos}"
        pos, chunks = pos + head + length, chunks + body
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            kind_name = rec.WhichOneof("record_type")
            out.setdefault(kind_name, []).append(getattr(rec, kind_name))
    return out


@pytest.mark.slow
def test_wandb_offline_holds_config_scalars_and_captions_and_a_resumed_run_continues_it(
    trained_run, tmp_path, monkeypatch
):
    import train.loop
    from train.loop import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = run_args(
        trained_run["cache"],
        out,
        **{
            "trackers": "[wandb]",
            "wandb.project": "theworld-test",
            "wandb.entity": "someone",
            "wandb.run_name": "stage1-test",
            "wandb.tags": "[demo]",
        },
    )
    real_step = train.loop.optimization_step

    def crash_at_3(components, state, micro):
        if state.step == 3:
            raise RuntimeError("simulated crash")
        return real_step(components, state, micro)

    monkeypatch.setattr(train.loop, "optimization_step", crash_at_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(args)
    monkeypatch.setattr(train.loop, "optimization_step", real_step)
    run_id = json.loads((out / "checkpoint-2" / "state.json").read_text())["wandb_run_id"]
    assert main(args) == 0
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)  # one W&B run, written twice
    first, resumed = (wandb_records(r) for r in runs)
    assert first["run"][0].run_id == resumed["run"][0].run_id == run_id
    assert first["run"][0].display_name == "stage1-test" and list(first["run"][0].tags) == ["demo"]
    assert [(r["run"][0].project, r["run"][0].entity) for r in (first, resumed)] == [("theworld-test", "someone")] * 2
    config = {i.key: json.loads(i.value_json) for c in first["config"] for i in c.update}
    assert config["model.gemma"] == "tiny" and config["train.eval.captions"] == 2
    steps = {}
    for records in (first, resumed):
        for h in records["history"]:
            steps.setdefault(h.step.num, set()).update(i.key or i.nested_key[0] for i in h.item)
    assert {"loss", "lr", "eval_loss", "eval_gap", "eval_loss_shuffled_world", "samples"} <= steps[4]
    assert {"eval_loss", "samples"} <= steps[0]
    tables = sorted(resumed_path.name for r in runs for resumed_path in (r / "files" / "media" / "table").glob("*"))
    assert tables and all(n.startswith("samples_") for n in tables)
    table = json.loads(next((runs[1] / "files" / "media" / "table").glob("samples_4_*")).read_text())
    assert table["columns"] == ["image", "caption", "own_world", "shuffled_world"] and len(table["data"]) == 2


# ----------------------------------------------------------------------------------------------------------------------
# An Accelerate config for several CPU processes


def multi_cpu_config(path: Path, processes: int) -> Path:
    """What `accelerate config` writes for N CPU processes on one machine (its own ClusterConfig)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    ClusterConfig(
        compute_environment="LOCAL_MACHINE",
        distributed_type=DistributedType.MULTI_CPU,
        mixed_precision="no",
        use_cpu=True,
        debug=False,
        num_processes=processes,
        num_machines=1,
        machine_rank=0,
        main_training_function="main",
        downcast_bf16=False,
    ).to_yaml_file(str(path))
    return path


def test_the_child_of_a_multi_cpu_config_launch_is_detected(tmp_path, monkeypatch):
    from theworld.core import process_group as launch

    cfg = multi_cpu_config(tmp_path / "acc.yaml", 3)
    launcher = ["python", "-m", "accelerate.commands.launch", "--config_file", str(cfg), "-m", "train.loop"]
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert launch.cpu_config_processes(launcher) == 0  # asked for one process: nothing to say
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert launch.cpu_config_processes(launcher) == 3
    assert launch.cpu_config_processes([*launcher[:3], f"--config-file={cfg}"]) == 3
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert launch.cpu_config_processes(launcher) == 0  # not started by accelerate launch


@pytest.mark.slow
def test_accelerate_launch_of_a_multi_cpu_config_says_how_to_start_n_processes(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ENV, ROOT

    cfg = multi_cpu_config(tmp_path / "acc.yaml", 2)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(cfg),
            "-m",
            "train.loop",
            "--config",
            "configs/stage1.yaml",
            "--set",
            f"output_dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("error:"))
    assert r.returncode != 0 and "asks for 2 CPU processes (MULTI_CPU)" in line
    assert "accelerate launch --multi_gpu --num_processes 2" in line and "-m train.loop --config" in line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------------------
# The progress bar


def test_the_bar_shows_lr_every_step_and_leaves_the_first_step_out_of_its_rate(tmp_path, capsys):
    import time

    from train.metrics import Metrics

    m = Metrics(SimpleNamespace(is_main_process=True), tmp_path, {}, 0, 100, [])
    m.bar.start_t -= 30  # a 30 s compile and warm-up before the first step ends
    m.advance(loss=2.0, lr=1e-3, samples_per_s=1.0, step_s=30.0)
    assert "first step: 30.0s" in capsys.readouterr().err
    assert m.bar.n == 1 and m.bar.format_dict["elapsed"] < 5
    for i in range(3):
        time.sleep(0.01)
        m.advance(loss=1.0, lr=1e-4 * (i + 1), samples_per_s=500.0 + i, step_s=0.01)
    assert "lr=3.00e-04" in m.bar.postfix and "sps=502" in m.bar.postfix  # the last step's, not a log line's
    assert m.bar.n == 4 and m.bar.format_dict["elapsed"] < 5  # the ETA reads 3 fast steps, not 30 s for 4
    m.close()
