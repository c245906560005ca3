"""The elasticity simulator: seeded traces, the coordinator's policy on hand-checkable timelines,
and the three policies ranked on a trace with notices (no Ray, no torch.distributed)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from raytrain_dt.cli import main
from raytrain_dt.control.policies import Observation
from raytrain_dt.sim.costs import Costs
from raytrain_dt.sim.runner import Setup, scale_config
from raytrain_dt.sim.sim_planner import SimPlanner
from raytrain_dt.sim.trace import (
    DAY,
    DOWN,
    NOTICE,
    UP,
    Trace,
    TraceSpec,
    load_trace,
    synthetic_trace,
)


def test_synthetic_trace_is_deterministic_per_seed_and_well_formed():
    spec = TraceSpec(nodes=256, duration_s=7 * DAY, zone_outages_per_day=0.0, seed=3)
    a, b = synthetic_trace(spec), synthetic_trace(spec)
    other = synthetic_trace(
        TraceSpec(nodes=256, duration_s=7 * DAY, zone_outages_per_day=0.0, seed=4)
    )
    for x, y in ((a.t, b.t), (a.kind, b.kind), (a.node, b.node)):
        np.testing.assert_array_equal(x, y)
    assert len(a) != len(other) or not np.array_equal(a.t, other.t)
    # Per node the events alternate: (notice) down, up, (notice) down, ... starting from up.
    for node in range(spec.nodes):
        kinds = [k for k in a.kind[a.node == node] if k != NOTICE]
        assert kinds == [DOWN, UP] * (len(kinds) // 2) + [DOWN] * (len(kinds) % 2)
    # A notice comes notice_s before its node goes down; no failure has one.
    for i in np.nonzero(a.kind == NOTICE)[0]:
        down = np.nonzero((a.node == a.node[i]) & (a.kind == DOWN) & (a.t >= a.t[i]))[0][0]
        assert a.t[down] - a.t[i] == pytest.approx(spec.notice_s)
    # Losses follow the configured Poisson rates (mean ~ 236 here; 4 sigma is ~ 60).
    rate = spec.preemptions_per_node_day + spec.failures_per_node_day
    assert abs(a.counts()["down"] - rate * spec.nodes * 7) < 60
    noticed = a.counts()["notice"] / a.counts()["down"]
    assert abs(noticed - spec.preemptions_per_node_day / rate) < 0.08


def test_zone_outage_takes_the_whole_zone_at_once():
    spec = TraceSpec(
        nodes=128,
        duration_s=DAY,
        preemptions_per_node_day=0.0,
        failures_per_node_day=0.0,
        zone_size=32,
        zone_outages_per_day=3.0,
        seed=1,
    )
    trace = synthetic_trace(spec)
    first = trace.t[trace.kind == DOWN].min()
    lost = set(trace.node[(trace.kind == DOWN) & (trace.t == first)].tolist())
    zone = min(lost) // 32
    assert lost == set(range(zone * 32, zone * 32 + 32))


def test_trace_files_round_trip_and_bad_rows_name_the_event(tmp_path):
    trace = synthetic_trace(TraceSpec(nodes=16, duration_s=DAY, preemptions_per_node_day=1.0))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace.to_json()))
    back = load_trace(path, nodes=1, duration_s=1.0)
    assert back.nodes == 16 and back.counts() == trace.counts()
    np.testing.assert_allclose(back.t, trace.t, atol=1e-3)
    csv_path = tmp_path / "trace.csv"
    csv_path.write_text("t,kind,node\n5,down,1\n10,up,1\n7,bogus,2\n")
    with pytest.raises(Exception, match="event 2"):
        load_trace(csv_path, nodes=4, duration_s=100)


def _hand_setup(memory_every: int = 0, **cost_changes) -> Setup:
    """A 1B model on 2 nodes x 8 GPUs, measured step times 1 s (16 GPUs) and 2 s (8 GPUs);
    without in-memory copies unless `memory_every` (the timelines below are the durable path's).

    Big enough for compute to outweigh collective latency, so the planner's fastest layout uses
    every GPU it has (on a tiny model one GPU would be fastest)."""
    cfg = scale_config("llama-1b", 8, 2048, 16)
    cost_changes = {"first_step_extra_s": 0, **cost_changes}
    costs = Costs(
        detection_s=10,
        replan_s=0,
        reform_s=20,
        actor_start_s=30,
        ckpt_save_s=0,
        ckpt_load_s=5,
        ckpt_stall_s=0,
        step_s_by_world={16: 1.0, 8: 2.0},
        **cost_changes,
    )
    return Setup(SimPlanner(cfg), costs, 8, 2, cfg.elastic, memory_every)


def _one_event_trace(*events: tuple[float, int, int]) -> Trace:
    t, kind, node = zip(*events, strict=True)
    return Trace(2, 1000.0, np.array(t, float), np.array(kind), np.array(node))


def test_hand_computed_timeline_of_a_lost_node():
    setup = _hand_setup()
    result = setup.run("ours", _one_event_trace((100.5, DOWN, 1)), ckpt_every=30)
    assert [f["world"] for f in result.formations] == [16, 8]  # the real planner's choices
    # Start: re-plan 0 + re-form 20 + load 5 + new actors 30 -> steps from t=55 at 1 s.
    # At 100.5 step 45 is done (the 46th in flight) and step 30 is committed: 15 steps lost.
    # Detected at 110.5; re-form 20 + load 5 on the surviving node (actors kept) -> t=135.5,
    # resumed from step 30 at 2 s/step: floor((1000 - 135.5) / 2) = 432 more steps.
    assert result.steps == 30 + 432 and result.steps_lost == 15
    assert result.samples == 462 * 16
    assert result.down_s == pytest.approx(55 + (135.5 - 100.5))
    assert result.degraded_s == pytest.approx(1000 - 135.5)
    assert result.lost_compute_s == pytest.approx(15 * 1.0 + 0.5)
    assert setup.score(result)["goodput"] == pytest.approx(462 / 1000)


def test_hand_computed_notice_drains_and_loses_nothing():
    setup = _hand_setup()
    trace = _one_event_trace((100.5, NOTICE, 1), (220.5, DOWN, 1))
    ours = setup.run("ours", trace, ckpt_every=30)
    # Notice at 100.5: step 46 completes at 101, the JIT save (0 s) commits it, then re-form
    # 20 + load 5 on the kept node -> 126, and 2 s steps: floor(874 / 2) = 437 more.
    assert ours.steps == 46 + 437 and ours.steps_lost == 0 and ours.drains == 1
    # Fixed-size restart ignores the notice: at 220.5 step 165 is done, 150 committed, and
    # it waits for a second node that never comes.
    restart = setup.run("restart", trace, ckpt_every=30)
    assert restart.steps == 150 and restart.steps_lost == 15
    assert restart.down_s == pytest.approx(55 + 1000 - 220.5)


def test_policies_rank_ours_over_dp_only_over_restart_on_a_trace_with_notices():
    cfg = scale_config("llama-70b", 8, 4096, 1680)
    setup = Setup(SimPlanner(cfg), Costs(), 8, 12, cfg.elastic)
    # A JIT checkpoint lands at the next step boundary, and a notice that arrives while a group
    # forms is acted on once it has formed, so a notice saves every step only if it outlasts a
    # formation, one step and a save: here up to 110 s + 95 s + 45 s (pp=10 on 10-11 nodes).
    # (With 120 s notices, one that arrives early in an 11-node step loses that step.)
    trace = synthetic_trace(
        TraceSpec(
            nodes=12,
            duration_s=2 * DAY,
            preemptions_per_node_day=1.0,
            failures_per_node_day=0.0,
            zone_outages_per_day=0.0,
            notice_s=300.0,
        )
    )
    assert trace.counts()["notice"] == trace.counts()["down"] > 10
    rows = {
        name: setup.score(setup.run(name, trace, 300)) for name in ("restart", "dp_only", "ours")
    }
    assert rows["ours"]["goodput"] >= rows["dp_only"]["goodput"] >= rows["restart"]["goodput"]
    assert rows["ours"]["steps_lost"] == 0 and rows["ours"]["drains"] > 0
    assert rows["restart"]["steps_lost"] > 0


def _three_node_setup(memory_every: int = 0) -> Setup:
    """The hand setup on 3 nodes, the policy planning for at most 2 (`elastic.max_nodes`):
    n00002 is left out of the first layout."""
    hand = _hand_setup(memory_restore_s=2)
    elastic = dataclasses.replace(hand.elastic, max_nodes=2)
    return Setup(hand.planner, hand.costs, 8, 3, elastic, memory_every)


def _trace(nodes: int, *events: tuple[float, int, int]) -> Trace:
    t, kind, node = zip(*events, strict=True)
    return Trace(nodes, 1000.0, np.array(t, float), np.array(kind), np.array(node))


def test_long_warm_actors_cost_nothing_and_never_cancel_the_reform():
    """Node 1 dies at 100.5 (recovery as in the lost-node timeline: step 30 from t=135.5 at
    2 s/step) and is back at 300; its actors start at once (up at 330) and growth waits for a
    stable node set (300 s): at 600 step 262 is done, step 263 ends at 601.5 and is saved (0 s).
    The re-form costs re-form 20 + load 5, and the actors warm since 330 cost nothing (not
    minus 271.5 s): formed at 626.5, then 1 s steps: floor(373.5) = 373 more."""
    setup = _hand_setup()
    trace = _one_event_trace((100.5, DOWN, 1), (300.0, UP, 1))
    result = setup.run("ours", trace, ckpt_every=30)
    assert [(f["world"], f["t"]) for f in result.formations] == [
        (16, 55.0),
        (8, 135.5),
        (16, pytest.approx(626.5)),
    ]
    assert result.steps == 263 + 373 and result.steps_lost == 15


def test_a_formation_that_starts_actors_pays_their_first_step():
    """The timeline above with a first step 1 s longer than a normal one, and 4 s longer on
    actors that never trained: the start's first step from 59 (55 + 4), so at 100.5 step 41 is
    done and 11 are lost; the restart on kept actors from 136.5 (135.5 + 1); at 600 step 261 is
    done, step 262 ends at 600.5 and is saved; the growth onto the new node's actors forms at
    625.5 and trains from 629.5: floor(370.5) = 370 more."""
    setup = _hand_setup(first_step_extra_s=1, new_actor_first_step_extra_s=4)
    result = setup.run("ours", _one_event_trace((100.5, DOWN, 1), (300.0, UP, 1)), 30)
    assert [(f["world"], f["t"]) for f in result.formations] == [
        (16, 55.0),
        (8, 135.5),
        (16, pytest.approx(625.5)),
    ]
    assert result.steps == 262 + 370 and result.steps_lost == 11


def test_idle_actors_are_kept_and_a_later_layout_pays_no_actor_start():
    """n00002 is left out of the first layout; as the coordinator does, its actors start once
    the group has formed (idle from 85). n00000 dies at 100.5: detected at 110.5, re-formed on
    n00001 and n00002 with re-form 20 + load 5 and no actor start -> 135.5, from step 30 at
    16 GPUs (1 s): 864 more steps."""
    setup = _three_node_setup()
    result = setup.run("ours", _trace(3, (100.5, DOWN, 0)), ckpt_every=30)
    assert [f["world"] for f in result.formations] == [16, 16]
    assert result.formations[1]["t"] == pytest.approx(135.5)
    assert result.steps == 30 + 864 and result.steps_lost == 15


def test_in_memory_copies_lose_only_the_step_in_flight_unless_every_holder_is_lost():
    """With a copy every step on its node and the next node of the layout: n00001 lost at
    100.5 leaves n00000 holding both shards, so the re-form restores step 45 from memory
    (2 s instead of the 5 s load) and loses only the half step in flight. Losing n00000 and
    n00001 together loses both holders of n00000's shard: back to the step-30 checkpoint, on
    n00002 alone (8 GPUs, 2 s steps) from 135.5."""
    setup = _three_node_setup(memory_every=1)
    kept = setup.run("ours", _trace(3, (100.5, DOWN, 1)), ckpt_every=30)
    # Detected at 110.5, re-formed on n00000 and n00002 (warm since 85): 20 + 2 -> 132.5.
    assert kept.formations[1]["t"] == pytest.approx(132.5) and kept.formations[1]["step"] == 45
    assert kept.steps == 45 + 867 and kept.steps_lost == 0 and kept.memory_restores == 1
    assert kept.lost_compute_s == pytest.approx(0.5)
    both = setup.run("ours", _trace(3, (100.5, DOWN, 0), (100.5, DOWN, 1)), ckpt_every=30)
    assert both.formations[1]["t"] == pytest.approx(135.5) and both.formations[1]["step"] == 30
    assert both.steps == 30 + 432 and both.steps_lost == 15 and both.memory_restores == 0


def test_a_node_lost_while_the_group_forms_costs_a_reformation():
    """n00000 dies at 100.5; while the group re-forms on n00001 and n00002 (110.5 to 135.5),
    n00002 dies at 120: a second failure, detected at 130, re-planned onto n00001 alone and
    formed at 155, still from the step-30 checkpoint, at 2 s/step: 422 more steps."""
    setup = _three_node_setup()
    trace = _trace(3, (100.5, DOWN, 0), (120.0, DOWN, 2))
    result = setup.run("ours", trace, ckpt_every=30)
    assert result.failures == 2 and result.failed is None
    assert [(f["world"], f["step"]) for f in result.formations] == [(16, 0), (8, 30)]
    assert result.formations[1]["t"] == pytest.approx(155.0)
    assert result.steps == 30 + 422 and result.steps_lost == 15


def test_dp_only_never_trains_more_than_the_configured_batch():
    """The hand setup's full layout is 2 nodes of one replica each (batch 16, one sample per
    GPU). A third node would be a third replica, and 24 samples per step: DP-only is capped
    at the configured batch, so it stays at 2 replicas."""
    setup = _hand_setup()
    dp_only = setup.strategy("dp_only")
    nodes = tuple(setup.planner.node(f"n{i:05d}", 8) for i in range(3))
    obs = Observation(
        now=0.0,
        nodes=nodes,
        draining=frozenset(),
        layout=None,
        layout_nodes=(),
        health="ok",
        step=0,
        restarts=0,
        failures_at_step=0,
        waiting_since=None,
        nodes_stable_since=0.0,
    )
    decision = dp_only.decide(obs)
    assert dp_only.samples_per_step(decision.layout) == 16
    assert decision.nodes == ("n00000", "n00001")
    assert (dp_only.batch_label, setup.strategy("restart").batch_label) == (
        "elastic-batch",
        "fixed-batch",
    )


def test_simulate_cli_writes_json_plots_and_report(tmp_path, capsys):
    out = tmp_path / "sim"
    code = main(
        [
            "simulate",
            "--nodes",
            "12",
            "--days",
            "1",
            "--model",
            "llama-70b",
            "--global-batch",
            "1680",
            "--batch-tolerance",
            "0.01",
            "--preemptions-per-node-day",
            "1",
            "--sweep",
            "100,400",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    record = json.loads((out / "simulation.json").read_text())
    assert [r["policy"] for r in record["comparison"]] == ["restart", "dp_only", "ours"]
    assert len(record["sweep"]) == 3 * len({100, 400, record["ckpt_every"]})
    assert all(
        (out / name).stat().st_size > 0 for name in ("timeline.png", "sweep.png", "report.md")
    )
    assert record["batch_tolerance"] == 0.01 and record["memory_every"] == 1
    out_text = capsys.readouterr().out
    assert "| ours | elastic-batch |" in out_text and "| restart | fixed-batch |" in out_text
    assert main(["simulate", "--out", str(out), "--cost", "bogus=1"]) == 2
    assert main(["simulate", "--out", str(out), "--batch-tolerance", "1"]) == 2
    assert "--batch-tolerance: must be in [0, 1)" in capsys.readouterr().err
