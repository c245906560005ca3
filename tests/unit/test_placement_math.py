"""Placement arithmetic: ranks per node and rank assignment from reported node ids."""

from __future__ import annotations

import pytest

from raytrain_dt.control.placement import assign_ranks, ranks_per_node, tp_groups_on_one_node
from raytrain_dt.topology.parallel_dims import ParallelDims


def test_whole_nodes_first_and_multiples_of_tp():
    assert ranks_per_node(8, [4, 4, 4], tp=2) == [4, 4]
    assert ranks_per_node(6, [2, 8], tp=2) == [6]
    assert ranks_per_node(6, [4, 3, 4], tp=2) == [4, 2]
    with pytest.raises(ValueError, match="cannot place 6 ranks with tp=4"):
        ranks_per_node(6, [4, 4], tp=4)


def test_ranks_follow_reported_node_ids_not_bundle_order():
    reports = [
        {"node_id": "b", "actor_index": 0},
        {"node_id": "a", "actor_index": 1},
        {"node_id": "b", "actor_index": 2},
        {"node_id": "a", "actor_index": 3},
    ]
    ranks = assign_ranks(reports)
    assert ranks == [2, 0, 3, 1]
    node_of_rank = [None] * 4
    for position, rank in enumerate(ranks):
        node_of_rank[rank] = reports[position]["node_id"]
    assert tp_groups_on_one_node(ParallelDims(world_size=4, dp_shard=2, tp=2), node_of_rank)
    assert not tp_groups_on_one_node(ParallelDims(world_size=4, dp_shard=1, tp=4), node_of_rank)
