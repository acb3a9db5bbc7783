"""Round-4 hostile cases (issue 34), one test per class of failure: outputs that would overwrite inputs, size-like
keys that would hang or exhaust memory, integrity records that go missing silently, tracebacks and misleading
messages. Each case ends in one line naming its cause, and nothing is lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENV, base_args, train_inproc
from theworld.core.errors import UserError


def _one_line(capsys, *words: str) -> str:
    text = capsys.readouterr().err
    err = [ln for ln in text.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and all(w in err[0] for w in words), text[-3000:]
    assert "Traceback" not in text
    return err[0]


@pytest.fixture
def run(run_copy) -> Path:
    """A copy of the trained run's folder this test may damage (the session's run stays as it was)."""
    return run_copy


def _evaluate(*argv: str) -> int:
    from theworld.evaluate import main

    return main([str(a) for a in argv])


# ---------------------------------------------------------------------------------------------------- lost data


def test_out_is_never_an_input_by_name_symlink_or_hardlink(run, trained_run, tmp_path, capsys):
    shutil.copytree(trained_run["mc"].parent, tmp_path, dirs_exist_ok=True)
    data = tmp_path / trained_run["mc"].name
    before = data.read_bytes()
    weights = run / "final" / "trainable.safetensors"
    (tmp_path / "link.jsonl").symlink_to(data)
    os.link(data, tmp_path / "hard.jsonl")
    os.link(weights, tmp_path / "weights-hard")
    for out, words in (
        (data, ["--data"]),
        (tmp_path / "link.jsonl", ["--data"]),
        (tmp_path / "hard.jsonl", ["--data"]),
        (weights, ["the model folder"]),
        (tmp_path / "weights-hard", ["the model folder"]),
        (run / "final" / "config.yaml", ["the model folder"]),
    ):
        assert _evaluate("--model", run, "--data", data, "--out", out) == 2
        _one_line(capsys, f"--out {out}", *words, "another path")
    assert data.read_bytes() == before
    from theworld.model.stage_layout import verify

    verify(run / "final")  # every file of the model as it was recorded

    from theworld import export

    assert export.main(["--model", str(run), "--merge", "--out", str(run / "final")]) == 2
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-final").symlink_to(run / "final")
    assert export.main(["--model", str(run), "--merge", "--out", str(tmp_path / "to-final")]) == 2
    _one_line(capsys, "symlink")
    verify(run / "final")


def test_out_is_written_whole_and_a_killed_runs_partial_file_is_removed(run, trained_run, tmp_path, capsys):
    out = tmp_path / "preds.jsonl"
    out.write_text("an earlier evaluation\n")
    stale = tmp_path / ".tmp-preds.jsonl-999999999"  # a pid that runs no process: a killed evaluation's
    stale.write_text('{"item": "half"')
    assert _evaluate("--model", run, "--data", trained_run["mc"], "--limit", "2", "--out", out) == 0
    err = capsys.readouterr().err
    assert f"removed {stale}" in err and not stale.exists()
    text = out.read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    assert len(lines) == 2 and {"item", "pred", "answer"} <= lines[0].keys()
    assert _evaluate("--model", run, "--data", trained_run["mc"], "--ema", "--out", out) == 2  # fails once it opened
    _one_line(capsys, "ema.safetensors")
    assert out.read_text() == text  # a failed evaluation leaves --out as it was
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_card_rows_are_keyed_by_the_sets_content_split_and_limit(run, trained_run, tmp_path, capsys):
    from theworld.infer import benchmark_items

    other = tmp_path / "other" / "items.jsonl"  # another set with the same file name
    benchmark_items.make_synthetic(other, 4, seed=7)
    card = run / "final" / "README.md"
    assert _evaluate("--model", run, "--data", trained_run["mc"]) == 0
    assert _evaluate("--model", run, "--data", other) == 0
    assert _evaluate("--model", run, "--data", trained_run["mc"], "--limit", "3") == 0
    capsys.readouterr()

    def rows() -> list[list[str]]:
        table = card.read_text().split("## Evaluation results")[1]
        return [[c.strip() for c in r.strip("|").split("|")] for r in table.splitlines() if r.startswith("| items")]

    got = rows()
    assert len(got) == 3, got
    assert {r[1] for r in got} == {
        __import__("theworld.infer.card", fromlist=["x"]).fingerprint(p) for p in (trained_run["mc"], other)
    }
    assert sorted(r[3] for r in got) == ["all", "all", "first 3"]
    assert sorted(r[6] for r in got) == ["3", "4", "6"]
    full = next(r for r in got if r[6] == "6")
    assert _evaluate("--model", run, "--data", trained_run["mc"]) == 0  # the same set again: its own row only
    capsys.readouterr()
    again = rows()
    assert len(again) == 3 and sorted(r[6] for r in again) == ["3", "4", "6"]
    assert next(r for r in again if r[6] == "6")[1] == full[1]


def test_a_card_written_before_the_keys_keeps_its_rows(tmp_path):
    from theworld.infer import card

    path = tmp_path / "README.md"
    path.write_text(
        "# A card\n\n## Evaluation results\n\n| benchmark | task | protocol | n | model | shuffled world | baselines | "
        "command |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n| items.jsonl | mc | loglik | 6 | 0.5 | 0.4 | - "
        "| `x` |\n"
    )
    data = tmp_path / "items.jsonl"
    data.write_text("{}\n")
    summary = {"n": 6, "accuracy": 0.75, "accuracy_shuffled_world": 0.5, "protocol": "loglik"}
    card.update(path, card.row(summary, str(data), "mc", ["--data", str(data)]))
    text = path.read_text()
    assert text.startswith("# A card") and "| 0.5 | 0.4 |" in text and "0.7500" in text
    assert text.count("| items.jsonl |") == 2


# ------------------------------------------------------------------------------------------ size-like keys


def _cfg(*sets: str):
    from theworld.core.config import load_config
    from train.config import TrainConfig

    return load_config(TrainConfig, None, list(sets))


def test_every_size_like_key_has_a_bound_checked_before_any_model_loads(tmp_path, capsys):
    from precompute.config import PrecomputeConfig
    from theworld.core.config import SIZE_LIMITS, load_config
    from train.config import TrainConfig

    extra = {"lora.r": ["lora.parts=[language]"]}
    for key, (limit, _) in SIZE_LIMITS.items():
        cls = TrainConfig if key.split(".")[0] in ("lora", "train", "profile") else PrecomputeConfig
        sets = extra.get(key, []) + [f"{key}={limit + 1}"]
        with pytest.raises(UserError, match=rf"'{key}': {limit + 1} is too large \(at most"):
            load_config(cls, None, sets)
        load_config(cls, None, extra.get(key, []) + [f"{key}={limit}"])  # the bound itself is allowed
    # the CLI: one line, exit 2, before the cache or any model is looked at
    for key in ("lora.r", "train.eval.caption_tokens", "train.eval.captions"):
        args = base_args(tmp_path / "no-cache", tmp_path / "out", **{key: 100_000_000})
        assert train_inproc(args) == 2
        _one_line(capsys, key, "too large")
        assert not (tmp_path / "out").exists()


def test_mixture_weights_far_apart_and_a_cache_listed_twice_are_refused(tmp_path, trained_run, capsys):
    cache = trained_run["cache"]
    (tmp_path / "alias").symlink_to(cache)
    for data, words in (
        (f"[{{cache: {cache}, weight: 1.0e-30}}, {{cache: {tmp_path / 'c2'}, weight: 1}}]", ["times apart"]),
        (f"[{{cache: {cache}, weight: 3.0e38}}, {{cache: {tmp_path / 'c2'}, weight: 1}}]", ["times apart"]),
        (f"[{{cache: {cache}}}, {{cache: {tmp_path / 'alias'}}}]", ["listed twice", "the same folder"]),
        (f"[{{cache: {cache}}}, {{cache: {cache}/.}}]", ["listed twice"]),
    ):
        with pytest.raises(UserError, match="config key 'data'") as e:
            _cfg(f"data={data}")
        assert all(w in str(e.value) for w in words), str(e.value)


def _without(args: list[str], key: str) -> list[str]:
    """base_args' --set pairs but the one of `key`."""
    pairs = [(f, v) for f, v in zip(args[::2], args[1::2]) if not v.startswith(key + "=")]
    return [x for pair in pairs for x in pair]


def test_a_weight_that_rounds_a_caches_quota_to_zero_is_one_line(trained_run, tmp_path, capsys):
    other = tmp_path / "copy"
    shutil.copytree(trained_run["cache"], other)
    data = f"[{{cache: {trained_run['cache']}, weight: 1}}, {{cache: {other}, weight: 1000}}]"
    args = _without(base_args(trained_run["cache"], tmp_path / "out", steps=1), "cache_dir")
    assert train_inproc(args + ["--set", f"data={data}"]) == 2
    _one_line(capsys, "config key 'data'", str(trained_run["cache"]), "none of the", "weight of at least")


def test_profile_window_and_report_arguments_are_checked(tmp_path, trained_run, capsys):
    for sets, words in (
        (["profile.steps=-1"], ["profile.steps", ">= 1"]),
        (["profile.start_step=-2"], ["profile.start_step", ">= 0"]),
        (["profile.top=0"], ["profile.top"]),
    ):
        with pytest.raises(UserError) as e:
            _cfg(*sets)
        assert all(w in str(e.value) for w in words)
    args = base_args(trained_run["cache"], tmp_path / "out", steps=3)
    assert train_inproc(args + ["--set", "profile.enabled=true", "--set", "profile.start_step=10"]) == 2
    _one_line(capsys, "profile.start_step", "3 steps", "<= 0")
    assert not (tmp_path / "out" / "final").exists()

    from tools import profile_report

    assert profile_report.main([str(tmp_path), "--top", "-3"]) == 2
    _one_line(capsys, "--top must be >= 1")
    (tmp_path / "profile").mkdir()
    os.mkfifo(tmp_path / "profile" / "trace-rank0.json")
    assert profile_report.main([str(tmp_path)]) == 2
    _one_line(capsys, "trace-rank0.json is a FIFO")


# --------------------------------------------------------------------------------------- arguments ignored


def test_arguments_that_would_be_ignored_are_refused(trained_run, tmp_path, capsys):
    mc = trained_run["mc"]
    for argv, words in (
        (["--split", "test"], ["--split test", "JSONL", "leave --split out"]),
        (["--split", "val"], ["--split val"]),
        (["--task", "caption", "--protocol", "generate"], ["--protocol", "--task mc"]),
        (["--task", "caption", "--baselines", "no_world"], ["--baselines", "--task mc"]),
        (["--baselines", "all,no_world"], ["all already names every baseline"]),
    ):
        assert _evaluate("--model", trained_run["run"], "--data", mc, *argv) == 2
        line = _one_line(capsys, *words)
        assert "unknown" not in line


# ------------------------------------------------------------------------------------------ integrity records


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
def test_a_final_folder_written_with_records_must_have_them(run, trained_run, how, capsys):
    from theworld import export
    from theworld.model.world import TheWorld

    final = run / "final"
    _damage_record(final, how)
    with pytest.raises(UserError, match="sha256"):
        TheWorld.from_pretrained(final)
    assert _evaluate("--model", run, "--data", trained_run["mc"]) == 2
    _one_line(capsys, "sha256.json")
    assert export.main(["--model", str(run), "--merge", "--out", str(run.parent / "exported")]) == 2
    _one_line(capsys, "sha256.json")
    assert not (run.parent / "exported").exists()


def test_an_older_folder_without_records_loads_with_a_note(run, capsys):
    from safetensors.torch import load_file, save_file

    from theworld.model.world import TheWorld

    final = run / "final"
    weights = final / "trainable.safetensors"
    save_file(load_file(str(weights)), str(weights))  # as written before: no header saying records exist
    (final / "sha256.json").unlink()
    TheWorld.from_pretrained(final)
    err = capsys.readouterr().err
    assert err.count("no sha256 records") == 1 and "unverified" in err


def test_a_checkpoint_without_its_seals_or_with_a_fifo_state_is_refused_by_name(run, trained_run, capsys):
    ckpt = run / "checkpoint-4"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["format_version"] == 2
    args = base_args(trained_run["cache"], run, steps=6) + ["--set", "train.global_batch_size=8"]
    args += ["--set", "train.micro_batch_size=8", "--set", "train.eval.samples=8"]
    unsealed = {k: v for k, v in state.items() if k not in ("sha256", "state_sha256")}
    (ckpt / "state.json").write_text(json.dumps(unsealed))
    assert train_inproc(args) == 2
    _one_line(capsys, str(ckpt / "state.json"), "not a sha256 record")

    (ckpt / "state.json").write_text(json.dumps(state))
    newer = run / "checkpoint-6"
    newer.mkdir()
    os.mkfifo(newer / "state.json")
    assert train_inproc(args) == 2
    _one_line(capsys, str(newer / "state.json"), "is a FIFO", "move")


# ------------------------------------------------------------------------------------------ tracebacks


def test_run_lock_and_output_paths_of_the_wrong_kind_are_named(trained_run, tmp_path, capsys):
    for kind in ("fifo", "directory"):
        out = tmp_path / kind
        out.mkdir()
        os.mkfifo(out / ".run.lock") if kind == "fifo" else (out / ".run.lock").mkdir()
        assert train_inproc(base_args(trained_run["cache"], out, steps=1)) == 2
        line = _one_line(capsys, ".run.lock", "run lock", "a FIFO" if kind == "fifo" else "a directory")
        assert "is a file, not a folder" not in line
    out = tmp_path / "wandb-file"
    out.mkdir()
    (out / "wandb").write_text("not a folder")
    args = base_args(trained_run["cache"], out, steps=1) + ["--set", "trackers=[wandb]"]
    pytest.importorskip("wandb")
    assert train_inproc(args) == 2
    _one_line(capsys, str(out / "wandb"), "a regular file", "W&B")


@pytest.mark.parametrize("name", ["a/b", "team:x", "", "p#1"])
def test_wandb_names_are_checked_in_the_config(name):
    for key in ("wandb.project", "wandb.entity"):
        with pytest.raises(UserError, match=f"'{key}'"):
            _cfg(f"{key}={json.dumps(name)}")


def test_another_users_weights_are_one_line(trained_run, tmp_path):
    """trainable.safetensors mode 0600 of another user: one line naming it. Root reads any file, so as root the
    command runs without its capabilities (setpriv), which leaves uid 0 the file's 'other'."""
    final = tmp_path / "final"
    shutil.copytree(trained_run["run"] / "final", final)
    weights = final / "trainable.safetensors"
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: every file is readable")
        os.chown(weights, 65534, 65534)
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]
    os.chmod(weights, 0o600 if prefix else 0)
    code = "import sys; from theworld.export import main; sys.exit(main(['--merge', '--model', *sys.argv[1:]]))"
    r = subprocess.run(
        [*prefix, sys.executable, "-c", code, str(final), "--out", str(tmp_path / "x")],
        env=ENV,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "trainable.safetensors" in errors[0] and "Permission denied" in errors[0], errors
    assert not (tmp_path / "x").exists()


def test_a_model_card_that_is_a_folder_is_one_line(run, trained_run, capsys):
    (run / "final" / "README.md").unlink()
    (run / "final" / "README.md").mkdir()
    assert _evaluate("--model", run, "--data", trained_run["mc"], "--limit", "1") == 2
    _one_line(capsys, "README.md", "a directory")


def test_an_export_removes_the_folder_a_killed_export_left(run, tmp_path, capsys):
    from theworld import export
    from theworld.model.stage_layout import verify

    stale = tmp_path / ".tmp-x-999999999"  # kill -9 of the export with pid 999999999 (no such process runs)
    (stale / "sub").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"0" * 1000)
    assert export.main(["--model", str(run), "--merge", "--out", str(tmp_path / "x")]) == 0
    assert f"removed {stale}" in capsys.readouterr().err and not stale.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    verify(tmp_path / "x")  # the export records its files' sha256 too
    (tmp_path / "x" / "sha256.json").unlink()
    assert export.main(["--model", str(tmp_path / "x"), "--merge", "--out", str(tmp_path / "y")]) == 2
    _one_line(capsys, "sha256.json")


def test_evaluate_out_on_a_full_device_says_the_disk_is_full(run, trained_run, capsys):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    assert _evaluate("--model", run, "--data", trained_run["mc"], "--limit", "1", "--out", "/dev/full") == 2
    line = _one_line(capsys, "/dev/full", "no space left on device")
    assert "last complete save" not in line


# ------------------------------------------------------------------------------------------ lmms-eval


@pytest.mark.parametrize(
    "args, words",
    [
        ({"pretrained": "/no/such/run"}, ["/no/such/run"]),
        ({"pretrained": "RUN", "temperature": "0"}, ["unknown model_args temperature"]),
        ({}, ["pretrained=RUN"]),
    ],
)
def test_lmms_adapter_refuses_in_one_line_with_a_nonzero_exit(trained_run, args, words, capsys):
    pytest.importorskip("lmms_eval")
    from theworld.lmms_adapter import TheWorldLMM

    args = {k: str(trained_run["run"]) if v == "RUN" else v for k, v in args.items()}
    with pytest.raises(SystemExit) as e:
        TheWorldLMM(**args)
    assert e.value.code == 2
    _one_line(capsys, "error: theworld:", *words)


# ------------------------------------------------------------------------------------------ misleading


@pytest.mark.slow
def test_a_finished_epochs_run_rerun_with_fewer_epochs_is_told_it_is_past_that(trained_run, tmp_path, capsys):
    out = tmp_path / "epochs"
    args = base_args(trained_run["cache"], out, steps=1000) + ["--set", "train.global_batch_size=8"]
    args += ["--set", "train.micro_batch_size=8", "--set", "train.eval.samples=8", "--set", "train.eval.captions=0"]
    assert train_inproc(args + ["--set", "train.epochs=1"]) == 0
    capsys.readouterr()
    assert train_inproc(args + ["--set", "train.epochs=0.5"]) == 2
    line = _one_line(capsys, "train.epochs", "past that point")
    assert "raise train.max_steps" not in line
