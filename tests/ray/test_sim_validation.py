"""The simulator against a real embedded multi-node run on the same trace (a chaos list): the
same layouts in the same order, and a timeline within 25% once fed the run's own measured costs
(`raytrain_dt/sim/calibrate.py` lists what is calibrated, the first step on a new node's
actors included; the step counting, lost steps and policy decisions are the simulator's own).

The test changes the shared cluster's nodes and puts it back as it found it.
"""

from __future__ import annotations

import dataclasses
import statistics
from itertools import pairwise
from pathlib import Path

import pytest

from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR, alive_nodes
from raytrain_dt.control.coordinator import train
from raytrain_dt.control.recovery_timing import FORMATION_PHASES
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.sim.calibrate import costs_from_run, measured_timeline
from raytrain_dt.sim.runner import Setup
from raytrain_dt.sim.sim_planner import SimPlanner
from raytrain_dt.sim.trace import StepTrace

KILL_STEP, ADD_STEP = 6, 8


def _real_run(make_config, cluster, run_dir):
    # Steps enough after the arrival for its actors to start on a busy machine (5-10 s).
    cfg = make_config(
        "trainer.steps=40",
        "checkpoint.every_steps=4",
        "cluster.num_ranks=null",
        "engine.zero_stage=3",
        "chaos_step_delay_s=0.3",
        "elastic.grow_stable_s=1",
        "elastic.hang_timeout_s=300",  # a slow start on a busy machine is no hang
        f"chaos=[{{at_step: {KILL_STEP}, action: kill_node, target: 3}}, "
        f"{{at_step: {ADD_STEP}, action: add_node}}]",
        run_dir=run_dir,
    )
    nodes = alive_nodes(SIMULATED_ACCELERATOR)
    result = train(cfg, simulated_cluster=cluster, show_progress=False)
    assert result.final_step == cfg.trainer.steps
    return cfg, nodes, result, read_jsonl(f"{result.run_dir}/events.jsonl")


def _story(run_dir) -> str:
    """What the real run did, from its first step on: when each step ended, a line per
    decision, notice, drain, failure and formation (with the actors it kept and started, and
    where its seconds went), and what its log warned: so that a failed comparison says why."""
    events = read_jsonl(f"{run_dir}/events.jsonl")
    origin = next(e["time"] for e in events if e["event"] == "first_step")
    steps = read_jsonl(f"{run_dir}/metrics.jsonl")
    lines = ["steps at: " + " ".join(f"{m['step']}:{m['time'] - origin:.2f}" for m in steps)]
    # Where a slow step's seconds went, on the rank: its own time and its wait for input.
    gaps = [(after, after["time"] - before["time"]) for before, after in pairwise(steps)]
    usual = statistics.median(gap for _, gap in gaps)
    lines.append(
        "slow steps: "
        + " ".join(
            f"{m['step']}:{gap:.1f}s(step {m['step_time_s']:.2f}s, input {m['data_wait_s']:.2f}s)"
            for m, gap in gaps
            if gap > 3 * usual
        )
    )
    for e in events:
        at = f"{e['time'] - origin:+.2f}s"
        if e["event"] in ("start", "resize"):
            world = e["new_layout"]["dims"]["world_size"]
            phases = {k: round(e[k], 2) for k in (*FORMATION_PHASES, "unattributed_s") if k in e}
            lines.append(
                f"{at} {e['event']} world {world} at step {e['resumed_step']}: kept "
                f"{e.get('kept_actors')} new {e.get('new_actors')} ({e['reason']}) {phases}"
            )
        elif e["event"] in (
            "decision",
            "failure",
            "placement_timeout",
            "rewind",
            "preemption_notice",
            "drained",
        ):
            detail = {k: v for k, v in e.items() if k not in ("time", "event")}
            lines.append(f"{at} {e['event']} {detail}")
    logs = [Path(run_dir, "train.log"), *sorted(Path(run_dir, "logs").glob("*.log"))]
    warnings = [ln for log in logs for ln in log.read_text().splitlines() if " WARNING " in ln]
    return "\n".join(lines + [ln[:300] for ln in warnings])


def _assert_within_a_quarter(simulated: dict, measured: dict, costs, story: str) -> None:
    """The end within 25% of the measured timeline's length, and each formation within 25%
    of the whole timeline (single steps still vary 0.1-5 s here). A miss shows both
    timelines, every calibrated cost and the run's story, in full."""
    span = measured["end"]
    why = f"simulated {simulated}\nmeasured {measured}\n{costs}\n{story}"
    assert simulated["end"] == pytest.approx(span, rel=0.25), why
    for sim_s, real_s in zip(simulated["formed"], measured["formed"], strict=True):
        assert abs(sim_s - real_s) <= 0.25 * span, why


# A 40-step run through a node loss and an arrival: 187-277 s in the gate beside another worker,
# near the default 300 (its notice sibling below has the same limit).
@pytest.mark.timeout(900)
def test_simulator_replays_a_real_elastic_run(restore_nodes, make_config, tmp_path):
    cfg, nodes, result, events = _real_run(make_config, restore_nodes, tmp_path / "run")
    memory = min(n.memory_bytes for n in nodes)
    real_layouts = [e["new_layout"] for e in events if e["event"] in ("start", "resize")]
    costs = costs_from_run(result.run_dir, add_step=ADD_STEP)
    planner = SimPlanner(cfg, resource=SIMULATED_ACCELERATOR, node_memory_bytes=memory)
    setup = Setup(planner, costs, cfg.cluster.accelerators_per_node, len(nodes), cfg.elastic)
    sim = setup.run(
        "ours",
        StepTrace.from_chaos(len(nodes), cfg.chaos),
        cfg.checkpoint.every_steps,
        total_steps=cfg.trainer.steps,
    )

    # The decisions: the same layouts, in the same order (4 ranks, 2 after the loss, 4 again).
    story = _story(result.run_dir)
    assert [f["world"] for f in sim.formations] == [4, 2, 4], story
    assert [f["layout"] for f in sim.formations] == real_layouts, story

    # The timeline from the failure on: when each later formation was formed, and the end. The
    # steps before it are not compared: on 2 shared cores the first steps vary 0.5-5 s (the first
    # save allocates its staging buffers, the first Ray Data batch), which a mean step time
    # cannot place; from the failure on, recovery, growth and the steady steps are the model's.
    events_by_kind = {e["event"]: e for e in reversed(events)}  # the first of each kind
    origin = next(e["time"] for e in events if e["event"] == "first_step")
    # Both timelines start at the fault itself: the simulator's at the node's loss, the run's
    # `failure` event once it was detected, `detection_s` (from the last healthy poll) later.
    real_fail = events_by_kind["failure"]["time"] - costs.detection_s - origin
    measured = measured_timeline(result.run_dir)
    measured = {
        "formed": [t - real_fail for t in measured["formed"]],
        "end": measured["end"] - real_fail,
    }
    shrink = sim.formations[1]
    recovery = costs.detection_s + costs.replan_s + costs.reform_s + costs.ckpt_load_s
    sim_fail = shrink["t"] - recovery
    simulated = {
        "formed": [f["t"] - sim_fail for f in sim.formations[1:]],
        "end": sim.wall_s - sim_fail,
    }
    _assert_within_a_quarter(simulated, measured, costs, story)


PREEMPT_STEP = 6


@pytest.mark.timeout(900)
def test_simulator_replays_a_real_preemption_with_notice(restore_nodes, make_config, tmp_path):
    """The notice path: a node preempted with notice drains at the next step boundary (a JIT
    save) and the group shrinks onto the other node, losing no step, in the real run and in
    the simulator replaying it (the notice at the step it reached the real run): the same
    layouts in the same order, no step lost, one drain, and a timeline from the notice on
    within 25% once fed the run's own measured costs."""
    cfg = make_config(
        "trainer.steps=14",
        "checkpoint.every_steps=3",
        "cluster.num_ranks=null",
        "engine.zero_stage=3",
        "chaos_step_delay_s=0.3",
        "elastic.hang_timeout_s=300",  # a slow start on a busy machine is no hang
        f"chaos=[{{at_step: {PREEMPT_STEP}, action: preempt_node, target: 3}}]",
        run_dir=tmp_path / "run",
    )
    nodes = alive_nodes(SIMULATED_ACCELERATOR)
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    assert result.final_step == cfg.trainer.steps
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    real_layouts = [e["new_layout"] for e in events if e["event"] in ("start", "resize")]
    (notice,) = [e for e in events if e["event"] == "preemption_notice"]
    (resize,) = [e for e in events if e["event"] == "resize"]
    assert resize["lost_steps"] == 0
    assert not [e for e in events if e["event"] in ("failure", "rewind")]

    costs = costs_from_run(result.run_dir)
    memory = min(n.memory_bytes for n in nodes)
    planner = SimPlanner(cfg, resource=SIMULATED_ACCELERATOR, node_memory_bytes=memory)
    setup = Setup(planner, costs, cfg.cluster.accelerators_per_node, len(nodes), cfg.elastic)
    # The notice at the step it reached the run (chaos waits for a settled layout).
    chaos = [dataclasses.replace(cfg.chaos[0], at_step=notice["step"])]
    sim = setup.run(
        "ours",
        StepTrace.from_chaos(len(nodes), chaos),
        cfg.checkpoint.every_steps,
        total_steps=cfg.trainer.steps,
    )
    story = _story(result.run_dir)
    assert [f["layout"] for f in sim.formations] == real_layouts, story
    assert [f["world"] for f in sim.formations] == [4, 2], story
    assert (sim.steps_lost, sim.drains, sim.failures, sim.steps) == (0, 1, 0, cfg.trainer.steps)

    # From the notice on: when the shrunk group formed, and the end.
    origin = next(e["time"] for e in events if e["event"] == "first_step")
    measured = measured_timeline(result.run_dir)
    real_notice = notice["time"] - origin
    measured = {
        "formed": [t - real_notice for t in measured["formed"]],
        "end": measured["end"] - real_notice,
    }
    (sim_notice,) = sim.notice_times
    simulated = {
        "formed": [f["t"] - sim_notice for f in sim.formations[1:]],
        "end": sim.wall_s - sim_notice,
    }
    _assert_within_a_quarter(simulated, measured, costs, story)
