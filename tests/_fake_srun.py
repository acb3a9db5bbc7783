"""`srun` for tests on one machine: runs its command once per node of the job (SLURM_NNODES), each with the
variables SLURM gives a job step's task (SLURM_NODEID, SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE),
and exits as srun does, with the highest exit code of its tasks. Each task's code is printed to stderr."""

from __future__ import annotations

import os
import subprocess
import sys


def main() -> int:
    args = sys.argv[1:]
    while args and args[0].startswith("-"):  # srun's own options, all written --name=value in our script
        args.pop(0)
    nodes = int(os.environ["SLURM_NNODES"])
    step = {"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": f"1(x{nodes})", "SLURM_LOCALID": "0"}
    tasks = [
        subprocess.Popen(args, env={**os.environ, **step, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i)})
        for i in range(nodes)
    ]
    codes = [t.wait() for t in tasks]
    codes = [128 - c if c < 0 else c for c in codes]
    for i, c in enumerate(codes):
        print(f"srun: task {i} exited with code {c}", file=sys.stderr)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
