"""train/state/checkpoint.py: the checkpointer (each part of the run state saved to its file, the folder sealed and
renamed
into place, loaded back part by part), where a run resumes from, the clean-up after a killed save, format-2
checkpoints written by hand resuming bitwise, and weights-only checkpoints (train.checkpoint.save_optimizer: false)."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import (
    ROOT,
    base_args,
    final_bytes,
    metrics,
    metrics_lines,
    one_error_line,
    train_inproc,
    weights,
)
from theworld.cache_format import sha256_file
from theworld.core.errors import UserError

# ----------------------------------------------------------------------------------------------------------------------
# The checkpointer on its own: parts that say how they save and load themselves


@dataclass
class Part:
    """A stand-in part of a run's state: what it gives on save, what it was given on load."""

    file: str
    given: dict
    loaded: dict | None = None

    def state_dict(self) -> dict:
        return self.given

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def _parts() -> list[Part]:
    return [
        Part("trainable.safetensors", {"w": torch.arange(6.0).reshape(2, 3)}),
        Part("optimizer.pt", {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}),
        Part("state.json", {"step": 7, "samples_seen": 70}),
        Part("state.json", {"epoch": 1, "format_version": 2}),
    ]


def test_the_checkpointer_writes_each_part_in_its_format_seals_the_folder_and_loads_each_part_back(tmp_path):
    from theworld.model.stage_layout import state_digest, verify
    from train.state import checkpoint

    parts = _parts()
    folder = checkpoint.save(tmp_path, "checkpoint-7", parts, [p.state_dict() for p in parts], keep_last=2)
    assert folder == tmp_path / "checkpoint-7" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-7"]
    assert torch.equal(load_file(str(folder / "trainable.safetensors"))["w"], parts[0].given["w"])
    assert torch.load(folder / "optimizer.pt", weights_only=True)["param_groups"] == [{"lr": 0.1, "params": [0]}]
    state = json.loads((folder / "state.json").read_text())
    # the records of state.json merged in the parts' order, then the seal
    assert list(state) == ["step", "samples_seen", "epoch", "format_version", "time", "sha256", "state_sha256"]
    assert state["sha256"] == {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.iterdir() if f.name != "state.json"
    }
    assert state["state_sha256"] == state_digest(state)
    verify(folder)
    fresh = _parts()
    assert checkpoint.load(folder, fresh)["step"] == 7
    assert torch.equal(fresh[0].loaded["w"], parts[0].given["w"])
    assert torch.equal(fresh[1].loaded["state"][0]["step"], torch.tensor(3.0))
    assert fresh[2].loaded is fresh[3].loaded and fresh[2].loaded["epoch"] == 1  # every record sees state.json


def test_keep_last_deletes_the_oldest_only_after_the_new_checkpoint_is_in_place(tmp_path):
    from train.state import checkpoint

    parts = _parts()
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, f"checkpoint-{step}", parts, [p.state_dict() for p in parts], keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]


def test_a_part_saved_only_is_not_loaded_and_a_missing_file_is_one_line_naming_it(tmp_path):
    from train.state import checkpoint
    from train.state.states import RunConfig

    parts = _parts()
    folder = checkpoint.save(tmp_path, "checkpoint-7", parts, [p.state_dict() for p in parts], keep_last=2)
    (folder / "optimizer.pt").unlink()
    # config.yaml is written by the run, never read back on resume (checkpoints of format 1 lack it)
    checkpoint.load(folder, [p for p in _parts() if p.file != "optimizer.pt"] + [RunConfig(cfg=None)])
    with pytest.raises(UserError, match=r"resume: .*checkpoint-7 has no optimizer.pt"):
        checkpoint.load(folder, _parts())


def test_a_damaged_part_is_one_line_naming_its_file_and_what_to_do(tmp_path):
    from train.state import checkpoint

    parts = _parts()
    folder = checkpoint.save(tmp_path, "checkpoint-7", parts, [p.state_dict() for p in parts], keep_last=2)
    (folder / "optimizer.pt").write_bytes(b"torn")
    with pytest.raises(UserError, match=r"cannot read .*optimizer.pt .*resume: auto takes the one before it"):
        checkpoint.load(folder, _parts())
    save_file({"w": torch.tensor([1.0, math.nan])}, str(folder / "trainable.safetensors"))
    with pytest.raises(UserError, match=r"trainable.safetensors: tensor w holds 1 non-finite"):
        checkpoint.load(folder, _parts())


def test_every_loop_state_field_belongs_to_exactly_one_record():
    from dataclasses import fields

    from train.state.states import PLATEAU, PROGRESS, SCHEDULE, TRACKERS
    from train.step import LoopState

    names = SCHEDULE + PROGRESS + PLATEAU + TRACKERS
    assert sorted(names) == sorted(f.name for f in fields(LoopState)) and len(set(names)) == len(names)


# ----------------------------------------------------------------------------------------------------------------------
# Format 2 written by hand resumes bitwise; the checkpoints written now keep that format


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _format_2_by_hand(ref: Path, dst: Path) -> dict:
    """checkpoint-2 of the reference run in format 2 as docs/training.md and theworld/model/stage_layout.py describe it,
    written here with safetensors, torch and json alone (not train.checkpoint), from the tensors of the reference
    run's checkpoint-2 and the figures of its metrics.jsonl. Returns its state.json."""
    src = ref / "checkpoint-2"
    dst.mkdir(parents=True)
    save_file(
        load_file(str(src / "trainable.safetensors")),
        str(dst / "trainable.safetensors"),
        metadata={"theworld.sha256_records": "1"},
    )
    torch.save(torch.load(src / "optimizer.pt", weights_only=True), dst / "optimizer.pt")
    save_file({"torch_cpu": load_file(str(src / "rng.safetensors"))["torch_cpu"]}, str(dst / "rng.safetensors"))
    save_file(load_file(str(src / "ema.safetensors")), str(dst / "ema.safetensors"))
    shutil.copy(src / "config.yaml", dst / "config.yaml")
    written = json.loads((src / "state.json").read_text())
    losses = [m["loss"] for m in metrics(ref) if "loss" in m]
    state = {
        "step": 2,
        "samples_seen": 2 * 16,
        "tokens_seen": written["tokens_seen"],
        "nonfinite_steps": 0,
        "nonfinite_in_a_row": 0,
        "first_loss": losses[0],
        "last_loss": losses[1],
        "last_eval": None,
        "parent": None,
        "history": [],
        "eval_history": [],
        "plateau_step": None,
        "wandb_run_id": None,
        "epoch": 0,
        "data_cursor": {"epoch": 0, "batch_in_epoch": 2},  # 80 train samples: 5 steps per epoch
        "cache": written["cache"],
        "config_hash": written["config_hash"],
        "num_processes": 1,
        "format_version": 2,
        "time": 0.0,
        "sha256": {f.name: _sha256(f) for f in sorted(dst.iterdir())},
    }
    state["state_sha256"] = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()
    (dst / "state.json").write_text(json.dumps(state, indent=1))
    return state


@pytest.mark.slow
def test_a_format_2_checkpoint_written_by_hand_resumes_bitwise(cache, tmp_path, capsys):
    extra = {"train.checkpoint.every": 2, "train.optimizer.ema": 0.9, "world.latent": "sample"}
    ref, out = tmp_path / "ref", tmp_path / "old"
    assert train_inproc(base_args(cache, ref, steps=4, **extra)) == 0
    state = _format_2_by_hand(ref, out / "checkpoint-2")
    # the stateful checkpointer writes format 2 as it was: the same files, state.json's keys in the same order
    written = json.loads((ref / "checkpoint-2" / "state.json").read_text())
    assert list(written) == list(state) and written["format_version"] == 2
    assert sorted(p.name for p in (ref / "checkpoint-2").iterdir()) == sorted(
        p.name for p in (out / "checkpoint-2").iterdir()
    )
    capsys.readouterr()
    assert train_inproc(base_args(cache, out, steps=4, **extra)) == 0
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in capsys.readouterr().err
    a, b = weights(ref), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ea, eb = (load_file(str(r / "final" / "ema.safetensors")) for r in (ref, out))
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    later = lambda run: [m["loss"] for m in metrics(run) if "loss" in m and m["step"] > 2]
    assert later(out) == later(ref) and len(later(ref)) == 2


# ----------------------------------------------------------------------------------------------------------------------
# One 4-step run saving every 2 steps, trained once for the tests below that read it or continue a copy of it


EVERY_2 = {"train.checkpoint.every": 2, "train.eval.captions": 0}  # no caption is asserted on: none sampled


def every_2_args(cache: Path, out: Path, steps: int = 4, **extra) -> list[str]:
    return base_args(cache, out, steps=steps, **EVERY_2, **extra)


@pytest.fixture(scope="module")
def every_2_run(cache, tmp_path_factory) -> Path:
    """checkpoint-2, checkpoint-4 (with its optimizer) and final/ of `every_2_args`; tests only read it."""
    out = tmp_path_factory.mktemp("every2") / "run"
    assert train_inproc(every_2_args(cache, out)) == 0
    files = {p: p.stat().st_mtime_ns for p in sorted(out.rglob("*"))}
    yield out
    assert {p: p.stat().st_mtime_ns for p in sorted(out.rglob("*"))} == files, "a test changed it"


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Weights-only checkpoints (train.checkpoint.save_optimizer: false)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


@pytest.mark.slow
def test_weights_only_checkpoints_hold_no_optimizer_and_resume_with_a_fresh_one_said_in_one_line(
    cache, every_2_run, tmp_path, capsys
):
    from theworld.model.stage_layout import verify

    full, lean = every_2_run, tmp_path / "lean"  # full: keep_last 2 and save_optimizer true, the defaults
    args = lambda out, save: every_2_args(
        cache, out, **{"train.checkpoint.keep_last": 2, "train.checkpoint.save_optimizer": save}
    )
    assert train_inproc(args(lean, "false")) == 0
    for step in (2, 4):
        ckpt = lean / f"checkpoint-{step}"
        assert not (ckpt / "optimizer.pt").exists() and (full / f"checkpoint-{step}" / "optimizer.pt").is_file()
        state = json.loads((ckpt / "state.json").read_text())
        assert set(state["sha256"]) == {"trainable.safetensors", "rng.safetensors", "config.yaml"}
        verify(ckpt)
        optimizer = (full / f"checkpoint-{step}" / "optimizer.pt").stat().st_size
        assert _size(ckpt) < _size(full / f"checkpoint-{step}") - optimizer / 2
    a, b = weights(full), weights(lean)  # the key changes no number of an uninterrupted run
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # resumed from checkpoint-2 (the later saves removed), saving the optimizer from here on: a resume-neutral change
    shutil.rmtree(lean / "checkpoint-4")
    shutil.rmtree(lean / "final")
    capsys.readouterr()
    assert train_inproc(args(lean, "true")) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "optimizer starts fresh" in line]
    assert len(notes) == 1 and str(lean / "checkpoint-2") in notes[0], err
    assert "train.checkpoint.save_optimizer: false" in notes[0] and "written under a different config" not in err
    losses = [m["loss"] for m in metrics(lean) if "loss" in m]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert (lean / "checkpoint-4" / "optimizer.pt").is_file()
    b = weights(lean)  # fresh AdamW moments take other steps than the saved ones would have
    assert any(not torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------------------------------
# Where a run resumes from, and the clean-up after a killed save (moved from tests/e2e/test_train.py)


def test_resuming_on_a_cache_that_holds_other_samples_says_so(cache, every_2_run, tmp_path, capsys):
    """A checkpoint records which samples its data order indexes; a rebuilt or extended cache gets a warning on
    resume (the step's indices name other samples now), the same cache none."""
    from precompute.config import load as load_pre
    from precompute.pipeline import run

    other = tmp_path / "cache88"
    run(
        load_pre(
            str(ROOT / "configs" / "precompute.yaml"),
            [
                f"output_dir={other}",
                "source.num_samples=88",
                "shard_size=32",
                "batch_size=32",
                "num_workers=0",
                "cache.flip=true",
                "cache.siglip=false",
            ],
        )
    )
    out = copy_of(every_2_run, tmp_path)
    state = json.loads((out / "checkpoint-2" / "state.json").read_text())
    assert state["cache"]["samples"] == 96 and len(state["cache"]["keys_sha256"]) == 16
    for cache_dir, warned in ((cache, False), (other, True)):
        shutil.rmtree(out / "final")
        shutil.rmtree(out / "checkpoint-4")
        capsys.readouterr()
        assert train_inproc(every_2_args(cache_dir, out)) == 0
        err = capsys.readouterr().err
        assert "resumed from" in err
        assert ("holds other samples than when" in err and "(96 then, 88 now)" in err) == warned, err


@pytest.mark.slow  # five in-process runs
def test_an_output_dir_holding_another_run_is_protected_and_a_killed_save_is_cleaned_up(cache, tmp_path, capsys):
    out = tmp_path / "run"
    args = lambda steps, **kw: base_args(
        cache, out, steps=steps, **{"train.checkpoint.every": 1, "train.checkpoint.keep_last": 5, **kw}
    )
    assert train_inproc(args(2)) == 0
    capsys.readouterr()
    # a fresh start, or an older checkpoint, in this output_dir would interleave two runs' checkpoints
    assert train_inproc(args(2, resume="null")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'resume'" in err[0] and "checkpoint-2" in err[0], err
    assert train_inproc(args(4, resume=out / "checkpoint-1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not the newest checkpoint" in err[0] and "checkpoint-2" in err[0], err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    # any folder holding a checkpoint can be continued into an empty output_dir (a branch)
    branch = tmp_path / "renamed-checkpoint"
    shutil.copytree(out / "checkpoint-1", branch)
    assert train_inproc(base_args(cache, tmp_path / "branch", steps=2, resume=branch)) == 0
    assert "resumed from" in capsys.readouterr().err
    # killed while saving: an unfinished checkpoint and a half-written log line
    (out / ".tmp-checkpoint-3-999").mkdir()
    (out / ".tmp-checkpoint-3-999" / "trainable.safetensors").write_bytes(b"partial")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    assert train_inproc(args(3, **{"train.eval.every": 2})) == 0
    assert "removed" in capsys.readouterr().err
    assert not list(out.glob(".tmp-*")) and (out / "final").is_dir()
    assert [m["step"] for m in metrics(out) if "loss" in m] == [1, 2, 3]
    # rerunning a finished run rewrites no checkpoint and logs no second eval
    written = (out / "checkpoint-3" / "state.json").stat().st_mtime_ns
    evals = [m["step"] for m in metrics(out) if "eval_loss" in m]
    assert evals[-1] == 3
    assert train_inproc(args(3, **{"train.eval.every": 2})) == 0
    assert (out / "checkpoint-3" / "state.json").stat().st_mtime_ns == written
    assert [m["step"] for m in metrics(out) if "eval_loss" in m] == evals


def test_remove_partial_restores_a_folder_moved_aside_and_deletes_unfinished_writes(tmp_path):
    from train.state.checkpoint import remove_partial

    for name in (".old-final-17", ".tmp-final-17", ".tmp-checkpoint-4-18", ".old-checkpoint-2-19", "checkpoint-2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "marker").write_text(name)
    (tmp_path / ".tmp-preds.jsonl-20").write_text("{}")  # another command's partial file: not the run's to remove
    removed = remove_partial(tmp_path)
    # final/ never arrived: the old one goes back; checkpoint-2 did arrive: the old copy goes
    assert (tmp_path / "final" / "marker").read_text() == ".old-final-17"
    assert (tmp_path / "checkpoint-2" / "marker").read_text() == "checkpoint-2"
    assert sorted(p.name for p in removed) == [".old-checkpoint-2-19", ".tmp-checkpoint-4-18", ".tmp-final-17"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-preds.jsonl-20", "checkpoint-2", "final"]


def test_a_run_resumed_from_a_hub_checkpoint_continues_bitwise_with_its_optimizer(
    cache, every_2_run, tmp_path, monkeypatch
):
    """A 4-step run's checkpoint-2, as `hub.history` uploads it (checkpoint-2/ in repo someone/run, read here from a
    Hugging Face cache in huggingface_hub's own layout, offline), resumed into a fresh output_dir with
    `resume: someone/run:checkpoint-2`: the final weights equal the uninterrupted run's bit for bit (AdamW's moments
    and the data cursor come with it)."""
    import huggingface_hub.constants as constants
    import torch

    from tests.conftest import train_inproc, weights
    from tests.theworld.core.test_hub import hf_cache

    ref = every_2_run
    ckpt = ref / "checkpoint-2"
    hf_cache(tmp_path / "hf", "someone/run", {f"checkpoint-2/{p.name}": p for p in ckpt.iterdir()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "from-hub"
    assert train_inproc(every_2_args(cache, out, resume="someone/run:checkpoint-2")) == 0
    got, want = weights(out), weights(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-4"]  # trained on from step 2


def test_a_checkpoint_without_its_seals_or_with_a_fifo_state_is_refused_by_name(run_copy, trained_run, capsys):
    ckpt = run_copy / "checkpoint-4"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["format_version"] == 2
    args = base_args(trained_run["cache"], run_copy, steps=6) + ["--set", "train.global_batch_size=8"]
    args += ["--set", "train.micro_batch_size=8", "--set", "train.eval.samples=8"]
    unsealed = {k: v for k, v in state.items() if k not in ("sha256", "state_sha256")}
    (ckpt / "state.json").write_text(json.dumps(unsealed))
    assert train_inproc(args) == 2
    one_error_line(capsys, str(ckpt / "state.json"), "not a sha256 record")

    (ckpt / "state.json").write_text(json.dumps(state))
    newer = run_copy / "checkpoint-6"
    newer.mkdir()
    os.mkfifo(newer / "state.json")
    assert train_inproc(args) == 2
    one_error_line(capsys, str(newer / "state.json"), "is a FIFO", "move")


@pytest.mark.slow
def test_a_finished_epochs_run_rerun_with_fewer_epochs_is_told_it_is_past_that(trained_run, tmp_path, capsys):
    out = tmp_path / "epochs"
    args = base_args(trained_run["cache"], out, steps=1000) + ["--set", "train.global_batch_size=8"]
    args += ["--set", "train.micro_batch_size=8", "--set", "train.eval.samples=8", "--set", "train.eval.captions=0"]
    assert train_inproc(args + ["--set", "train.epochs=1"]) == 0
    capsys.readouterr()
    assert train_inproc(args + ["--set", "train.epochs=0.5"]) == 2
    line = one_error_line(capsys, "train.epochs", "past that point")
    assert "raise train.max_steps" not in line


def test_checkpoint_files_are_hashed_and_a_damaged_one_is_refused_not_exported(cache, every_2_run, tmp_path, capsys):
    out = copy_of(every_2_run, tmp_path)
    args = lambda steps=4: every_2_args(cache, out, steps=steps)
    exported = final_bytes(out)
    ckpt = out / "checkpoint-4"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["sha256"] == {f.name: sha256_file(f) for f in ckpt.iterdir() if f.name != "state.json"}
    assert set(state["sha256"]) == {"trainable.safetensors", "optimizer.pt", "rng.safetensors", "config.yaml"}
    capsys.readouterr()
    # a finished 4-step run resumed with max_steps 2 would export its step-4 weights as a 2-step run's
    assert train_inproc(args(steps=2)) == 2
    one_error_line(capsys, "'train.max_steps'", "checkpoint-4")
    # one flipped bit in the newest checkpoint's weights: refused before anything is loaded or exported
    weights = ckpt / "trainable.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    assert train_inproc(args()) == 2
    one_error_line(capsys, str(weights), "damaged", "the one before it")
    assert final_bytes(out) == exported
    # the line's advice: move it out, and the run continues from checkpoint-2 to the same weights
    ckpt.rename(tmp_path / "damaged-checkpoint-4")
    assert train_inproc(args()) == 0
    assert "resumed from" in capsys.readouterr().err and final_bytes(out) == exported


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
    one_error_line(capsys, "no space left on device", ".tmp-checkpoint-3", "rerun the same command")
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
    one_error_line(capsys, "no space left on device", "metrics.jsonl")
    monkeypatch.undo()
    assert train_inproc(args(out)) == 0  # space freed
    assert final_bytes(out) == final_bytes(tmp_path / "ref")
    assert [m["loss"] for m in metrics(out) if "loss" in m] == [
        m["loss"] for m in metrics(tmp_path / "ref") if "loss" in m
    ]


def test_a_hand_edited_state_json_is_refused_naming_it(cache, every_2_run, tmp_path, capsys):
    out = copy_of(every_2_run, tmp_path)
    args = lambda steps: every_2_args(cache, out, steps=steps)  # noqa: E731
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
        one_error_line(capsys, str(ckpt / "state.json"), words)
    (ckpt / "state.json").write_text(original)
    assert train_inproc(args(6)) == 0
    assert "resumed from" in capsys.readouterr().err
