"""Recovering the rank group: react to dead or hung ranks (settle, record, drop what cannot be
reused), drain (checkpoint at the next step boundary and stop there) before a planned resize
or a stop, and tear a layout down. The deadlines of hangs and drains come from
`control/deadlines.py`.

Handlers return the next state and never decide: where a decision is due they return
`Deciding` (a failure's health, or a finished drain), and the coordinator asks the policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from raytrain_dt.checkpoint.store import CheckpointStore
from raytrain_dt.control.cluster import ClusterView
from raytrain_dt.control.copy_holders import CopyHolders, live_actors
from raytrain_dt.control.deadlines import LEAVE_FLOOR_S, Bound, Deadlines
from raytrain_dt.control.group import NODE_DIED, FormationFault, PlacementTimedOut, RankGroupLike
from raytrain_dt.control.node_chaos import Chaos
from raytrain_dt.control.run_state import RunState
from raytrain_dt.control.states import Deciding, Draining, State, Stopped
from raytrain_dt.observe.metrics import RunRecorder
from raytrain_dt.worker.reports import RankStatus

log = logging.getLogger("raytrain_dt.control.coordinator")

POLL_INTERVAL_S = 0.1
# What a teardown call may take beyond its ranks' loops: a save in flight finishing (5 s in
# `RankWorker.teardown`) and the layout's release.
TEARDOWN_FIXED_S = 30.0


@dataclass
class Recovery:
    run: RunState
    group: RankGroupLike
    cluster: ClusterView
    recorder: RunRecorder
    chaos: Chaos
    deadlines: Deadlines
    store: CheckpointStore
    # Takes the reports in a poll's statuses (the coordinator's report intake).
    absorb: Callable[[list[RankStatus]], None]
    copies: CopyHolders | None = None  # the ranks' in-memory copies (memory_every_steps)
    # The steps of the durable saves still in flight (the formed layout's checkpoint tracker).
    saves_in_flight: Callable[[], set[int]] = set

    def leave_layout(self, failed: bool = False, keep_save: bool = True) -> None:
        """Tear the group's actors down (they stay for the next layout), collect the reports
        of saves that finished meanwhile (they decide what is committed), and let go of the
        actors that cannot be reused (hung or dead). `failed`: the layout is broken (a rank
        failed or died): no rank's step in progress can finish, so each aborts its
        communicators at once instead of first giving its loop a grace to reach a step
        boundary. `keep_save` False: a durable save in flight is abandoned, not waited for
        (`_drop_dead_then_leave`)."""
        # A planned leave (after a drain) gives a loop still running LEAVE_FLOOR_S to end at a
        # step boundary. After it, or at once on a failure, a loop still running is blocked (in
        # a collective with a dead or hung peer: on NCCL it would stay blocked until the abort)
        # or mid-step: its communicators are aborted, so it raises at its next collective, and
        # it has a step to return (`Deadlines.leave_bound`), so a survivor of a slow step is
        # kept, not replaced as stuck. Every rank leaves in the same round: a rank whose loop
        # failed has already aborted its own groups (`RankWorker._run`), which on NCCL releases
        # a peer blocked on it; on gloo, whose abort leaves a sub-group's connections open,
        # they close when that rank's old layout is collected (docs/design.md).
        grace_s = 0.0 if failed else LEAVE_FLOOR_S
        return_s = self.deadlines.leave_bound().seconds
        # The teardown call's own bound: the loop's grace, a set-up's, the aborted loop's
        # return, a save in flight (`RankWorker.teardown`), and the freeing.
        timeout_s = TEARDOWN_FIXED_S + 2 * grace_s + return_s
        broken = self.group.teardown(grace_s, timeout_s, keep_save=keep_save, return_s=return_s)
        self.absorb(self.group.poll())
        self.group.drop(sorted(broken))
        self.run.group_left = True

    def on_failure(
        self, health: str, broken: list[RankStatus], bound: Bound | None = None
    ) -> Deciding:
        """Ranks failed ("failed") or the group hung ("hung"; `bound`: the deadline it
        missed, recorded with the failure). Returns the decision due."""
        run = self.run
        run.incident.cause(run.last_healthy)
        run.incident.detected(time.perf_counter())
        run.shrunk_at = run.last_healthy
        leaving = time.perf_counter()
        if health == "failed":
            broken = self.settle(broken)
        errors = {s.rank: (s.error or s.state).strip().splitlines()[0] for s in broken}
        # Actors that died with their node mark the node lost before Ray's health check does.
        lost = lost_with_node(broken, [s.node_id for s in self.group.slots])
        lost |= set(run.layout_nodes) - {n.node_id for n in self.cluster.nodes()}
        run.lost_nodes |= lost
        # The deadline a hung group missed, how long it had gone without progress (a step or a
        # save written: what the bound is held against) and without a step.
        missed = {}
        if bound is not None:
            now = time.time()
            missed = {
                **bound.fields(),
                "since_progress_s": round(now - run.last_alive, 3),
                "since_step_s": round(now - run.last_progress, 3),
            }
        self.recorder.event("failure", health=health, step=run.step, ranks=errors, **missed)
        log.warning("ranks %s %s at step %d: %s", sorted(errors), health, run.step + 1, errors)
        # A lost node is not the step's fault: only the training's own failures repeat.
        run.streak.failed(run.step, training_fault=not lost)
        run.failed_step = run.step
        run.restarts += 1
        self.chaos.mark_rank_faults_fired(run.step + 1)
        if health == "hung":  # threads stuck in a collective cannot be reused: replace all
            self.group.drop(list(range(self.group.world_size)))
        else:  # dead ones go; survivors are torn down now, so the plan counts only reusable ones
            # A survivor still "running" once the failure has settled is mid-step, or blocked
            # in a collective with a peer that failed or died: it aborts at once.
            self._drop_dead_then_leave(broken)
        run.incident.left_layout(time.perf_counter() - leaving)
        run.left_layout()
        return Deciding(health)

    def on_formation_fault(self, fault: FormationFault) -> Deciding:
        """Actors died while the group formed (a rank, or its node): a failure like any other.
        The dead actors go, their nodes are marked lost, the survivors leave whatever they had
        begun (set-up included) and wait for the re-plan."""
        run = self.run
        run.incident.cause(time.perf_counter())
        # By position: an actor that has not set up yet reports its previous layout's rank.
        statuses = [replace(s, rank=i) for i, s in enumerate(self.group.poll())]
        dead = [s for s in statuses if s.state == "dead"]
        lost = set(fault.nodes) | lost_with_node(dead, [s.node_id for s in self.group.slots])
        lost |= {a.node_id for a in [*self.group.slots, *self.group.idle]} - {
            n.node_id for n in self.cluster.nodes()
        }
        run.lost_nodes |= lost
        errors = {s.rank: (s.error or s.state).strip().splitlines()[0] for s in dead}
        self.recorder.event(
            "failure",
            health="failed",
            phase="forming",
            step=run.step,
            ranks=errors,
            detail=str(fault),
            lost_nodes=sorted(lost),
        )
        log.warning("a formation failed at step %d: %s; re-planning", run.step, fault)
        # A dead actor or node is not the step's fault; a rank's set-up that raised may be,
        # unless a peer of it died (the survivor's set-up often raises first: "connection
        # closed by peer", before Ray reports the death).
        run.streak.failed(run.step, training_fault=not (fault.actor_died or dead or lost))
        self.group.drop_spares(lost)
        self._drop_dead_then_leave([s for s in statuses if s.state != "running"])
        run.left_layout()
        return Deciding("failed")

    def on_placement_timeout(
        self, exc: PlacementTimedOut, bench_s: float, restarting: bool
    ) -> Deciding:
        """A node's ranks found no room within the placement time-out while the group
        re-formed (its resources still held, or the node going away): the next plans leave it
        out for `bench_s`, after which it counts as a node that has just arrived."""
        run = self.run
        run.benched_nodes[exc.node_id] = time.time() + bench_s
        self.recorder.event(
            "placement_timeout", step=run.step, node=exc.node_id, detail=str(exc), bench_s=bench_s
        )
        log.warning("%s: re-planning without that node for %.0fs", exc, bench_s)
        return Deciding("failed" if restarting else "ok")

    def _drop_dead_then_leave(self, broken: list[RankStatus]) -> None:
        """Let the dead ranks go, then tear the rest down at once (`leave_layout`, failed). A
        rank that was only slow to answer a poll (a loaded host) is torn down like any
        survivor: the teardown, not a poll's time-out, says whether it can be reused."""
        self.group.drop([s.rank for s in broken if s.state == "dead"])
        # A durable save still being written holds every survivor for up to its write time;
        # where the surviving in-memory copies are as new, the resume will not need it.
        live = live_actors([*self.group.slots, *self.group.idle])
        in_flight = self.saves_in_flight()
        superseded = self.copies is not None and self.copies.supersede(live, in_flight)
        if superseded:
            log.info(
                "saves in flight %s abandoned: newer in-memory copies survive", sorted(in_flight)
            )
        self.leave_layout(failed=True, keep_save=not superseded)

    def settle(
        self, broken: list[RankStatus], wait_s: float = 5.0, quiet_s: float = 0.3
    ) -> list[RankStatus]:
        """When one rank fails, its peers fail or die within moments (a lost node's ranks die
        together). Collect them before deciding, so the plan excludes every lost node: until
        no rank runs, or nothing changed for `quiet_s` (a peer stuck in a collective with the
        dead rank never reports; teardown deals with it). Where every node still has a rank
        that answers, no node is going away: one unchanged poll settles it."""
        deadline = time.time() + wait_s
        seen, changed = {s.rank for s in broken}, time.time()
        while time.time() < deadline and time.time() - changed < quiet_s:
            statuses = self.group.poll()
            self.absorb(statuses)
            broken = [s for s in statuses if s.state != "running"]
            if len(broken) == len(statuses) and all(s.state != "done" for s in broken):
                break
            if {s.rank for s in broken} != seen:
                seen, changed = {s.rank for s in broken}, time.time()
            elif every_node_answers(statuses):
                break
            time.sleep(POLL_INTERVAL_S)
        return broken_statuses(broken)

    def drain(self, state: Draining, saving: bool, stop_reason: str | None) -> State:
        """Save at the next step boundary and stop there; once it is committed, re-plan (or
        stop, with `stop_reason`). `saving`: a save is in flight (it lengthens the bound)."""
        run = self.run
        started = time.perf_counter()
        # Item 4 of issue 19: where every leaving rank's copy has a peer that stays, the state
        # stays in host memory (copies) and nothing goes through storage.
        in_memory = self.copies is not None and self.copies.cover_leaving(set(run.draining))
        self.group.request_checkpoint_and_stop(timeout_s=30, memory_only=in_memory)
        bound = self.deadlines.drain_bound(saving=saving)
        deadline = time.time() + bound.seconds
        while True:
            if time.time() > deadline:
                log.warning(
                    "no drain within %.0fs (%s): the group is hung", bound.seconds, bound.detail
                )
                return self.on_failure("hung", [], bound)
            statuses = self.group.poll()
            self.absorb(statuses)
            broken = broken_statuses(statuses)
            if broken:
                return self.on_failure("failed", broken)
            if all(s.state == "done" for s in statuses):
                if in_memory and self._copied_for_staying(run.step):
                    break
                latest = self.store.committed()
                if latest and latest[-1].step == run.step:
                    break
            time.sleep(POLL_INTERVAL_S)
        run.incident.drained(time.perf_counter() - started)
        self.recorder.event(
            "drained", step=run.step, reason=state.decision.reason, in_memory=in_memory
        )
        if stop_reason:
            log.warning(
                "stopped at step %d (%s); the same run.dir resumes from here", run.step, stop_reason
            )
            return Stopped(run.step, stop_reason)
        # Ranks on nodes under notice are not reused: let them go while their node still
        # answers (tearing down actors of a node being reclaimed waits on Ray's death notice).
        leaving = time.perf_counter()
        self.group.drop([r for r, s in enumerate(self.group.slots) if s.node_id in run.draining])
        self.group.drop_spares(run.draining)
        self.chaos.reclaim_preempted()  # the notice has been served: reclaim the node
        run.incident.left_layout(time.perf_counter() - leaving)
        # Nodes under notice are leaving: plan without them even before Ray reports them gone.
        run.lost_nodes |= run.draining
        run.draining.clear()
        # Re-plan now: the node under notice may be gone, or the capacity may have changed.
        return Deciding("ok", drained=state.decision)

    def _copied_for_staying(self, step: int) -> bool:
        """The copies of `step` are complete on actors not on nodes under notice."""
        staying = [s for s in self.group.slots if s.node_id not in self.run.draining]
        return self.copies.complete(step, live_actors([*staying, *self.group.idle]))


def lost_with_node(broken: list[RankStatus], node_of_rank: list[str]) -> set[str]:
    """Nodes whose every rank died and whose death Ray gave as the cause, or that held several
    ranks all dead at once. A rank that merely exited (its process died, its node lives)
    leaves a live peer on the node or says so, and must not take the node out of the plan."""
    dead_by_node: dict[str, list[RankStatus]] = {}
    for status in broken:
        if status.state == "dead":
            dead_by_node.setdefault(status.node_id, []).append(status)
    lost = set()
    for node, dead in dead_by_node.items():
        if len(dead) < node_of_rank.count(node):
            continue  # a rank on that node is alive
        said_node = any(NODE_DIED in (s.error or "") for s in dead)
        if said_node or len(dead) > 1:
            lost.add(node)
    return lost


def every_node_answers(statuses: list[RankStatus]) -> bool:
    """Each node holding a rank has one whose process answered the poll (a dead rank there
    died alone: its node lives, so no node-mate is about to follow it)."""
    nodes = {s.node_id for s in statuses}
    answered = {s.node_id for s in statuses if s.state not in ("dead", "unresponsive")}
    return nodes == answered


def broken_statuses(statuses: list[RankStatus]) -> list[RankStatus]:
    return [s for s in statuses if s.broken]
