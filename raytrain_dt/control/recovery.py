"""Forming and recovering the rank group, the coordinator's hands: (re)form the group at a
decided layout from the right checkpoint, react to dead or hung ranks, drain (checkpoint at the
next step boundary) before a planned resize or a stop, and fire node-level chaos.

A mixin of `Coordinator` (it shares the coordinator's run state); the state machine and the
decisions stay in `coordinator.py`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace

from raytrain_dt.control.checkpoint_tracker import CheckpointTracker
from raytrain_dt.control.placement import counts_by_node
from raytrain_dt.control.policies import Resize
from raytrain_dt.control.recovery_timing import RecoveryTimer
from raytrain_dt.control.run_setup import rank_specs
from raytrain_dt.control.states import (
    Draining,
    Resizing,
    Restarting,
    Running,
    State,
    Stopped,
)

log = logging.getLogger("raytrain_dt.control.coordinator")

POLL_INTERVAL_S = 0.1
CHAOS_ARRIVAL_WAIT_S = 30.0


class GroupRecovery:
    # --- executing a Resize: (re)form the group ----------------------------------------------
    def _form(self, state: Resizing | Restarting) -> State:
        decision = state.decision
        started = time.perf_counter()
        old = self.layout or self.previous_layout
        if self.group.slots:
            broken = self.group.try_call("teardown", timeout_s=30)
            self.group.drop(broken)  # hung or dead actors cannot be reused
        resume, resume_step = self._resume_point()
        self.recorder.rewind(resume_step)
        self.chaos.fired.update(
            i for i, a in enumerate(self.chaos.actions) if a.at_step <= resume_step
        )
        nodes = {n.node_id: n.accelerators for n in self._observe("ok").nodes}
        counts = counts_by_node(decision.layout.dims.world_size, decision.layout.dims.tp,
                                [(n, nodes[n]) for n in decision.nodes if n in nodes])  # fmt: skip
        self.group.form(counts, self.cfg.cluster.placement_timeout_s)
        formed = time.perf_counter()
        cfg = replace(self.cfg, chaos=self.chaos.remaining())
        specs = rank_specs(cfg, self.shape, decision.layout, self.dataset, self.group.master_endpoint(),
                           self.checkpoint_root, resume, self.model_spec)  # fmt: skip
        setup = self.group.call("setup", [(s,) for s in specs])
        self.layout, self.layout_nodes = decision.layout, tuple(sorted(counts))
        self.formed = True
        self.step = resume_step
        self.bar.n = resume_step
        self.tracker = CheckpointTracker(self.store, decision.layout.dims.world_size, self.recorder,
                                         self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every)  # fmt: skip
        self.last_progress = time.time()
        self.timings.append({"kind": type(state).__name__.lower(), "form_s": formed - started,
                             "setup_s": time.perf_counter() - formed, "ranks": setup})  # fmt: skip
        (self.run_dir / "layout.json").write_text(json.dumps(decision.layout.as_dict(), indent=2))
        if self._last_plan is not None:
            (self.run_dir / "plan.json").write_text(json.dumps(self._last_plan.to_json(), indent=2))
        self.recorder.event(
            "resize" if old is not None else "start", reason=decision.reason,
            old_layout=old.as_dict() if old else None, new_layout=decision.layout.as_dict(),
            resumed_from=resume.uri if resume else None, resumed_step=resume_step,
            lost_steps=max(0, self._failure_step - resume_step) if isinstance(state, Restarting) else 0,
            form_s=formed - started, setup_s=time.perf_counter() - formed,
            node_ids=[s.node_id for s in self.group.slots], rank_setup=setup,
            pids=[s.pid for s in self.group.slots],
            **self.recovery.formed(formed - started, setup),
        )  # fmt: skip
        # The next incident is timed afresh; this one's clock runs on to the first step.
        self._formation_timer, self.recovery = self.recovery, RecoveryTimer()
        self.group.call("start")  # after the event: no step may precede its formation's record
        return Running()

    @property
    def _failure_step(self) -> int:
        return max(self.step, self.failed_step)

    def _on_failure(self, health: str, broken: list[dict]) -> State:
        self.recovery.cause(self._last_healthy)
        if health == "failed":
            broken = self._settle(broken)
        errors = {s["rank"]: (s.get("error") or s["state"]).strip().splitlines()[0] for s in broken}
        # Actors that died with their node mark the node lost before Ray's health check does.
        self.lost_nodes |= lost_with_node(broken, [s.node_id for s in self.group.slots])
        self.recorder.event("failure", health=health, step=self.step, ranks=errors)
        log.warning("ranks %s %s at step %d: %s", sorted(errors), health, self.step + 1, errors)
        self.failures_at_step = self.failures_at_step + 1 if self.failed_step == self.step else 1
        self.failed_step = self.step
        self.restarts += 1
        self.chaos.mark_rank_faults_fired(self.step + 1)
        if health == "hung":  # threads stuck in a collective cannot be reused: replace all
            self.group.drop(list(range(self.group.world_size)))
        else:  # dead ones go; survivors are torn down and reused by the next formation
            self.group.drop([s["rank"] for s in broken if s["state"] != "failed"])
        # No group trains now: the policy plans from scratch (and Waiting cannot mistake an
        # idle group for a finished one).
        self.previous_layout, self.layout, self.layout_nodes = self.layout, None, ()
        return self._decide(self._observe(health))

    def _settle(self, broken: list[dict], wait_s: float = 5.0, quiet_s: float = 1.0) -> list[dict]:
        """When one rank fails, its peers fail or die within moments (a lost node's ranks die
        together). Collect them before deciding, so the plan excludes every lost node: until
        no rank runs, or nothing changed for `quiet_s` (a peer stuck in a collective with the
        dead rank never reports; teardown deals with it)."""
        deadline = time.time() + wait_s
        seen, changed = {s["rank"] for s in broken}, time.time()
        while time.time() < deadline and time.time() - changed < quiet_s:
            statuses = self.group.poll()
            self._handle_reports(statuses)
            broken = [s for s in statuses if s["state"] != "running"]
            if len(broken) == len(statuses) and all(s["state"] != "done" for s in broken):
                break
            if {s["rank"] for s in broken} != seen:
                seen, changed = {s["rank"] for s in broken}, time.time()
            time.sleep(0.1)
        return broken_statuses(broken)

    def _drain(self, state: Draining) -> State:
        """Save at the next step boundary and stop there; resize once it is committed."""
        started = time.perf_counter()
        self.group.try_call("request_checkpoint_and_stop", timeout_s=30)
        deadline = time.time() + self.cfg.elastic.hang_timeout_s
        while True:
            if time.time() > deadline:
                return self._on_failure("hung", [])
            statuses = self.group.poll()
            self._handle_reports(statuses)
            broken = broken_statuses(statuses)
            if broken:
                return self._on_failure("failed", broken)
            if all(s["state"] == "done" for s in statuses):
                latest = self.store.committed()
                if latest and latest[-1].step == self.step:
                    break
            time.sleep(POLL_INTERVAL_S)
        self.recovery.drained(time.perf_counter() - started)
        self.recorder.event("drained", step=self.step, reason=state.decision.reason)
        if self.stop_reason:
            log.warning("stopped at step %d (%s); the same run.dir resumes from here",
                        self.step, self.stop_reason)  # fmt: skip
            return Stopped(self.step, self.stop_reason)
        # Ranks on nodes under notice are not reused: let them go while their node still
        # answers (tearing down actors of a node being reclaimed waits on Ray's death notice).
        self.group.drop([r for r, s in enumerate(self.group.slots) if s.node_id in self.draining])
        for node, index in self.preempting.items():  # the notice has been served: reclaim the node
            self.chaos.fired.add(index)
            self.chaos.kill_node(node)
        self.preempting.clear()
        # Nodes under notice are leaving: plan without them even before Ray reports them gone.
        self.lost_nodes |= self.draining
        self.draining.clear()
        # Re-plan now: the node under notice may be gone, or the capacity may have changed.
        decision = self.policy.decide(replace(self._observe("ok"), layout=None))
        if isinstance(decision, Resize):
            return Resizing(replace(decision, reason=state.decision.reason))
        return self._decide(self._observe("ok"))

    def _node_of_rank(self, rank: int) -> str:
        return self.group.slots[min(rank, self.group.world_size - 1)].node_id

    def _fire_node_chaos(self) -> None:
        # Node actions play out in order: the next waits until an added node is in use (for
        # at most CHAOS_ARRIVAL_WAIT_S). Starting a raylet takes seconds, tiny steps 0.1 s:
        # without this, an arrival and the next fault land at once and the story is not told.
        if (
            self.chaos.arrived not in (None, *self.layout_nodes)
            and time.time() - self.chaos.arrived_at < CHAOS_ARRIVAL_WAIT_S
        ):
            return
        for i, action in self.chaos.due_node_actions(self.step):
            if action.action == "kill_node":
                self.chaos.fired.add(i)
                self.chaos.kill_node(self._node_of_rank(action.target))
            elif action.action == "add_node":
                self.chaos.fired.add(i)
                self.chaos.arrived, self.chaos.arrived_at = self.chaos.add_node(), time.time()
                return
            elif action.action == "preempt_node" and i not in self.preempting.values():
                node = self._node_of_rank(action.target)
                self.preempting[node] = i
                self._notice(node, "chaos", f"preempt_node at step {action.at_step}")


def lost_with_node(broken: list[dict], node_of_rank: list[str]) -> set[str]:
    """Nodes whose every rank died and whose death Ray gave as the cause, or that held several
    ranks all dead at once. A rank that merely exited (its process died, its node lives)
    leaves a live peer on the node or says so, and must not take the node out of the plan."""
    dead_by_node: dict[str, list[dict]] = {}
    for status in broken:
        if status["state"] == "dead":
            dead_by_node.setdefault(status["node_id"], []).append(status)
    lost = set()
    for node, dead in dead_by_node.items():
        if len(dead) < node_of_rank.count(node):
            continue  # a rank on that node is alive
        said_node = any(NODE_DIED in (s.get("error") or "") for s in dead)
        if said_node or len(dead) > 1:
            lost.add(node)
    return lost


# How Ray words an actor's death when its node died (ray/_raylet, gcs_server in Ray 2.60).
NODE_DIED = "because its node has died"


def broken_statuses(statuses: list[dict]) -> list[dict]:
    return [s for s in statuses if s["state"] in ("failed", "dead", "unresponsive")]
