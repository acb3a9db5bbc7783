"""train/slurm.py: a node's place in a SLURM job, from SLURM's node lists and environment."""

from __future__ import annotations

import pytest

from tests.conftest import slurm_job
from theworld.core.errors import UserError
from train import slurm


def test_slurm_node_lists_expand_as_slurm_writes_them():
    expand = lambda s: list(slurm.expand_nodelist(s))
    assert expand("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand("a[1-2]-ib[0-1],login,x[9-11]") == [
        *("a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1", "login", "x9", "x10", "x11")
    ]
    assert slurm.first_host("gpu[0001-9999999999999]") == "gpu0001"  # never the whole list
    for bad, words in [
        ("n[1-", "unbalanced"),
        ("n]1[", "unbalanced"),
        ("n[a]", "'a' is not a number"),
        ("n[3-1]", "runs backwards"),
        (",", "names no host"),
    ]:
        with pytest.raises(UserError, match=words):
            slurm.first_host(bad)


def test_a_nodes_place_in_the_slurm_job_comes_from_its_environment():
    assert slurm.from_env({"PATH": "/bin"}) is None  # not under SLURM
    node = slurm.from_env(slurm_job(SLURM_GPUS_ON_NODE="8"))
    assert (node.nodes, node.node, node.host, node.per_node) == (4, 2, "gpu07", 8)
    assert node.port == slurm.PORT_BASE + 77  # two jobs on one node listen on different ports
    node = slurm.from_env(
        slurm_job(SLURM_NNODES="", SLURM_JOB_NUM_NODES="4", MASTER_ADDR="10.0.0.1", MASTER_PORT="1234")
    )
    assert (node.nodes, node.host, node.port) == (4, "10.0.0.1", 1234)
    with pytest.raises(UserError, match="SLURM_NODEID 4 is outside the job's 4 node"):
        slurm.from_env(slurm_job(SLURM_NODEID="4"))
    with pytest.raises(UserError, match="SLURM runs 2 tasks on this node"):
        slurm.from_env(slurm_job(SLURM_STEP_TASKS_PER_NODE="2(x4)"))
    with pytest.raises(UserError, match="run one per node"):
        slurm.from_env(slurm_job(SLURM_LOCALID="1"))
    with pytest.raises(UserError, match="SLURM_NODEID 0 is outside the job's 0 node"):
        slurm.from_env(slurm_job(SLURM_NNODES="0", SLURM_NODEID="0"))
    with pytest.raises(UserError, match="SLURM_NNODES='two' is not a number"):
        slurm.from_env(slurm_job(SLURM_NNODES="two"))
    with pytest.raises(UserError, match="MASTER_PORT=70000 is not a port"):
        slurm.from_env(slurm_job(MASTER_PORT="70000"))
