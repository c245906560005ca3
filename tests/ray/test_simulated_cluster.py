"""The simulated cluster's nodes: one node type, whenever a node starts."""

from __future__ import annotations

import ray
import torch
from conftest import SESSION_CLUSTER

from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR, alive_nodes, simulated_node_args


def test_a_node_added_while_the_host_is_busy_declares_its_peers_memory(restore_nodes):
    """A node added while the host's memory is taken (here 1 GB this process holds; in CI, the
    other test worker's 400M-parameter ranks) declares the memory the session's first nodes
    did, so the planner prices it the same. Left to Ray, it declared what was free at its start,
    and the runs after a test that replaced a node planned for fewer ranks than configured."""
    first = alive_nodes(SIMULATED_ACCELERATOR)
    assert len(first) == 2 and first[0].memory_bytes == first[1].memory_bytes > 0
    held = torch.ones(256 * 2**20)  # 1 GB, written: resident
    try:
        added = restore_nodes.add_node(
            **simulated_node_args(SESSION_CLUSTER, SIMULATED_ACCELERATOR)
        )
        restore_nodes.wait_for_nodes()
    finally:
        del held
    declared = next(n["Resources"]["memory"] for n in ray.nodes() if n["NodeID"] == added.node_id)
    assert declared == first[0].memory_bytes
