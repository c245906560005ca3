"""Rank groups on simulated nodes: TP groups never span nodes; a dp=2 x tp=2 run across two
nodes equals the single-process reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reference import reference_run

from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR, alive_nodes
from raytrain_dt.control.coordinator import train
from raytrain_dt.control.placement import counts_by_node, tp_groups_on_one_node
from raytrain_dt.control.rank_group import RankGroup
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.topology.parallel_dims import ParallelDims


def _accelerator_nodes() -> list[tuple[str, int]]:
    return [(n.node_id, n.accelerators) for n in alive_nodes(SIMULATED_ACCELERATOR)]


def _placed_nodes(tmp_path, dims: ParallelDims) -> list[str]:
    nodes = _accelerator_nodes()
    group = RankGroup(str(tmp_path), SIMULATED_ACCELERATOR, cpus_per_rank=0.1)
    try:
        group.form(counts_by_node(dims.world_size, dims.tp, nodes), timeout_s=60)
        return [slot.node_id for slot in group.slots]
    finally:
        group.shutdown()


def test_two_nodes_tp_groups_stay_on_one_node(fresh_actors, tmp_path):
    tp2 = ParallelDims(world_size=4, dp_shard=2, tp=2)
    dp4 = ParallelDims(world_size=4, dp_shard=4)
    # Two nodes of two accelerators take two ranks each with or without TP, so one formation
    # stands for both layouts (a TP group of one is on one node by definition).
    nodes = _accelerator_nodes()
    assert counts_by_node(4, tp2.tp, nodes) == counts_by_node(4, dp4.tp, nodes)
    placed = _placed_nodes(tmp_path, tp2)
    assert len(set(placed)) == 2
    assert placed == sorted(placed)  # ranks follow node ids
    assert tp_groups_on_one_node(tp2, placed)


def test_three_nodes_tp_groups_stay_on_one_node(fresh_actors, tmp_path):
    extra = fresh_actors.add_node(num_cpus=1, resources={SIMULATED_ACCELERATOR: 2})
    try:
        fresh_actors.wait_for_nodes()
        dims = ParallelDims(world_size=6, dp_shard=3, tp=2)
        nodes = _placed_nodes(tmp_path, dims)
        assert len(set(nodes)) == 3
        assert tp_groups_on_one_node(dims, nodes)
    finally:
        fresh_actors.remove_node(extra)


def test_dp2_tp2_on_two_nodes_equals_single_process(ray_cluster, make_config):
    cfg = make_config("cluster.num_ranks=4", "parallel.tp=2", "engine.zero_stage=3")
    result = train(cfg, show_progress=False)
    assert result.layout.dims == ParallelDims(world_size=4, dp_shard=2, tp=2)
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    ref_losses, _ = reference_run(cfg, cfg.trainer.steps)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
    placed = next(e for e in read_jsonl(f"{result.run_dir}/events.jsonl") if e["event"] == "start")
    assert len(set(placed["node_ids"])) == 2
    assert tp_groups_on_one_node(result.layout.dims, placed["node_ids"])
    plan = json.loads((Path(result.run_dir) / "plan.json").read_text())
    assert plan["layout"]["tp"] == 2 and plan["reason"]


def test_a_node_without_room_times_out_naming_the_key_and_what_is_free(fresh_actors, tmp_path):
    """More ranks than a node's accelerators: the formation gives up after
    `cluster.placement_timeout_s`, and the one-line error says what each rank asks for and
    what the node had free (all of it, once the warm actors released by `fresh_actors` have
    given their bundles back), reserving nothing meanwhile."""
    import ray

    from raytrain_dt.control.group import PlacementTimedOut

    node = alive_nodes(SIMULATED_ACCELERATOR)[0]
    (total,) = [n["Resources"] for n in ray.nodes() if n["NodeID"] == node.node_id]
    whole = (total["CPU"], total[SIMULATED_ACCELERATOR])
    assert _free_cpus_and_accelerators(node.node_id, whole) == whole
    group = RankGroup(str(tmp_path), SIMULATED_ACCELERATOR, cpus_per_rank=0.1)
    try:
        with pytest.raises(PlacementTimedOut) as caught:
            group.form({node.node_id: node.accelerators + 1}, timeout_s=2)
    finally:
        group.shutdown()
    message = str(caught.value)
    assert message.startswith("cluster.placement_timeout_s: no room for 3 ranks of accelerator")
    assert "(each CPU 0.1, accelerator 1)" in message and "\n" not in message
    assert message.endswith(f"free there: CPU {whole[0]:g}, accelerator {whole[1]:g}")
    assert caught.value.node_id == node.node_id
    # Nothing left reserved: the timed-out group was removed.
    assert _free_cpus_and_accelerators(node.node_id, whole) == whole


def _free_cpus_and_accelerators(node_id: str, expected: tuple, within_s: float = 30.0) -> tuple:
    """The node's free (CPU, accelerator) once it is `expected` (bundles are given back
    asynchronously), or what it is at the deadline."""
    import time

    from ray._private.state import available_resources_per_node

    deadline = time.monotonic() + within_s
    while True:
        free = available_resources_per_node().get(node_id, {})
        now = (free.get("CPU", 0.0), free.get(SIMULATED_ACCELERATOR, 0.0))
        if now == expected or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_actors_warmed_for_a_full_node_wait_for_room_there(fresh_actors, tmp_path):
    """Actors warmed for a node whose accelerators are all held for the moment (actors just
    killed there hold theirs until they are gone) start on that node once it has room, never
    on the other node, which has room all along. Reserved with a soft target, they started on
    the other node while their reservation stood for this one: a later run found no free
    bundle where its plan put ranks, and timed out placing them."""
    import ray
    from ray.util.placement_group import (
        NODE_ID_LABEL_KEY,
        placement_group,
        remove_placement_group,
    )

    full, other = alive_nodes(SIMULATED_ACCELERATOR)[:2]
    holder = placement_group(
        [{SIMULATED_ACCELERATOR: 1}] * full.accelerators,
        strategy="STRICT_PACK",
        bundle_label_selector=[{NODE_ID_LABEL_KEY: full.node_id}] * full.accelerators,
    )
    ray.get(holder.ready(), timeout=60)
    (total,) = [n["Resources"] for n in ray.nodes() if n["NodeID"] == other.node_id]
    whole = (total["CPU"], total[SIMULATED_ACCELERATOR])
    assert _free_cpus_and_accelerators(other.node_id, whole) == whole  # room there all along
    group = RankGroup(str(tmp_path), SIMULATED_ACCELERATOR, cpus_per_rank=0.1)
    try:
        group.warm(full.node_id, 1)
        group.collect_warm(timeout_s=10)  # time enough for an actor placed elsewhere to start
        assert group.idle == [] and len(group.starting) == 1
        remove_placement_group(holder)
        group.collect_warm(timeout_s=120)
        assert [slot.node_id for slot in group.idle] == [full.node_id]
    finally:
        group.shutdown()
        remove_placement_group(holder)
