"""train.metrics: where the trackers write."""

from __future__ import annotations

import json
import re
import struct
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import (
    base_args,
    metrics,
    one_error_line,
    train_inproc,
    watched_args,
)


@pytest.mark.slow
def test_wandb_files_go_under_wandb_dir_when_the_user_set_it_and_under_output_dir_otherwise(
    cache, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(scratch))
    out = tmp_path / "run"
    assert train_inproc(base_args(cache, out, steps=1, trackers="[wandb]", **{"wandb.project": "p"})) == 0
    assert len(list((scratch / "wandb").glob("offline-run-*"))) == 1 and not (out / "wandb").exists()
    monkeypatch.delenv("WANDB_DIR")
    other = tmp_path / "run2"
    assert train_inproc(base_args(cache, other, steps=1, trackers="[wandb]", **{"wandb.project": "p"})) == 0
    assert len(list((other / "wandb").glob("offline-run-*"))) == 1
    assert len(list((scratch / "wandb").glob("offline-run-*"))) == 1


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
    import train.step
    from train.loop import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = watched_args(
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
    real_step = train.step.optimization_step

    def crash_at_3(components, state, micro):
        if state.step == 3:
            raise RuntimeError("simulated crash")
        return real_step(components, state, micro)

    monkeypatch.setattr(train.step, "optimization_step", crash_at_3)  # train.loop.train imports it as it starts
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(args)
    monkeypatch.setattr(train.step, "optimization_step", real_step)
    run_id = json.loads((out / "checkpoint-2" / "state.json").read_text())["wandb_run_id"]
    assert main(args) == 0
    runs = sorted((out / "wandb").glob("offline-run-*"))
    # one W&B run, written twice: wandb adds "-1" to the second folder's name when both started in the same second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r.name) for r in runs)
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


def test_the_progress_bar_loss_is_a_smoothed_per_step_value():
    from train.metrics import SmoothedLoss

    s = SmoothedLoss(beta=0.9)
    assert s.add(4.0) and s.value == pytest.approx(4.0)  # bias-corrected: the first value is itself
    assert not s.add(float("nan")) and s.value == pytest.approx(4.0)
    s.add(2.0)
    assert s.value == pytest.approx((0.9 * 0.1 * 4 + 0.1 * 2) / (1 - 0.81))
    for _ in range(200):
        s.add(1.0)
    assert s.value == pytest.approx(1.0, abs=1e-6)


def test_tensorboard_logs_go_to_output_dir_theworld_with_no_timestamp_folders(cache, tmp_path, capsys):
    out = tmp_path / "run"
    args = base_args(cache, out, steps=2, trackers="[tensorboard]")
    assert train_inproc(args) == 0
    assert train_inproc(base_args(cache, out, steps=3, trackers="[tensorboard]")) == 0  # a resumed run adds none
    logs = out / "theworld"
    assert [p.name for p in logs.iterdir() if p.is_dir()] == []
    events = list(logs.glob("events.out.tfevents.*"))
    assert events and all(p.stat().st_size > 0 for p in events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logs), size_guidance={"tensors": 0})
    acc.Reload()
    assert "loss" in acc.Tags()["scalars"] and "config/text_summary" in acc.Tags()["tensors"]


def test_resume_reads_a_metrics_log_with_a_non_utf8_line_and_refuses_one_that_is_a_folder(cache, tmp_path, capsys):
    out = tmp_path / "run"
    args = lambda steps, d=out: base_args(cache, d, steps=steps, **{"train.checkpoint.every": 2})  # noqa: E731
    assert train_inproc(args(2)) == 0
    log = out / "metrics.jsonl"
    log.write_bytes(log.read_bytes() + b'{"step": 1, "note": "caf\xe9"}\n\xff\xfe garbage\n')
    capsys.readouterr()
    assert train_inproc(args(3)) == 0
    assert [m["step"] for m in metrics(out) if "loss" in m] == [1, 2, 3]
    other = tmp_path / "other"
    (other / "metrics.jsonl").mkdir(parents=True)
    capsys.readouterr()
    assert train_inproc(args(2, other)) == 2
    one_error_line(capsys, "metrics.jsonl", "is a directory")
    assert sorted(p.name for p in other.iterdir()) == ["metrics.jsonl"]
