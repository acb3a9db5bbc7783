"""A stand-in command for tests/tools/test_ranks.py: joins the gloo group the launcher's environment describes,
all-reduces its rank, prints what it saw, and exits as its arguments ask."""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if "child" in argv:  # a process of its own under each rank, as a loader worker is
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"rank {rank} child {child.pid}", flush=True)
    if "hang-0" in argv and rank == 0:
        time.sleep(600)  # a peer that never ends on its own (run's grace cuts it)
    if "fail-1" in argv and rank == 1:
        print(f"error: rank {rank} refuses", file=sys.stderr)
        return 3
    dist.init_process_group("gloo")
    total = torch.tensor([rank])
    dist.all_reduce(total)
    dist.destroy_process_group()
    world, note = os.environ["WORLD_SIZE"], os.environ.get("PROBE_NOTE")
    print(f"rank {rank} of {world} sum {int(total)} note {note} cwd {os.getcwd()}")
    print(f"rank {rank} threads {torch.get_num_threads()} argv {sys.argv[1:]}", file=sys.stderr)
    return 0
