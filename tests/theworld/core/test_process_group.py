"""theworld/core/process_group.py: joining the launcher's processes (accelerate launch, an Accelerate config
for several CPU processes, torchrun), or a one-line refusal naming how to start them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    ENV,
    ROOT,
    base_args,
    free_port,
    train_inproc,
    weights,
)


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


def test_a_launcher_whose_processes_do_not_form_one_group_is_refused(monkeypatch):
    from theworld.core.errors import UserError
    from theworld.core.process_group import check_group

    monkeypatch.setenv("WORLD_SIZE", "2")
    check_group(2)
    with pytest.raises(UserError, match="started 2 processes"):
        check_group(1)  # what accelerate gives N CPU processes it was not told to group


NO_CAPTIONS = {"train.eval.captions": 0}  # the final eval samples no caption: weights are what is compared


@pytest.mark.slow
def test_torchrun_with_two_processes_trains_on_two(cache, tmp_path):
    import torch

    assert train_inproc(base_args(cache, tmp_path / "one", steps=3, **NO_CAPTIONS)) == 0
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
            *base_args(cache, tmp_path / "two", steps=3, **NO_CAPTIONS),
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
