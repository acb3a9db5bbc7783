"""Sharded FSDP checkpoints (train/state/shards.py) on two real CPU processes (gloo): every process writes its own
shard, an asynchronous save lets training go on and is sealed only once every shard is on disk, kill -9 mid-save
resumes from the checkpoint before, resume is bitwise on two processes and loss-equal on one; the log's throughput
figures are sane."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import base_args, fork2, metrics, run2, train_inproc, weights

SHARDED = {
    "freeze.vision": "false",
    "freeze.language": "false",
    "train.hardware.sharding": "fsdp",
    "train.checkpoint.every": 2,
    "train.checkpoint.async": "true",
    "train.optimizer.ema": 0.9,
    "world.latent": "sample",
}


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in metrics(run_dir) if "loss" in m]


def _wait(until, proc, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not until() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert until(), f"{what} (exit {proc.poll()})"


@pytest.mark.slow
def test_async_sharded_checkpoints_kill_9_mid_save_and_resume(cache, tmp_path, capsys):
    ref = run2(base_args(cache, tmp_path / "ref", steps=6, **SHARDED))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "per-process shards (torch.distributed.checkpoint), written in the background" in ref.stderr
    ckpt = tmp_path / "ref" / "checkpoint-4"
    # each process wrote its shard: no whole-tensor files, state.json names the shards and format 3
    assert {p.name for p in ckpt.iterdir()} == {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "config.yaml",
        "rng.safetensors",
        "state.json",
    }
    state = json.loads((ckpt / "state.json").read_text())
    assert state["format_version"] == 3 and state["shards"] == {"processes": 2, "optimizer": True, "ema": True}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(state["sha256"])
    # final/ stays one safetensors model folder of whole tensors
    assert load_file(str(tmp_path / "ref" / "final" / "trainable.safetensors"))

    # throughput in every training line: real tokens/s, padding share, peak memory; no mfu on a CPU
    lines = [m for m in metrics(tmp_path / "ref") if "loss" in m]
    assert len(lines) == 6
    for m in lines:
        assert m["tokens_per_s"] > 0 and 0 <= m["padding_share"] <= 1 and m["peak_memory_gb"] > 0
        assert "mfu" not in m and 0 <= m["data_wait"] <= 1
    assert [m["step"] for m in lines if "checkpoint_s" in m] == [3, 5]  # a save's time goes in the next line

    # the shards of checkpoint-4 stall on disk: training goes on past it, unsealed, until the kill
    out = tmp_path / "killed"
    proc = fork2(
        base_args(cache, out, steps=6, **SHARDED),
        tmp_path / "logs",
        env={"SLOW_SHARDS": "checkpoint-4", "SLOW_SHARDS_S": "600"},
        module="tests._slow_shards",
    )
    try:
        _wait(
            lambda: (out / "metrics.jsonl").is_file() and any(m.get("step") == 5 for m in metrics(out)),
            proc,
            "step 5 was not logged while checkpoint-4 was written",
        )
        assert not (out / "checkpoint-4").exists() and list(out.glob(".tmp-checkpoint-4-*"))
    finally:
        proc.kill()  # both processes
    assert (out / "checkpoint-2" / "state.json").is_file() and not (out / "checkpoint-4").exists()
    resumed = run2(base_args(cache, out, steps=6, **SHARDED))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "removed" in resumed.stderr and f"resumed from {out / 'checkpoint-2'}" in resumed.stderr
    a, b = weights(tmp_path / "ref"), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ea = load_file(str(tmp_path / "ref" / "final" / "ema.safetensors"))
    eb = load_file(str(out / "final" / "ema.safetensors"))
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    assert losses(out) == losses(tmp_path / "ref")

    # one process reads the two processes' shards (resharded) and continues with the same losses
    one = tmp_path / "one"
    one.mkdir()
    shutil.copytree(ckpt, one / "checkpoint-4")
    capsys.readouterr()
    assert train_inproc(base_args(cache, one, steps=6, **SHARDED)) == 0
    assert "written by 2 process(es), resumed by 1" in capsys.readouterr().err
    assert losses(one) == pytest.approx(losses(tmp_path / "ref")[4:], rel=1e-5)  # steps 5 and 6
    w1 = weights(one)
    for k in [k for k in a if not k.endswith("k_proj.bias")]:  # softmax ignores key biases: rounding noise
        torch.testing.assert_close(w1[k], a[k], rtol=1e-5, atol=1e-5)
