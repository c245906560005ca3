"""Placement that mirrors nodes: how many ranks go on which node, and which actor is which rank.

Pure functions, no Ray. Each node's ranks are reserved together in placement groups of their
own on that node (STRICT_PACK, `control/node_reservations.py`), so a lost node takes only its own
reservations with it. Ranks are then assigned from the node ids the actors report, never from
bundle order, which Ray does not promise.
"""

from __future__ import annotations

from raytrain_dt.topology.parallel_dims import ParallelDims


def ranks_per_node(world_size: int, node_capacities: list[int], tp: int) -> list[int]:
    """Fill whole nodes first (largest first, ties by order); every count is a multiple of tp."""
    order = sorted(range(len(node_capacities)), key=lambda i: (-node_capacities[i], i))
    remaining = world_size
    counts = []
    for i in order:
        if remaining == 0:
            break
        take = min(node_capacities[i], remaining)
        take -= take % tp  # a TP group never straddles two nodes
        if take > 0:
            counts.append(take)
            remaining -= take
    if remaining:
        raise ValueError(
            f"cannot place {world_size} ranks with tp={tp} on nodes with capacities {node_capacities}"
        )
    return counts


def counts_by_node(world_size: int, tp: int, nodes: list[tuple[str, int]]) -> dict[str, int]:
    """node id -> ranks to place there, for nodes given as (node id, capacity)."""
    counts = ranks_per_node(world_size, [capacity for _, capacity in nodes], tp)
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][1], i))
    return {nodes[order[i]][0]: count for i, count in enumerate(counts)}


def assign_ranks(reports: list[dict]) -> list[int]:
    """actor position -> rank: grouped by reported node id (sorted), then by actor index."""
    order = sorted(
        range(len(reports)), key=lambda i: (reports[i]["node_id"], reports[i]["actor_index"])
    )
    ranks = [0] * len(reports)
    for rank, position in enumerate(order):
        ranks[position] = rank
    return ranks


def tp_groups_on_one_node(dims: ParallelDims, node_of_rank: list[str]) -> bool:
    return all(len({node_of_rank[r] for r in group}) == 1 for group in dims.groups("tp"))
