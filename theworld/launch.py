"""How a command joins the processes its launcher started (accelerate launch, torchrun, an Accelerate config file).

Without CUDA, accelerate forms a process group only when asked for the CPU: otherwise N launched processes each think
they are alone (DistributedType.NO) and run N copies of the job. Every command asks for the CPU when there is no GPU
(or ACCELERATE_USE_CPU says so) and checks that the group it got is the one the launcher started.
"""
from __future__ import annotations

import os

import torch

from theworld.errors import UserError


def use_cpu() -> bool:
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()


def launched_processes() -> int:
    """How many processes the launcher started (accelerate launch and torchrun both set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def check_group(num_processes: int) -> None:
    """The launcher's WORLD_SIZE must be the group's size."""
    launched = launched_processes()
    if num_processes != launched:
        raise UserError(f"the launcher started {launched} processes (WORLD_SIZE={launched}) but they formed a group of "
                        f"{num_processes}; on CPU launch with ACCELERATE_USE_CPU=true, e.g. ACCELERATE_USE_CPU=true "
                        "python -m accelerate.commands.launch --multi_gpu --num_processes N ...")


def process_group():
    """accelerate's PartialState over the launched processes (one process when nothing launched several)."""
    from accelerate import PartialState

    state = PartialState(cpu=use_cpu())
    check_group(state.num_processes)
    return state
