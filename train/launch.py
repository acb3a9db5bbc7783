"""`python -m train.launch ARGS`: `accelerate launch ARGS` (the same arguments, parsed and run by accelerate itself)
whose exit status says how the run ended, for schedulers and requeue scripts that read it.

`accelerate launch` exits 1 with a traceback whenever it is stopped or its processes end other than with 0: on a
SIGTERM, torch elastic forwards the signal, waits for the processes (which save a checkpoint and exit 143) and then
re-raises it as a `SignalException`; a process's one-line error becomes a `ChildFailedError` table; the one-process
path raises `CalledProcessError`, and does not pass a SIGTERM on at all. Here:

- a stop signal to the launcher -> one line, exit 128 + the signal (143 for SIGTERM, 130 for SIGINT), after the
  processes saved; on the one-process path the signal is passed on to the process first;
- a process that failed -> one line naming its rank, exit with its code (2 for a user's mistake, which the process
  already explained on its own line; 128 + N for a process killed by signal N);
- success -> 0.

torch elastic waits 30 s after passing a signal on before it kills the processes; writing a large model's checkpoint
can take longer, so this launcher waits 120 s unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise (a scheduler
enforces its own limit anyway).

Several nodes: each node runs this launcher with the same arguments plus its own node rank (`--num_machines N
--machine_rank R --main_process_ip HOST`); a rank outside 0..N-1 is refused here, where torch elastic would wait
forever for a rendezvous that cannot complete. Inside a SLURM job step the node's arguments come from SLURM's
environment (train/slurm.py) for whatever the command line leaves out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from theworld.core import log
from theworld.core.config import ArgParser
from theworld.core.errors import UserError, cli_entry
from train import slurm

_log = log.get(__name__)

GRACE_S = "120"
FORWARDED = (signal.SIGTERM, signal.SIGINT)


def _pass_on(signum: int, frame) -> None:
    """The one-process path: accelerate's child gets the launcher's stop signal (the child may have it already, from
    a Ctrl-C to the whole process group; train.preempt takes a repeat that close as the same request)."""
    children = psutil.Process().children()
    if not children:  # nothing started yet, so nothing to save
        raise SystemExit(128 + signum)
    for child in children:
        child.send_signal(signum)


def _code(exitcode: int) -> int:
    """A process's exit code as a shell reports it (a negative one is death by that signal)."""
    return 128 - exitcode if exitcode < 0 else exitcode


@cli_entry
def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = launch_command_parser()
    parser.prog = "python -m train.launch"
    parser.error = ArgParser.error.__get__(parser)  # a usage mistake is one line (exit 2), as in every command here
    args = parser.parse_args(argv)
    nodes(args)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", GRACE_S)
    for sig in FORWARDED:  # torch elastic installs its own handlers when it starts several processes
        signal.signal(sig, _pass_on)
    try:
        launch_command(args)
    except SignalException as e:
        return _ended(128 + int(e.sigval), "the launcher")
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        return _ended(_code(failure.exitcode), f"process {rank}")
    except subprocess.CalledProcessError as e:
        return _ended(_code(e.returncode), "the process")
    return 0


def nodes(args) -> None:
    """Fill in the multi-node arguments a SLURM job step implies (the command line's own win), then check that
    this node's rank is one of the job's nodes and the process count splits over them."""
    node = slurm.from_env()
    if node is not None:
        given = args.num_processes is not None
        args.num_machines = args.num_machines if args.num_machines is not None else node.nodes
        args.machine_rank = args.machine_rank if args.machine_rank is not None else node.node
        args.main_process_ip = args.main_process_ip or node.host
        args.main_process_port = args.main_process_port or node.port
        if not given:
            args.num_processes = node.per_node * args.num_machines
        several = args.num_processes > 1
        if several and not (args.multi_gpu or args.use_fsdp or args.use_deepspeed or args.cpu or args.tpu):
            args.multi_gpu = True  # torch elastic's launcher, the one that spans nodes
    if args.main_process_port is not None:
        slurm.check_port(args.main_process_port, f"--main_process_port {args.main_process_port}")
    slurm.env_port()  # the processes' rendezvous reads it too: a bad one is refused here, not waited on
    machines, rank = args.num_machines, args.machine_rank
    if machines is not None and machines < 1:
        raise UserError(f"--num_machines {machines}: a run needs at least one node")
    if machines is not None and rank is not None and not 0 <= rank < machines:
        raise UserError(
            f"--machine_rank {rank} is outside the job's {machines} node(s): give each node a rank from 0 to "
            f"{machines - 1}"
        )
    if machines and args.num_processes is not None and args.num_processes % machines:
        raise UserError(
            f"--num_processes {args.num_processes} (the total over all nodes) does not split evenly over "
            f"--num_machines {machines}"
        )
    if node is not None:
        _log.info(node.describe())


def _ended(code: int, who: str) -> int:
    """The launcher's one line for a run that did not end with 0, and its exit code."""
    stops = {128 + s: s.name for s in FORWARDED}
    if code in stops:
        _log.info(f"launch: {who} stopped by {stops[code]}; rerun the same command to resume")
    else:
        _log.info(f"launch: {who} exited with code {code} (its own lines above say why)")
    return code or 1


if __name__ == "__main__":
    sys.exit(main())
