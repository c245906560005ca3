"""The elastic policy, one decision at a time, with scripted observations (no Ray, no torch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from raytrain_dt.config.schema import ElasticConfig
from raytrain_dt.control.policies import ElasticPolicy, Fail, Noop, Observation, Resize, Wait
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.nodes import NodeInfo
from raytrain_dt.topology.parallel_dims import ParallelDims

GLOBAL_BATCH = 8


def dp_layout(nodes) -> Layout | None:
    """A stand-in planner: pure DP over every accelerator, global batch kept."""
    world = sum(n.accelerators for n in nodes)
    if world == 0 or GLOBAL_BATCH % world:
        return None
    return Layout(
        ParallelDims(world_size=world, dp_shard=world),
        zero_stage=3,
        micro_batch=GLOBAL_BATCH // world,
        grad_accum=1,
    )


def nodes(*ids: str) -> tuple[NodeInfo, ...]:
    return tuple(NodeInfo(i, 2) for i in ids)


@pytest.fixture
def policy():
    return ElasticPolicy(
        ElasticConfig(
            min_nodes=1, max_restarts=3, max_failures_at_step=2, wait_timeout_s=10, grow_stable_s=5
        ),
        dp_layout,
    )


def running(**kw) -> Observation:
    base = dict(
        now=100.0,
        nodes=nodes("a", "b"),
        layout=dp_layout(nodes("a", "b")),
        layout_nodes=("a", "b"),
        nodes_stable_since=0.0,
    )
    base.update(kw)
    return Observation(**base)


def test_start_plans_for_every_node(policy):
    decision = policy.decide(Observation(now=0, nodes=nodes("a", "b")))
    assert isinstance(decision, Resize) and not decision.checkpoint_first
    assert decision.layout.dims.world_size == 4 and decision.nodes == ("a", "b")


def test_healthy_and_unchanged_is_noop(policy):
    assert isinstance(policy.decide(running()), Noop)


def test_node_lost_shrinks_from_the_latest_checkpoint(policy):
    decision = policy.decide(
        running(nodes=nodes("a"), health="failed", restarts=1, failures_at_step=1)
    )
    assert isinstance(decision, Resize) and not decision.checkpoint_first
    assert decision.layout.dims.world_size == 2 and decision.nodes == ("a",)
    assert decision.layout.global_batch == GLOBAL_BATCH


def test_preemption_notice_drains_with_a_checkpoint_first(policy):
    decision = policy.decide(running(draining=frozenset({"b"}), health="notice"))
    assert isinstance(decision, Resize) and decision.checkpoint_first
    assert decision.nodes == ("a",)


def test_growth_waits_for_stable_capacity_then_checkpoints_first(policy):
    three = nodes("a", "b", "c")
    # 8 is not divisible by 6 ranks, so three nodes give no better layout: stays put.
    assert isinstance(policy.decide(running(nodes=three, nodes_stable_since=99.0)), Noop)
    four = nodes("a", "b", "c", "d")
    assert isinstance(
        policy.decide(running(nodes=four, nodes_stable_since=98.0)), Noop
    )  # flapping?
    decision = policy.decide(running(nodes=four, nodes_stable_since=90.0))
    assert isinstance(decision, Resize) and decision.checkpoint_first
    assert decision.layout.dims.world_size == 8


def test_replaced_ranks_grow_the_group_on_the_nodes_it_uses(policy):
    """Capacity, not the node count, decides growth: a layout that kept one rank per node
    (its peers died) grows once their replacements show up on those very nodes."""
    shrunk = dp_layout((NodeInfo("a", 1), NodeInfo("b", 1)))
    obs = running(layout=shrunk, layout_nodes=("a", "b"))
    decision = policy.decide(obs)
    assert isinstance(decision, Resize) and decision.checkpoint_first
    assert decision.layout.dims.world_size == 4 and decision.nodes == ("a", "b")
    assert isinstance(policy.decide(replace(obs, nodes=(NodeInfo("a", 1), NodeInfo("b", 1)))), Noop)


def test_below_min_nodes_waits_then_fails(policy):
    policy.cfg.min_nodes = 2
    obs = running(nodes=nodes("a"), health="failed", restarts=1, failures_at_step=1)
    assert isinstance(policy.decide(obs), Wait)
    late = running(
        nodes=nodes("a"), health="failed", restarts=1, failures_at_step=1, waiting_since=85.0
    )
    assert isinstance(policy.decide(late), Fail)


def test_no_fitting_layout_waits_then_fails(policy):
    """Nodes enough, but none of the planner's layouts fits them (here: 3 accelerators for a
    global batch of 8): the run waits for capacity, up to elastic.wait_timeout_s."""
    odd = (NodeInfo("a", 2), NodeInfo("b", 1))
    obs = running(nodes=odd, health="failed", restarts=1, failures_at_step=1)
    decision = policy.decide(obs)
    assert isinstance(decision, Wait) and "no layout fits on 2 nodes" in decision.reason
    assert isinstance(policy.decide(replace(obs, waiting_since=95.0)), Wait)
    decision = policy.decide(replace(obs, waiting_since=90.0))
    assert isinstance(decision, Fail) and "for 10s" in decision.reason


def test_restart_budget_and_repeating_failures_stop_the_run(policy):
    assert isinstance(policy.decide(running(health="failed", restarts=3, failures_at_step=1)), Fail)
    decision = policy.decide(running(health="failed", restarts=1, failures_at_step=2, step=41))
    assert isinstance(decision, Fail) and "step 42 failed 2 times" in decision.reason


def test_max_nodes_keeps_the_nodes_in_use(policy):
    policy.cfg.max_nodes = 2
    decision = policy.decide(
        running(nodes=nodes("a", "b", "c", "d"), health="failed", restarts=1, failures_at_step=1)
    )
    assert decision.nodes == ("a", "b")
