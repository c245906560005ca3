"""Forming and recovering the rank group, the coordinator's hands: (re)form the group at a
decided layout from the right checkpoint, react to dead or hung ranks, drain (checkpoint at the
next step boundary) before a planned resize or a stop, and fire node-level chaos. The
deadlines of formations, hangs and drains come from `control/deadlines.py`.

A mixin of `Coordinator` (it shares the coordinator's run state); the state machine and the
decisions stay in `coordinator.py`.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from raytrain_dt.checkpoint.digests import verification_shares
from raytrain_dt.checkpoint.store import CheckpointRef
from raytrain_dt.control.checkpoint_tracker import CheckpointTracker
from raytrain_dt.control.cluster import NodeInfo
from raytrain_dt.control.deadlines import Bound
from raytrain_dt.control.placement import counts_by_node
from raytrain_dt.control.policies import Resize
from raytrain_dt.control.recovery_timing import RecoveryTimer
from raytrain_dt.control.run_setup import planned_checkpoint_bytes, rank_specs
from raytrain_dt.control.states import (
    Draining,
    Failed,
    Resizing,
    Restarting,
    Running,
    State,
    Stopped,
    Waiting,
)

log = logging.getLogger("raytrain_dt.control.coordinator")

POLL_INTERVAL_S = 0.1
FAILED_TEARDOWN_GRACE_S = 0.2
CHAOS_ARRIVAL_WAIT_S = 30.0


class GroupRecovery:
    # --- executing a Resize: (re)form the group ----------------------------------------------
    def _form(self, state: Resizing | Restarting) -> State:
        decision = state.decision
        started = time.perf_counter()
        old = self.layout or self.previous_layout
        if self.group.slots and not self.group_left:
            self._leave_layout()
        nodes = {n.node_id: n.accelerators for n in self._observe("ok").nodes}
        try:
            counts = counts_by_node(decision.layout.dims.world_size, decision.layout.dims.tp,
                                    [(n, nodes[n]) for n in decision.nodes if n in nodes])  # fmt: skip
        except ValueError:  # capacity went since the decision (a node, an actor): re-plan
            log.warning("no room for %s any more: re-planning", decision.layout.describe())
            return self._decide(self._observe("failed" if isinstance(state, Restarting) else "ok"))
        planned_bytes = planned_checkpoint_bytes(
            self.cfg, self.shape, decision.layout, self.resource == "GPU"
        )
        will_load = self._resume_point()[0] is not None  # metadata only: verified once formed
        bound = self.deadlines.formation_bound(
            decision.layout.dims.world_size, will_load, planned_bytes
        )
        forming = time.perf_counter()  # the deadline's clock: after the old layout has left

        def remaining_s() -> float:
            return max(0.0, bound.seconds - (time.perf_counter() - forming))

        try:
            self.group.form(
                counts, self.cfg.cluster.placement_timeout_s, start_timeout_s=bound.seconds
            )
            formed = time.perf_counter()
            resume, resume_step = self._verified_resume_point(remaining_s)
            verified = time.perf_counter()
            self.recovery.verified(verified - formed)
            self.recorder.rewind(resume_step)
            # Rank faults before the resume point are past; node actions fire when the driver
            # reaches them (they may have waited for an arrival to be in use).
            self.chaos.mark_rank_faults_fired(resume_step)
            cfg = replace(self.cfg, chaos=self.chaos.remaining())
            specs = rank_specs(
                cfg,
                self.shape,
                decision.layout,
                self.dataset,
                self.group.master_endpoint(),
                self.checkpoint_root,
                resume,
                self.model_spec,
            )
            setup = self.group.call("setup", [(s,) for s in specs], timeout_s=remaining_s())
        except TimeoutError as exc:
            return self._formation_timed_out(decision, bound, exc)
        self.layout, self.layout_nodes = decision.layout, tuple(sorted(counts))
        self.formed = True
        self.step = resume_step
        self.bar.n = resume_step
        self.tracker = CheckpointTracker(
            self.store,
            decision.layout.dims.world_size,
            self.recorder,
            self.cfg.checkpoint.keep_last,
            self.cfg.checkpoint.keep_every,
            self.deadlines.checkpoint_committed,
        )
        self.last_progress = self.last_formed_at = time.time()
        plan = self._last_plan  # the decision's layout is the best of the latest plan
        predicted = (
            plan.best.step_time.total_s if plan and plan.best.layout == decision.layout else None
        )
        self.deadlines.formed(
            predicted_step_s=predicted,
            setup_s=time.perf_counter() - formed,
            world_size=decision.layout.dims.world_size,
            checkpoint_bytes=planned_bytes,
        )
        self.timings.append(
            {
                "kind": type(state).__name__.lower(),
                "form_s": formed - started,
                "setup_s": time.perf_counter() - verified,
                "ranks": setup,
            }
        )
        (self.run_dir / "layout.json").write_text(json.dumps(decision.layout.as_dict(), indent=2))
        if self._last_plan is not None:
            (self.run_dir / "plan.json").write_text(json.dumps(self._last_plan.to_json(), indent=2))
        self.recorder.event(
            "resize" if old is not None else "start", reason=decision.reason,
            old_layout=old.as_dict() if old else None, new_layout=decision.layout.as_dict(),
            resumed_from=resume.uri if resume else None, resumed_step=resume_step,
            lost_steps=max(0, self._failure_step - resume_step) if isinstance(state, Restarting) else 0,
            form_s=formed - started, setup_s=time.perf_counter() - verified,
            node_ids=[s.node_id for s in self.group.slots], rank_setup=setup,
            pids=[s.pid for s in self.group.slots],
            **self.recovery.formed(formed - started, setup),
        )  # fmt: skip
        self.recorder.model_built(setup)
        # The next incident is timed afresh; this one's clock runs on to the first step.
        self._formation_timer, self.recovery = self.recovery, RecoveryTimer()
        self.group.call("start")  # after the event: no step may precede its formation's record
        self.group_left = False
        return Running()

    def _formation_timed_out(self, decision: Resize, bound: Bound, exc: TimeoutError) -> State:
        """The formation missed its deadline. The run stops with its checkpoints intact and
        the reason; this is the one place a retry elsewhere would go."""
        reason = (
            f"elastic.formation_timeout_s: forming {decision.layout.describe()} took more "
            f"than {bound.seconds:.0f}s ({bound.detail}): {exc}"
        )
        self.recorder.event(
            "failure", health="formation_timeout", step=self.step, ranks={}, **bound.fields()
        )
        log.error("%s", reason)
        return Failed(reason)

    def _verified_resume_point(
        self, remaining_s: Callable[[], float]
    ) -> tuple[CheckpointRef | None, int]:
        """The checkpoint to resume from, its files verified by the formed group's ranks before
        any loads it: each rank hashes a disjoint share (in parallel; the driver reads no
        checkpoint byte). A damaged one is marked so and the previous committed one tried."""
        while True:
            ref, step = self._resume_point()
            if ref is None:
                return ref, step
            shares = verification_shares(ref.record["files"], self.group.world_size)
            answers = self.group.call(
                "verify_checkpoint", [(ref.uri, share) for share in shares], timeout_s=remaining_s()
            )
            problems = [line for answer in answers for line in answer]
            if not problems:
                return ref, step
            self.store.mark_damaged(ref, problems)
            self.recorder.event(
                "checkpoint_damaged", step=ref.step, path=ref.uri, problems=problems
            )

    def _leave_layout(self, grace_s: float = 2.0) -> None:
        """Tear the group's actors down (they stay for the next layout), collect the reports
        of saves that finished meanwhile (they decide what is committed), and let go of the
        actors that cannot be reused (hung or dead). `grace_s`: how long a rank's loop may
        take to end (a healthy one: to its next step boundary)."""
        broken = self.group.try_call("teardown", timeout_s=30, args=(grace_s,))
        self._handle_reports(self.group.poll())
        self.group.drop(broken)
        self.group_left = True

    def _warm_capacity(self, nodes: tuple[NodeInfo, ...],
                       draining: frozenset[str]) -> tuple[NodeInfo, ...]:  # fmt: skip
        """Start actors ahead of need where a node has room for more than the group has
        there (a dead rank's replacement, a node that joined), up to the ranks the run can
        use; and show the policy only capacity with started actors. So a failure re-forms at
        once on the survivors, an arrival is planned for once its actors have imported torch,
        and either grows the group through the normal grow path (a just-in-time checkpoint at
        a step boundary) once the new actors are warm: all of them, so that it grows once
        (while a group runs, the policy sees only its ranks until then; after a failure, a
        node without survivors shows once its actors are all up)."""
        if not self.formed:
            return nodes  # the first formation starts its actors itself
        self.group.drop_spares({a.node_id for a in [*self.group.idle, *self.group.starting]}
                               - {n.node_id for n in nodes})  # fmt: skip
        self.group.collect_warm()
        if self._recovering_on_survivors():
            # Survivors re-form first and replacements start after its first step: a new
            # actor's start (a Python process importing torch) would take the CPU the
            # re-formation needs (on a shared host, or where CPUs are few). Plan for the
            # actors that have started.
            started = {n.node_id: self.group.actors_on(n.node_id) - self.group.starting_on(n.node_id)
                       for n in nodes}  # fmt: skip
            shown = [
                replace(n, accelerators=min(n.accelerators, started[n.node_id])) for n in nodes
            ]
            return tuple(n for n in shown if n.accelerators > 0)
        usable = [n for n in nodes if n.node_id not in draining]
        budget = self.cfg.cluster.num_ranks or sum(n.accelerators for n in usable)
        budget -= self.group.actor_count()
        for node in usable:
            room = min(node.accelerators - self.group.actors_on(node.node_id), budget)
            if room > 0:
                self.group.warm(node.node_id, room)
                budget -= room
        if not (self.group.slots or self.group.idle):
            return nodes  # nothing else could train sooner: the formation waits for them
        if self.group.starting and self.layout is not None:
            # A running group grows once every actor being started is up: one resize.
            ranks = Counter(s.node_id for s in self.group.slots)
            return tuple(
                replace(n, accelerators=ranks[n.node_id]) for n in nodes if ranks[n.node_id]
            )
        survivors = {s.node_id for s in self.group.slots}
        shown = [replace(n, accelerators=n.accelerators - self.group.starting_on(n.node_id))
                 for n in nodes if n.node_id in survivors or not self.group.starting_on(n.node_id)]  # fmt: skip
        return tuple(n for n in shown if n.accelerators > 0)

    def _recovering_on_survivors(self) -> bool:
        """Reusable actors are being re-formed (after a failure: no layout runs) or their new
        layout has not completed its first step. Not while waiting: the survivors were too
        few to train, and the capacity they wait for must be started."""
        if not (self.group.slots or self.group.idle) or isinstance(self.state, Waiting):
            return False
        return self.layout is None or self._formation_timer is not None

    @property
    def _failure_step(self) -> int:
        return max(self.step, self.failed_step)

    def _on_failure(self, health: str, broken: list[dict], bound: Bound | None = None) -> State:
        """`bound`: the deadline a hung group missed (recorded with the failure)."""
        self.recovery.cause(self._last_healthy)
        self._shrunk_at = self._last_healthy
        if health == "failed":
            broken = self._settle(broken)
        errors = {s["rank"]: (s.get("error") or s["state"]).strip().splitlines()[0] for s in broken}
        # Actors that died with their node mark the node lost before Ray's health check does.
        lost = lost_with_node(broken, [s.node_id for s in self.group.slots])
        lost |= set(self.layout_nodes) - {n.node_id for n in self.cluster.nodes()}
        self.lost_nodes |= lost
        missed = {}  # the deadline a hung group missed, and how long it had gone without a step
        if bound is not None:
            missed = {**bound.fields(), "since_step_s": round(time.time() - self.last_progress, 3)}
        self.recorder.event("failure", health=health, step=self.step, ranks=errors, **missed)
        log.warning("ranks %s %s at step %d: %s", sorted(errors), health, self.step + 1, errors)
        # A lost node is not the step's fault: only the training's own failures repeat.
        self.streak.failed(self.step, training_fault=not lost)
        self.failed_step = self.step
        self.restarts += 1
        self.chaos.mark_rank_faults_fired(self.step + 1)
        if health == "hung":  # threads stuck in a collective cannot be reused: replace all
            self.group.drop(list(range(self.group.world_size)))
        else:  # dead ones go; survivors are torn down now, so the plan counts only reusable ones
            self.group.drop([s["rank"] for s in broken if s["state"] != "failed"])
            # A survivor still "running" once the failure has settled is stuck in a collective
            # with a failed peer (gloo waits out its timeout): no use waiting for its loop. Its
            # teardown still lets its save in flight finish, then it is replaced (in the
            # background).
            self._leave_layout(grace_s=FAILED_TEARDOWN_GRACE_S)
        # No group trains now: the policy plans from scratch (and Waiting cannot mistake an
        # idle group for a finished one).
        self.previous_layout, self.layout, self.layout_nodes = self.layout, None, ()
        return self._decide(self._observe(health))

    def _settle(self, broken: list[dict], wait_s: float = 5.0, quiet_s: float = 0.3) -> list[dict]:
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
        bound = self.deadlines.drain_bound(saving=bool(self.tracker.in_flight))
        deadline = time.time() + bound.seconds
        while True:
            if time.time() > deadline:
                log.warning(
                    "no drain within %.0fs (%s): the group is hung", bound.seconds, bound.detail
                )
                return self._on_failure("hung", [], bound)
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
        self.group.drop_spares(self.draining)
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
        # Nor before the layout has committed a checkpoint of its own (so that each fault hits
        # a layout that has trained, and rewinds at most to its own checkpoint), nor while
        # actors are warmed for a grow back after a rank failure.
        if (
            self.tracker.last_committed is None
            and time.time() - self.last_formed_at < CHAOS_ARRIVAL_WAIT_S
        ):
            return
        if (self.group.starting or self.group.idle) and (
            time.time() - self.last_formed_at < CHAOS_ARRIVAL_WAIT_S
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
