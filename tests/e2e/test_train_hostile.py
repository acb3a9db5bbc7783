"""Training under hostile conditions: damaged checkpoints, a too-small max_steps on a finished run, preemption by
SIGTERM/SIGINT, a full disk while saving or logging. Each ends in one line, loses nothing, and the rerun is
bit-exact."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    ENV,
    ROOT,
    base_args,
    free_port,
    launch2,
    metrics,
    metrics_lines,
    run2,
    train_inproc,
    wait_for_step,
    weights,
)
from theworld.cache_format import sha256_file


def _one_line(capsys, *words: str) -> str:
    """The one error line (a run stopped mid-way has also printed its progress bar and start line)."""
    text = capsys.readouterr().err
    err = [ln for ln in text.splitlines() if "error" in ln.lower()]
    assert len(err) == 1 and err[0].startswith("error: ") and all(w in err[0] for w in words), err
    assert "Traceback" not in text
    return err[0]


def _final(out: Path) -> bytes:
    return (out / "final" / "trainable.safetensors").read_bytes()


def test_checkpoint_files_are_hashed_and_a_damaged_one_is_refused_not_exported(cache, tmp_path, capsys):
    out = tmp_path / "run"
    args = lambda steps=4, **kw: base_args(cache, out, steps=steps, **{"train.checkpoint.every": 2, **kw})
    assert train_inproc(args()) == 0
    exported = _final(out)
    ckpt = out / "checkpoint-4"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["sha256"] == {f.name: sha256_file(f) for f in ckpt.iterdir() if f.name != "state.json"}
    assert set(state["sha256"]) == {"trainable.safetensors", "optimizer.pt", "rng.safetensors", "config.yaml"}
    capsys.readouterr()
    # a finished 4-step run resumed with max_steps 2 would export its step-4 weights as a 2-step run's
    assert train_inproc(args(steps=2)) == 2
    _one_line(capsys, "'train.max_steps'", "checkpoint-4")
    # one flipped bit in the newest checkpoint's weights: refused before anything is loaded or exported
    weights = ckpt / "trainable.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    assert train_inproc(args()) == 2
    _one_line(capsys, str(weights), "damaged", "the one before it")
    assert _final(out) == exported
    # the line's advice: move it out, and the run continues from checkpoint-2 to the same weights
    ckpt.rename(tmp_path / "damaged-checkpoint-4")
    assert train_inproc(args()) == 0
    assert "resumed from" in capsys.readouterr().err and _final(out) == exported


def _interrupt(args: list[str], out: Path, at_step: int, sig: int) -> tuple[int, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.loop", *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(out, proc, at_step)
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.slow
def test_sigterm_and_sigint_save_and_the_resumed_run_is_bitwise_equal(cache, tmp_path):
    extra = {
        "train.checkpoint.every": 100,
        "world.latent": "sample",
        "train.optimizer.ema": 0.9,
        "train.loader.num_workers": 1,
    }
    steps = 24
    ref = subprocess.run(
        [sys.executable, "-m", "train.loop", *base_args(cache, tmp_path / "ref", steps, **extra)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "run"
    args = base_args(cache, out, steps, **extra)
    code, err = _interrupt(args, out, 2, signal.SIGTERM)
    assert code == 143, err[-3000:]
    first = sorted(out.glob("checkpoint-*"))
    assert len(first) == 1 and 2 <= int(first[0].name.split("-")[1]) < steps, first
    assert f"checkpoint {out}/{first[0].name}" in err and "rerun the same command" in err
    assert "Traceback" not in err and not (out / "final").exists()
    code, err = _interrupt(args, out, int(first[0].name.split("-")[1]) + 2, signal.SIGINT)
    assert code == 130, err[-3000:]
    assert "resumed from" in err and "SIGINT" in err and "Traceback" not in err
    done = subprocess.run(
        [sys.executable, "-m", "train.loop", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _final(out) == _final(tmp_path / "ref")
    assert (out / "final" / "ema.safetensors").read_bytes() == (
        tmp_path / "ref" / "final" / "ema.safetensors"
    ).read_bytes()
    assert [m["loss"] for m in metrics(out) if "loss" in m] == [
        m["loss"] for m in metrics(tmp_path / "ref") if "loss" in m
    ]


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_saving_or_logging_is_one_line_and_the_rerun_is_bit_exact(
    cache, tmp_path, capsys, monkeypatch
):
    from train import metrics as metrics_module
    from train.state import checkpoint

    args = lambda out: base_args(cache, out, steps=4, **{"train.checkpoint.every": 1})
    assert train_inproc(args(tmp_path / "ref")) == 0
    capsys.readouterr()
    out = tmp_path / "run"
    # the third checkpoint's fsync finds the disk full (where a full disk usually shows first)
    saves = {"n": 0}
    real_write_dir = checkpoint._write_dir

    def write_dir(tmp, files):
        saves["n"] += 1
        if saves["n"] == 3:
            monkeypatch.setattr(checkpoint.os, "fsync", _enospc)
        return real_write_dir(tmp, files)

    monkeypatch.setattr(checkpoint, "_write_dir", write_dir)
    assert train_inproc(args(out)) == 2
    _one_line(capsys, "no space left on device", ".tmp-checkpoint-3", "rerun the same command")
    monkeypatch.undo()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    # the metrics file fills up at step 4
    real_open = open

    def metrics_open(path, mode="r", *a, **k):
        if "a" in mode and any(m.get("step") == 3 for m in metrics_lines(Path(path).parent)):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(metrics_module, "open", metrics_open, raising=False)
    assert train_inproc(args(out)) == 2
    _one_line(capsys, "no space left on device", "metrics.jsonl")
    monkeypatch.undo()
    assert train_inproc(args(out)) == 0  # space freed
    assert _final(out) == _final(tmp_path / "ref")
    assert [m["loss"] for m in metrics(out) if "loss" in m] == [
        m["loss"] for m in metrics(tmp_path / "ref") if "loss" in m
    ]


# ----------------------------------------------------------------------------------------------------------------------
# Launchers and process counts


def test_micro_batch_auto_keeps_the_shipped_numbers_and_a_bad_value_gets_a_suggestion():
    from theworld.core.config import load_config
    from theworld.core.errors import UserError
    from train.config import TrainConfig, accumulation_steps

    def micro(path, world, *sets):
        cfg = load_config(TrainConfig, path, list(sets))
        return cfg.train.micro_batch_size, accumulation_steps(cfg, world), cfg.train.micro_batch_size

    for stage in range(1, 5):  # 1 process: what the configs gave before auto (32 of 32; real: 8 of 256)
        assert micro(ROOT / "configs" / f"stage{stage}.yaml", 1) == ("auto", 1, 32)
        assert micro(ROOT / "configs" / f"stage{stage}.yaml", 2) == ("auto", 1, 16)
        assert micro(ROOT / "configs" / "real" / f"stage{stage}.yaml", 1) == ("auto", 32, 8)
        assert micro(ROOT / "configs" / "real" / f"stage{stage}.yaml", 8) == ("auto", 4, 8)
    assert micro(None, 3, "train.global_batch_size=36", "train.max_micro_batch_size=5")[2] == 4  # 12 per process
    assert micro(None, 1, "train.global_batch_size=7")[2] == 7
    with pytest.raises(UserError, match=r"'train.micro_batch_size': 32 .* use 16 \(or auto\)"):
        micro(None, 2, "train.global_batch_size=32", "train.micro_batch_size=32")
    with pytest.raises(UserError, match=r"'train.micro_batch_size': 5 .* use 4 \(or auto\)"):
        micro(None, 1, "train.global_batch_size=32", "train.micro_batch_size=5")
    with pytest.raises(UserError, match=r"'train.global_batch_size': 32 does not split over 3 processes; .* 33 or 30"):
        micro(None, 3, "train.global_batch_size=32")
    for bad in ("0", "-8", "big", "1.5"):
        with pytest.raises(UserError, match="train.micro_batch_size"):
            load_config(TrainConfig, None, [f"train.micro_batch_size={bad}"])


def test_a_launcher_whose_processes_do_not_form_one_group_is_refused(monkeypatch):
    from theworld.core.errors import UserError
    from theworld.core.process_group import check_group

    monkeypatch.setenv("WORLD_SIZE", "2")
    check_group(2)
    with pytest.raises(UserError, match="started 2 processes"):
        check_group(1)  # what accelerate gives N CPU processes it was not told to group


@pytest.mark.slow
def test_torchrun_with_two_processes_trains_on_two(cache, tmp_path):
    import torch

    assert train_inproc(base_args(cache, tmp_path / "one", steps=3)) == 0
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "train.loop",
            *base_args(cache, tmp_path / "two", steps=3),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es) x 1 micro-batches of 8" in two.stderr
    w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in [k for k in w1 if not k.endswith("k_proj.bias")]:  # see test_one_vs_two_processes_vs_accumulation
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_shuffled_world_eval_is_the_same_on_one_and_two_processes(cache, tmp_path):
    args = lambda out: base_args(
        cache, out, steps=1, **{"train.eval.every": 1, "train.eval.samples": 14, "train.eval.batch_size": 4}
    )
    assert train_inproc(args(tmp_path / "one")) == 0
    two = run2(args(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    e1 = [m for m in metrics(tmp_path / "one") if "eval_loss" in m]
    e2 = [m for m in metrics(tmp_path / "two") if "eval_loss" in m]
    assert [m["step"] for m in e1] == [m["step"] for m in e2] == [0, 1]
    for a, b in zip(e1, e2):  # 14 samples: 7 per process, batches of 4 and 3 vs 4, 4, 4, 2 on one
        assert a["eval_tokens"] == b["eval_tokens"]
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
        assert b["eval_loss_shuffled_world"] == pytest.approx(a["eval_loss_shuffled_world"], rel=1e-5)
        assert a["eval_loss_shuffled_world"] != pytest.approx(a["eval_loss"], rel=1e-4)  # worlds really swapped


# ----------------------------------------------------------------------------------------------------------------------
# What a user sees


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


def test_eval_results_are_printed_as_they_happen(cache, tmp_path, capsys):
    assert train_inproc(base_args(cache, tmp_path / "run", steps=2, **{"train.eval.every": 1})) == 0
    err = capsys.readouterr().err
    evals = [m for m in metrics(tmp_path / "run") if "eval_loss" in m]
    for m in evals:
        assert (
            f"eval at step {m['step']}: eval_loss {m['eval_loss']:.4f}, eval_loss_shuffled_world "
            f"{m['eval_loss_shuffled_world']:.4f}"
        ) in err
    assert [m["step"] for m in evals] == [0, 1, 2]


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


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_a_signal_to_one_of_two_processes_stops_both_after_the_same_step_with_a_checkpoint(cache, tmp_path, capsys):
    out = tmp_path / "run"
    args = base_args(cache, out, steps=40, **{"train.checkpoint.every": 100})
    launcher = launch2(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(out, launcher, 2)
        ranks = [p for c in _children(launcher.pid) for p in _children(c) or [c]]
        ranks = [p for p in ranks if "train.loop" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(ranks) == 2, ranks
        os.kill(max(ranks), signal.SIGTERM)  # one rank only: the other learns it from the all-reduce
        _, err = launcher.communicate(timeout=240)  # no hang
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0 and "stopped by SIGTERM after step" in err, err[-3000:]
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and not (out / "final").exists()
    assert (
        train_inproc(
            base_args(cache, out, steps=int(ckpts[0].name.split("-")[1]) + 1, **{"train.checkpoint.every": 100})
        )
        == 0
    )
    assert "resumed from" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# Round 3: trained folders are checked before use; hand-edited state; metrics.jsonl abuse; resolve-dependent resume


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
            _one_line(capsys, *words)
        _reseal(final)
    assert not (tmp_path / "next" / "final").exists()


def test_a_hand_edited_state_json_is_refused_naming_it(cache, tmp_path, capsys):
    out = tmp_path / "run"
    args = lambda steps: base_args(cache, out, steps=steps, **{"train.checkpoint.every": 2})  # noqa: E731
    assert train_inproc(args(4)) == 0
    ckpt = out / "checkpoint-4"
    original = (ckpt / "state.json").read_text()
    state = json.loads(original)
    assert state["state_sha256"]
    capsys.readouterr()
    edits = [
        ({"step": -5}, "changed after it was written"),
        ({"step": 3}, "changed after it was written"),
        ({"data_cursor": {"epoch": 0, "batch_in_epoch": 0}}, "changed after it was written"),
    ]
    # one who also drops the digest (as a checkpoint written before it existed has none): the step must be the folder's
    edits += [({"step": 3, "state_sha256": None}, "not the folder's 4"), ({"step": -5, "state_sha256": None}, "-5")]
    for edit, words in edits:
        edited = {k: v for k, v in {**state, **edit}.items() if v is not None}
        (ckpt / "state.json").write_text(json.dumps(edited))
        assert train_inproc(args(6)) == 2, edit
        _one_line(capsys, str(ckpt / "state.json"), words)
    (ckpt / "state.json").write_text(original)
    assert train_inproc(args(6)) == 0
    assert "resumed from" in capsys.readouterr().err


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
    _one_line(capsys, "metrics.jsonl", "is a directory")
    assert sorted(p.name for p in other.iterdir()) == ["metrics.jsonl"]


def test_resuming_under_another_resolved_micro_batch_or_sharding_does_not_warn_of_another_config(
    cache, tmp_path, capsys
):
    out = tmp_path / "run"
    common = {"train.checkpoint.every": 2, "train.micro_batch_size": "auto"}
    assert train_inproc(base_args(cache, out, steps=2, **common, **{"train.max_micro_batch_size": 4})) == 0
    capsys.readouterr()
    # auto now resolves to 8 (as it does when a 2-process run resumes on 1), and the launcher asks for no FSDP
    assert train_inproc(base_args(cache, out, steps=2, **common, **{"train.max_micro_batch_size": 8})) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "different config" not in err
    assert train_inproc(base_args(cache, out, steps=2, **common, **{"train.optimizer.lr": "2e-2"})) == 0
    assert "written under a different config" in capsys.readouterr().err  # a change of the numbers still warns


def _slow_eval_with_signal(monkeypatch, at_step: int, sig=signal.SIGTERM, per_batch: float = 0.5) -> dict:
    """The eval at step `at_step` takes `per_batch` s a batch, and `sig` arrives 0.3 s into it. Returns its batches
    run, when the signal was sent and when the eval gave up (seconds since the epoch)."""
    import threading

    from train import trainer as loop
    from train.eval import heldout

    seen = {}
    real = heldout.evaluate

    def slow(components, loader):
        if loop_state["state"].step != at_step:
            return real(components, loader)

        def batches():
            for b in loader:
                seen["batches"] = seen.get("batches", 0) + 1
                time.sleep(per_batch)
                yield b

        class Slow:
            def __iter__(self):
                return batches()

            def __len__(self):
                return len(loader)

        threading.Timer(0.3, lambda: (seen.setdefault("sent", time.time()), os.kill(os.getpid(), sig))).start()
        try:
            return real(components, Slow())
        finally:
            seen["left"] = time.time()

    loop_state = {}
    real_restore = loop.checkpoint.restore

    def restore(*a, **k):
        loop_state["state"] = real_restore(*a, **k)
        return loop_state["state"]

    monkeypatch.setattr(loop.checkpoint, "restore", restore)
    monkeypatch.setattr(heldout, "evaluate", slow)
    return seen


def test_a_stop_during_a_long_eval_cuts_it_and_saves_at_once(cache, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    extra = {"train.eval.every": 2, "train.checkpoint.every": 100, "train.eval.samples": 32, "train.eval.batch_size": 2}
    seen = _slow_eval_with_signal(monkeypatch, at_step=2)  # 16 batches: 8 s of eval
    assert train_inproc(base_args(cache, out, steps=6, **extra)) == 143
    err = capsys.readouterr().err
    assert seen["left"] - seen["sent"] < 2 and seen["batches"] < 6, seen
    assert "SIGTERM during the eval at step 2: eval cut short and not logged" in err and "Traceback" not in err
    assert "stopped by SIGTERM after step 2" in err
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"] and not (out / "final").exists()
    assert not [m for m in metrics(out) if "eval_loss" in m and m["step"] == 2]
    # a stop in the eval before the first step: nothing to save, nothing lost
    seen = _slow_eval_with_signal(monkeypatch, at_step=0, sig=signal.SIGINT)
    assert train_inproc(base_args(cache, tmp_path / "fresh", steps=6, **extra)) == 130
    assert "stopped by SIGINT before the first step: nothing to save" in capsys.readouterr().err
    assert not list((tmp_path / "fresh").glob("checkpoint-*"))


def test_the_last_eval_comes_after_the_checkpoint_and_final_so_neither_a_stop_nor_a_failure_loses_them(
    cache, tmp_path, capsys, monkeypatch
):
    from theworld.core.errors import UserError
    from train.eval import heldout

    real = heldout.evaluate  # before _slow_eval_with_signal wraps it

    out = tmp_path / "run"
    extra = {"train.checkpoint.every": 100, "train.eval.samples": 32, "train.eval.batch_size": 2}
    _slow_eval_with_signal(monkeypatch, at_step=4)
    assert train_inproc(base_args(cache, out, steps=4, **extra)) == 143
    assert "eval at step 4: eval cut short" in capsys.readouterr().err
    assert (out / "checkpoint-4").is_dir() and (out / "final" / "trainable.safetensors").is_file()
    weights = _final(out)
    assert "final eval loss n/a" in (out / "final" / "README.md").read_text()
    # the last eval fails (a benchmark that cannot be scored): one line, exit 2, both saves kept
    ref = tmp_path / "ref"
    monkeypatch.setattr(heldout, "evaluate", lambda *a: (_ for _ in ()).throw(UserError("no memory for item 7")))
    assert train_inproc(base_args(cache, ref, steps=4, **extra)) == 2
    _one_line(
        capsys, "the eval after the last step failed", "no memory for item 7", "checkpoint-4 and final/ are saved"
    )
    assert (ref / "checkpoint-4").is_dir() and _final(ref) == weights
    # the rerun repeats only the eval, and the checkpoint and the card record it
    monkeypatch.setattr(heldout, "evaluate", real)
    assert train_inproc(base_args(cache, out, steps=4, **extra)) == 0
    assert _final(out) == weights
    last = [m for m in metrics(out) if "eval_loss" in m]
    assert [m["step"] for m in last] == [4]
    assert json.loads((out / "checkpoint-4" / "state.json").read_text())["last_eval"]["step"] == 4
    assert f"final eval loss {last[0]['eval_loss']:.4f}" in (out / "final" / "README.md").read_text()
    from theworld.model.stage_layout import verify

    verify(out / "final"), verify(out / "checkpoint-4")  # the records follow the rewritten files
    capsys.readouterr()
    assert train_inproc(base_args(cache, out, steps=4, **extra)) == 0  # resumable as it is: the seal holds
    assert [m["step"] for m in metrics(out) if "eval_loss" in m] == [4]


@pytest.mark.slow
def test_sigterm_to_a_two_process_launch_during_a_long_last_eval_ends_well_within_the_grace_period(cache, tmp_path):
    from theworld.infer import benchmark_items

    data = tmp_path / "bench" / "big.jsonl"
    data.parent.mkdir()
    benchmark_items.make_synthetic(data, 2000, seed=1)  # minutes of scoring on this CPU
    out = tmp_path / "run"
    args = base_args(cache, out, steps=2, **{"train.checkpoint.every": 100, "train.eval.benchmarks": f"[{data}]"})
    launcher = launch2(args, via="train.launch", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (out / "final" / "sha256.json").is_file() and launcher.poll() is None and time.time() < deadline:
            time.sleep(0.1)  # final/ is written before the last eval starts
        assert (out / "final" / "sha256.json").is_file(), launcher.poll()
        time.sleep(2)  # into the benchmark
        t0 = time.time()
        launcher.send_signal(signal.SIGTERM)  # torch elastic forwards it, and SIGKILLs what is left 30 s later
        _, err = launcher.communicate(timeout=120)
        took = time.time() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert took < 20, (took, err[-3000:])
    assert launcher.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert err.rstrip().endswith("launch: the launcher stopped by SIGTERM; rerun the same command to resume")
    assert "SIGTERM during the eval at step 2: eval cut short" in err, err[-3000:]
    assert (out / "checkpoint-2").is_dir() and (out / "final" / "trainable.safetensors").is_file()
    assert not [m for m in metrics(out) if "bench/big/accuracy" in m]
