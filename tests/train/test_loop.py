"""The train.loop command in process: --print-config and --plan start nothing, a bad key is one line and exit 2,
and a short run logs every step, saves at its checkpoint steps and exports final/."""

from __future__ import annotations

import socket

import pytest
import yaml

from tests.conftest import base_args, main_in_a_fresh_interpreter, metrics, one_error_line
from train.loop import main


def test_print_config_prints_the_resolved_config_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--set", f"output_dir={out}", "--set", "train.max_steps=7", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["max_steps"] == 7 and printed["output_dir"] == str(out)
    assert not out.exists()


def test_an_unknown_key_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--set", f"output_dir={tmp_path / 'run'}", "--set", "train.max_stepz=3"]) == 2
    one_error_line(capsys, "train.max_stepz")
    assert not (tmp_path / "run").exists()


def test_a_config_mistake_is_refused_before_torch_and_transformers_are_imported(tmp_path):
    """Each process of a launch refuses a mistaken key at once, not after ~10 s of imports."""
    args = [
        "--config",
        "configs/stage1.yaml",
        "--set",
        f"output_dir={tmp_path / 'run'}",
        "--set",
        "train.optimizer.lr=x",
    ]
    code, heavy, err = main_in_a_fresh_interpreter("train.loop", args)
    assert (code, heavy) == (2, []), err
    assert len(err.strip().splitlines()) == 1 and "train.optimizer.lr" in err
    assert not (tmp_path / "run").exists()


def test_an_unreachable_cache_endpoint_is_one_line_before_the_model_library_loads(tmp_path):
    """The cache is opened before transformers and diffusers are imported: a wrong endpoint costs seconds, not the
    model library's imports on every process."""
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    args = ["--set", "cache_dir=s3://bucket/cache", "--set", f"output_dir={tmp_path / 'run'}"]
    code, heavy, err = main_in_a_fresh_interpreter("train.loop", args, env)
    assert code == 2 and "transformers" not in heavy and "diffusers" not in heavy, (heavy, err)
    assert len(err.strip().splitlines()) == 1 and "s3://bucket/cache" in err and "AWS_ENDPOINT_URL" in err, err
    assert not (tmp_path / "run").exists()


def test_plan_prints_the_runs_steps_without_loading_a_model(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--set", f"output_dir={out}", "--set", "train.max_steps=5", "--plan", "--samples", "1000", "--gpus", "2"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.strip() and "5" in text and not out.exists()


@pytest.mark.slow
def test_a_short_run_logs_each_step_saves_at_its_checkpoints_and_exports_final(tmp_path):
    from precompute import pipeline
    from tests._precompute_helpers import make_cfg

    cache, out = tmp_path / "cache", tmp_path / "run"
    pipeline.run(make_cfg(cache, n=10, shard=4, res=32))  # the tiny VAE, as training reads it
    args = base_args(
        cache,
        out,
        steps=3,
        **{
            "image.resolution": 32,
            "train.eval.samples": 2,
            "train.global_batch_size": 4,
            "train.micro_batch_size": 2,
            "train.checkpoint.every": 2,
            "train.lr_schedule.warmup_steps": 1,
        },
    )
    assert main(args) == 0
    steps = [m for m in metrics(out) if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["nonfinite_total"] == 0 for m in steps)
    assert [m["epoch"] for m in steps] == [0, 0, 1]  # 8 training samples: 2 steps of 4 in an epoch
    assert (out / "checkpoint-2" / "trainable.safetensors").is_file()
    assert (out / "final" / "trainable.safetensors").is_file()


@pytest.mark.slow
def test_node_groups_train_the_same_on_one_process_and_two(cache, tmp_path):
    """storage.node_groups 2 (window 2): two processes, each reading its group's part of every batch, log the
    losses of one process at every step, across an epoch's end (3 steps an epoch here)."""
    from tests.conftest import run2

    groups = {"storage.shuffle_window": 2, "storage.node_groups": 2, "train.eval.samples": 16}
    assert main(base_args(cache, tmp_path / "one", steps=4, **groups)) == 0
    two = run2(base_args(cache, tmp_path / "two", steps=4, **groups))
    assert two.returncode == 0, two.stderr[-3000:]
    one_losses, two_losses = ([m["loss"] for m in metrics(tmp_path / d) if "loss" in m] for d in ("one", "two"))
    assert len(one_losses) == 4 and two_losses == pytest.approx(one_losses, rel=1e-5)
    assert [m["epoch"] for m in metrics(tmp_path / "one") if "loss" in m] == [0, 0, 0, 1]
