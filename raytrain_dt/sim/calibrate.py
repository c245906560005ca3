"""Feed the simulator a real run's own costs, read from its `metrics.jsonl` and `events.jsonl`.

What is calibrated, and from where (the coordinator writes a breakdown of every formation into
its `start`/`resize` event, `control/recovery_timing.py`):
- step time per world size: the mean gap between consecutive steps of one formation (less a
  periodic save's stall, which is calibrated apart), counting the steps a restart re-trained
  too (the mean, not the median: the simulated timeline is a sum of steps, hiccups included);
- periodic checkpoints: the median `stall_s` of the `checkpoint` events; the JIT save: from the
  drained step's metrics line to its `drained` event;
- detection, re-plan, re-form (+ checkpoint verification, model build, warm-up, data start and
  the unattributed rest) and checkpoint load: the first restart after a failure (actors
  reused), or without one (a run with notices only) the first resize;
  the first step's extra time: that formation's `first_step`, and the first growth's for a
  formation that started actors (`Costs.new_actor_first_step_extra_s`), and that formation's
  re-form (`Costs.new_actor_reform_s`: new actors finish their warm-up, and the kept ones wait
  for them in their first process groups); the in-memory restore and
  hand-over (`Costs.memory_restore_s`, `memory_copy_s`): the same load and JIT save, as
  measured (a run with in-memory copies measures those);
- actor start: how much longer the first growth (new actors on a new node) took to form;
- node arrival lag: from the step a node was added at to the moment the coordinator saw it (the
  growth decision's time minus its `detection_s`, which counts from the node's appearance).
Everything else (which steps run when, what is lost, when the policy decides what) is the
simulator's own.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

from raytrain_dt.control.recovery_timing import FORMATION_PHASES
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.sim.costs import Costs


def _step_times(metrics: list[dict], events: list[dict]) -> dict[int, float]:
    """Seconds per step by world size: kept steps from `metrics.jsonl`, plus the steps a
    restart dropped from it (its `rewind` event), which ran at the layout before it. A
    periodic save's stall after its step is left out: the simulator adds it on its own."""
    stall_after = {
        e["step"]: e["stall_s"] for e in events if e["event"] == "checkpoint" and "stall_s" in e
    }
    seconds: dict[int, float] = {}
    steps: dict[int, int] = {}
    for before, after in pairwise(metrics):
        if after["step"] == before["step"] + 1 and after["world_size"] == before["world_size"]:
            world = after["world_size"]
            gap = after["time"] - before["time"] - stall_after.get(before["step"], 0.0)
            seconds[world] = seconds.get(world, 0.0) + gap
            steps[world] = steps.get(world, 0) + 1
    world = None
    for e in events:
        if e["event"] in ("start", "resize"):
            world = e["new_layout"]["dims"]["world_size"]
        elif e["event"] == "rewind" and world is not None and e.get("dropped_steps"):
            seconds[world] = seconds.get(world, 0.0) + e["dropped_step_time_s"]
            steps[world] = steps.get(world, 0) + len(e["dropped_steps"])
    return {w: seconds[w] / steps[w] for w in steps}


def _formation_s(event: dict) -> float:
    """From the decision to the formed group: every phase after the drain, the unattributed
    seconds included (the driver's and the ranks' bookkeeping grows on a starved host)."""
    after_drain = FORMATION_PHASES[FORMATION_PHASES.index("checkpoint_verify_s") :]
    return sum(event.get(k, 0.0) for k in (*after_drain, "unattributed_s"))


def costs_from_run(run_dir: str | Path, add_step: int | None = None) -> Costs:
    """Costs measured in the run at `run_dir`; `add_step`: the step of a chaos add_node."""
    run = Path(run_dir)
    metrics, events = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "events.jsonl")
    step_s = _step_times(metrics, events)
    time_of_step = {m["step"]: m["time"] for m in metrics}
    resizes = [e for e in events if e["event"] == "resize"]
    # A failure's restart (no drain before it), else the first resize (a notice's).
    restart = next((e for e in resizes if "drain_s" not in e), resizes[0])
    grown = [e for e in resizes if "drain_s" in e]
    started = [e for e in resizes if e.get("new_actors")]  # formations that started actors

    def first_step_extra_s(formation: dict) -> float:
        first = [e for e in events if e["event"] == "first_step" and e["time"] > formation["time"]]
        world = formation["new_layout"]["dims"]["world_size"]
        return max(0.0, first[0]["first_step_s"] - step_s[world]) if first else 0.0

    stalls = [e["stall_s"] for e in events if e["event"] == "checkpoint" and "stall_s" in e]
    costs = Costs(
        detection_s=restart.get("detection_s", 0.0),
        replan_s=restart.get("replan_s", 0.0),
        reform_s=_formation_s(restart) - restart.get("checkpoint_load_s", 0.0),
        ckpt_load_s=restart.get("checkpoint_load_s", 0.0),
        memory_restore_s=restart.get("checkpoint_load_s", 0.0),
        # Growth onto a joined node waits for its pre-started actors: from the node's
        # appearance to the decision (the grow resize's detection) is their start.
        actor_start_s=grown[0].get("detection_s", 0.0) if grown else 0.0,
        first_step_extra_s=first_step_extra_s(restart),
        new_actor_first_step_extra_s=first_step_extra_s(started[0]) if started else None,
        new_actor_reform_s=(
            _formation_s(started[0]) - started[0].get("checkpoint_load_s", 0.0) if started else None
        ),
        ckpt_stall_s=statistics.median(stalls) if stalls else 0.0,
        step_s_by_world=step_s,
    )
    drained = [e for e in events if e["event"] == "drained" and e["step"] in time_of_step]
    if drained:
        handover = drained[0]["time"] - time_of_step[drained[0]["step"]]
        costs = replace(costs, ckpt_save_s=handover, memory_copy_s=handover)
    decisions = [e for e in events if e["event"] == "decision" and "capacity grew" in e["reason"]]
    if add_step in time_of_step and decisions and grown:
        seen = decisions[0]["time"] - grown[0]["detection_s"]
        costs = replace(costs, arrival_lag_s=max(0.0, seen - time_of_step[add_step]))
    return costs


def measured_timeline(run_dir: str | Path) -> dict:
    """Seconds from the first trained step to each later formation and to the last trained
    step (the end of training: the final save after it is no part of the simulated timeline)."""
    run = Path(run_dir)
    events = read_jsonl(run / "events.jsonl")
    origin = next(e["time"] for e in events if e["event"] == "first_step")
    formed = [e["time"] - origin for e in events if e["event"] == "resize"]
    last_step = read_jsonl(run / "metrics.jsonl")[-1]["time"]
    return {"formed": formed, "end": last_step - origin}
