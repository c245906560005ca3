"""The nodes a run may use, as the planner sees them: `NodeInfo` (id, accelerators, memory) and
the `Topology` a set of them gives (`planning_topology`).

Pure data and arithmetic, no Ray: the driver fills `NodeInfo`s from `ray.nodes()`
(`control/cluster.py`), the simulator makes them up (`sim/`), and both plan from them alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raytrain_dt.config.schema import ClusterConfig
from raytrain_dt.topology.layout import CPU_PEAK_FLOPS, Topology


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    accelerators: int
    memory_bytes: float = 0.0  # Ray's `memory` resource of the node


def planning_topology(
    cluster: ClusterConfig, resource: str, nodes: list[NodeInfo], num_ranks: int
) -> Topology:
    """The Topology the planner sees: the ranks this run uses, on the nodes that hold them."""
    per_node = min(max(n.accelerators for n in nodes), num_ranks)
    # A partly used last node counts: every rank is one the planner may use (uneven batches
    # make odd rank counts worth using).
    num_nodes = -(-num_ranks // per_node)
    on_gpu = resource == "GPU"
    defaults = Topology(num_nodes=num_nodes, accelerators_per_node=per_node, accelerators=num_ranks)
    if cluster.memory_per_accelerator_gb:
        memory = cluster.memory_per_accelerator_gb * 1e9
    elif on_gpu:
        memory = defaults.memory_per_accelerator
    else:
        memory = min(n.memory_bytes / n.accelerators for n in nodes) or 8e9
    if cluster.peak_tflops:
        peak = cluster.peak_tflops * 1e12
    else:
        peak = defaults.peak_flops if on_gpu else CPU_PEAK_FLOPS
    if cluster.host_memory_gb:
        host = cluster.host_memory_gb * 1e9
    else:  # the smallest node's `memory` resource (0 where Ray reports none: not checked)
        host = min(n.memory_bytes for n in nodes)
    return dataclasses.replace(
        defaults,
        memory_per_accelerator=memory,
        peak_flops=peak,
        host_memory_per_node=host,
        device_memory_on_host=not on_gpu,
    )
