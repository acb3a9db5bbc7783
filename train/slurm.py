"""What a SLURM job step says about the node a launcher runs on: how many nodes, which one this is, where the main
process listens and how many processes each node starts. `train.launch` turns it into `accelerate launch`'s
multi-node arguments, so one command serves every node of an sbatch script (docs/training.md, "Several nodes").

The node list is SLURM's compressed form (`node[01-04,07],gpu-a1`); it is expanded here rather than by `scontrol
show hostnames`, so a launcher needs no SLURM client on its node (containers rarely have one).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from theworld.core.errors import UserError

PORT_BASE, PORT_SPAN = 20000, 20000  # the default port: from the job id, so two jobs sharing a node differ
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> Iterator[str]:
    """SLURM's compressed host list as host names in order, lazily (a list may name thousands of nodes; the launcher
    needs the first): `node[01-03,07],login` -> node01 node02 node03 node07 login (zero padding kept; several
    bracket groups in one name multiply out). A malformed list raises UserError when the bad part is reached."""
    for item in _split_top(nodelist.strip()):
        yield from _expand_one(item, nodelist)


def first_host(nodelist: str) -> str:
    host = next(expand_nodelist(nodelist), None)
    if host is None:
        raise UserError(f"SLURM_JOB_NODELIST {nodelist!r} names no host")
    return host


def _split_top(text: str) -> list[str]:
    """`text` cut at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(item: str, whole: str) -> Iterator[str]:
    open_, close = item.find("["), item.find("]")
    if open_ < 0 and close < 0:
        yield item
        return
    if open_ < 0 or close < open_:
        raise UserError(f"SLURM_JOB_NODELIST {whole!r}: unbalanced brackets in {item!r}")
    head, body, tail = item[:open_], item[open_ + 1 : close], item[close + 1 :]
    ranges = []
    for part in body.split(","):  # all checked before the first name comes out
        m = _RANGE.match(part.strip())
        if m is None:
            raise UserError(f"SLURM_JOB_NODELIST {whole!r}: {part!r} is not a number or a range like 01-04")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise UserError(f"SLURM_JOB_NODELIST {whole!r}: the range {part!r} runs backwards")
        ranges.append((lo, hi))
    for lo, hi in ranges:
        for n in range(int(lo), int(hi) + 1):
            name = f"{head}{n:0{len(lo)}d}"
            if tail:
                yield from (name + rest for rest in _expand_one(tail, whole))
            else:
                yield name


@dataclass(frozen=True)
class SlurmNode:
    """This launcher's place in the job: `node` of `nodes`, the main process at `host:port`, `per_node` processes
    here."""

    nodes: int
    node: int
    host: str
    port: int
    per_node: int
    job: str

    def describe(self) -> str:
        return (
            f"launch: SLURM job {self.job}: node {self.node} of {self.nodes}, {self.per_node} process(es) per node, "
            f"main process on {self.host}:{self.port}"
        )


def _int(env: dict, name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    # SLURM_NTASKS_PER_NODE / SLURM_GPUS_ON_NODE may read "8(x2)" or "8,8" on a heterogeneous job: the first count
    m = re.match(r"^(\d+)", value)
    if m is None:
        raise UserError(f"{name}={value!r} is not a number")
    return int(m.group(1))


def check_port(port: int, label: str) -> int:
    """A main process port every node can be told: 0 ("any free port") would be a different port on each node, so
    the rendezvous would wait forever."""
    if port == 0:
        raise UserError(
            f"{label} is not a fixed port: give every node the same port from 1 to 65535 (0 picks a free port on "
            "each node separately, and the rendezvous waits forever)"
        )
    if not 0 < port < 65536:
        raise UserError(f"{label} is not a port (1 to 65535)")
    return port


def env_port(env: dict | None = None) -> int | None:
    """MASTER_PORT from the environment, whole digits only (a number with anything after it is a typo, not a port),
    or None when unset."""
    env = os.environ if env is None else env
    value = env.get("MASTER_PORT", "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise UserError(f"MASTER_PORT={value!r} is not a port: give a whole number from 1 to 65535")
    return check_port(int(value), f"MASTER_PORT={value}")


def from_env(env: dict | None = None) -> SlurmNode | None:
    """This node's place in the SLURM job step it runs in, or None outside SLURM (no SLURM_NODEID / node count).
    MASTER_ADDR / MASTER_PORT, when set, override the first host of the node list and the port from the job id."""
    env = os.environ if env is None else env
    nodes = _int(env, "SLURM_NNODES")
    nodes = _int(env, "SLURM_JOB_NUM_NODES") if nodes is None else nodes
    node = _int(env, "SLURM_NODEID")
    if nodes is None or node is None:
        return None
    if not 0 <= node < nodes:
        raise UserError(
            f"SLURM_NODEID {node} is outside the job's {nodes} node(s) (SLURM_NNODES): this launcher runs outside "
            "the job step's nodes; start it with srun inside the job"
        )
    job = env.get("SLURM_JOB_ID", "").strip() or "0"
    host = env.get("MASTER_ADDR", "").strip()
    if not host:
        nodelist = env.get("SLURM_JOB_NODELIST", "").strip() or env.get("SLURM_NODELIST", "").strip()
        if not nodelist:
            raise UserError("SLURM_JOB_NODELIST is not set: set MASTER_ADDR to the host of node 0")
        host = first_host(nodelist)
    port = env_port(env)
    port = PORT_BASE + (int(job) if job.isdigit() else 0) % PORT_SPAN if port is None else port
    return SlurmNode(nodes, node, host, port, _per_node(env), job)


def _per_node(env: dict) -> int:
    """One process per GPU of this node (SLURM_GPUS_ON_NODE, else the GPUs torch sees), one on a node without
    GPUs. The launcher starts them all: a step that runs several launchers on a node is refused (they would all claim
    the same node rank)."""
    tasks = _int(env, "SLURM_STEP_TASKS_PER_NODE") or _int(env, "SLURM_NTASKS_PER_NODE") or 1
    if tasks > 1 or (_int(env, "SLURM_LOCALID") or 0) > 0:
        raise UserError(
            f"SLURM runs {tasks} tasks on this node, each a launcher claiming node {env.get('SLURM_NODEID')}: "
            "run one per node (#SBATCH --ntasks-per-node=1, or srun --ntasks-per-node=1); it starts one process "
            "per GPU"
        )
    gpus = _int(env, "SLURM_GPUS_ON_NODE")
    if gpus:
        return gpus
    return torch.cuda.device_count() if torch.cuda.is_available() else 1
