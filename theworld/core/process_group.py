"""How a command joins the processes its launcher started (accelerate launch, torchrun, an Accelerate config file).

Without CUDA, accelerate forms a process group only when asked for the CPU: otherwise N launched processes each think
they are alone (DistributedType.NO) and run N copies of the job. Every command asks for the CPU when there is no GPU
(or ACCELERATE_USE_CPU says so) and checks that the group it got is the one the launcher started.
"""

from __future__ import annotations

import os
import shlex
import sys

import torch

from theworld.core.errors import UserError


def use_cpu() -> bool:
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()


def launched_processes() -> int:
    """How many processes the launcher started (accelerate launch and torchrun both set WORLD_SIZE)."""
    if "WORLD_SIZE" not in os.environ and (asked := cpu_config_processes()) > 1:
        raise UserError(
            f"the Accelerate config file asks for {asked} CPU processes (MULTI_CPU), but accelerate "
            "launch started one (it starts several CPU processes only through mpirun); start "
            f"{asked} with: ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes "
            f"{asked} --num_machines 1 --mixed_precision no --dynamo_backend no "
            f"{shlex.join(sys.orig_argv[1:]) or '-m MODULE ...'}"
        )
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def cpu_config_processes(parent_args: list[str] | None = None) -> int:
    """The num_processes of a MULTI_CPU Accelerate config this process was started from by accelerate launch's
    one-process launcher (which marks its child with ACCELERATE_MIXED_PRECISION and, when asked for several
    processes, MASTER_PORT); 0 otherwise. The config file is the one on the launcher's command line, or Accelerate's
    default."""
    if "ACCELERATE_MIXED_PRECISION" not in os.environ or "MASTER_PORT" not in os.environ:
        return 0
    from accelerate.commands.config import default_config_file
    from accelerate.commands.config.config_args import load_config_from_file

    args = _parent_args() if parent_args is None else parent_args
    path = next((a.split("=", 1)[1] for a in args if a.startswith(("--config_file=", "--config-file="))), None)
    if path is None:
        path = next((b for a, b in zip(args, args[1:]) if a in ("--config_file", "--config-file")), None)
    path = path or default_config_file
    if not os.path.isfile(path):
        return 0
    try:
        cfg = load_config_from_file(path)
    except Exception:  # noqa: BLE001 - accelerate launch read it already; anything odd: no claim made
        return 0
    multi_cpu = str(getattr(cfg, "distributed_type", "")).endswith("MULTI_CPU")
    return int(getattr(cfg, "num_processes", 0) or 0) if multi_cpu else 0


def _parent_args() -> list[str]:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:  # not Linux: the default config file only
        return []


def check_group(num_processes: int) -> None:
    """The launcher's WORLD_SIZE must be the group's size."""
    launched = launched_processes()
    if num_processes != launched:
        raise UserError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but they formed a group of "
            f"{num_processes}; on CPU launch with ACCELERATE_USE_CPU=true, e.g. ACCELERATE_USE_CPU=true "
            "python -m accelerate.commands.launch --multi_gpu --num_processes N ..."
        )


def process_group():
    """accelerate's PartialState over the launched processes (one process when nothing launched several)."""
    from accelerate import PartialState

    state = PartialState(cpu=use_cpu())
    check_group(state.num_processes)
    return state


def gather_ints(state, value: int) -> list[int]:
    """`value` from every process of `state` (an Accelerator or PartialState), in rank order: a collective."""
    from accelerate.utils import gather

    return gather(torch.tensor([value], dtype=torch.int64, device=state.device)).tolist()


def shared_folder_check(state, folder, sees: bool, key: str) -> None:
    """Every process, after process 0 wrote into `folder`: `sees` says whether this process finds what it wrote. A
    node whose `folder` is a local folder of its own would write its part where nobody reads it: refused on every
    process, naming the first that does not see it."""
    if state.num_processes < 2:
        return
    seen = gather_ints(state, int(sees))
    if not all(seen):  # every process refuses here: cli_entry ends the group before exit 2
        raise UserError(
            f"config key '{key}': process {seen.index(0)} does not see what process 0 wrote in {folder}: every node "
            f"must use the same {key} (a shared file system)"
        )
