"""Forming the rank group at a decided layout: place its ranks on the nodes, start and order
the actors, verify the checkpoint to resume from (on the ranks), hand each rank its spec and
wait for every rank's set-up, all within the formation's deadline (`control/deadlines.py`).

`Formation.form` takes what it needs explicitly and returns a `Formed` result, or raises
`NoRoomForLayout` (re-plan), `FormationFault` (a rank or node lost on the way: the group's,
re-planned as a failure) or `FormationTimedOut` (the run fails with the reason);
`Formation.record` then writes a formed group into the run's state, files and events.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from raytrain_dt.checkpoint.digests import verification_shares
from raytrain_dt.checkpoint.store import CheckpointRef, CheckpointStore
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.control.checkpoint_tracker import CheckpointTracker
from raytrain_dt.control.copy_holders import CopyHolders, is_memory_point
from raytrain_dt.control.deadlines import Bound, Deadlines
from raytrain_dt.control.group import RankGroupLike
from raytrain_dt.control.node_chaos import Chaos
from raytrain_dt.control.placement import counts_by_node
from raytrain_dt.control.policies import Resize
from raytrain_dt.control.recovery_timing import RecoveryTimer
from raytrain_dt.control.run_setup import planned_checkpoint_bytes, rank_specs
from raytrain_dt.control.run_state import RunState
from raytrain_dt.control.states import Resizing, Restarting
from raytrain_dt.models.model_spec import ModelSpec
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.observe.metrics import RunRecorder
from raytrain_dt.topology.layout import Layout

log = logging.getLogger("raytrain_dt.control.coordinator")

# The checkpoint a formation resumes from and its step (None, 0: start fresh).
ResumePoint = tuple[CheckpointRef | None, int]


class NoRoomForLayout(Exception):
    """The capacity the decision counted on went (a node, an actor): re-plan."""


class FormationTimedOut(Exception):
    """The formation missed its deadline; `bound` is the deadline it had."""

    def __init__(self, reason: str, bound: Bound):
        super().__init__(reason)
        self.reason, self.bound = reason, bound


@dataclass(frozen=True)
class Formed:
    counts: dict[str, int]  # node id -> ranks there
    resume: CheckpointRef | None  # what the ranks loaded (None: a fresh start)
    resume_step: int
    rank_setup: list[dict]  # each rank's set-up timings, in rank order
    checkpoint_bytes: float  # the planned checkpoint size (for save deadlines)
    # perf_counter when the group was formed (actors placed and ordered) and when the resume
    # checkpoint had been verified (set-up began).
    formed_at: float
    verified_at: float


@dataclass
class Formation:
    """What every formation of the run shares; `form` takes what differs between them."""

    cfg: TrainConfig
    run_dir: Path  # where layout.json and plan.json go
    shape: ModelShape
    model_spec: ModelSpec
    dataset: object  # handed through to the ranks' data slices
    checkpoint_root: str
    store: CheckpointStore
    resource: str
    group: RankGroupLike
    deadlines: Deadlines
    recorder: RunRecorder
    copies: CopyHolders | None = None  # the ranks' in-memory copies (memory_every_steps)

    def form(
        self,
        decision: Resize,
        capacity: dict[str, int],
        resume_point: Callable[[], ResumePoint],
        chaos: Chaos,
        incident: RecoveryTimer,
        begun_step: int,
    ) -> Formed:
        """Form the group at `decision.layout` on `capacity` (node id -> accelerators).
        `begun_step`: the furthest step the run has begun (chaos `at: forming` fires in the
        first formation once it reaches an action's step). A rank or node lost on the way
        raises `FormationFault` (from the group), which the coordinator re-plans."""
        dims = decision.layout.dims
        try:
            usable = [(n, capacity[n]) for n in decision.nodes if n in capacity]
            counts = counts_by_node(dims.world_size, dims.tp, usable)
        except ValueError as exc:
            raise NoRoomForLayout(f"no room for {decision.layout.describe()} any more") from exc
        planned_bytes = planned_checkpoint_bytes(
            self.cfg, self.shape, decision.layout, self.resource == "GPU"
        )
        will_load = resume_point()[0] is not None  # metadata only: verified once formed
        bound = self.deadlines.formation_bound(dims.world_size, will_load, planned_bytes)
        forming = time.perf_counter()  # the deadline's clock: after the old layout has left

        def remaining_s() -> float:
            return max(0.0, bound.seconds - (time.perf_counter() - forming))

        try:
            self.group.form(
                counts, self.cfg.cluster.placement_timeout_s, start_timeout_s=bound.seconds
            )
            formed = time.perf_counter()
            chaos.fire_forming(begun_step, self._node_of_rank)
            resume, resume_step = self._verified_resume_point(resume_point, remaining_s)
            verified = time.perf_counter()
            incident.verified(verified - formed)
            self.recorder.rewind(resume_step)
            # Rank faults before the resume point are past; node actions fire when the driver
            # reaches them (they may have waited for an arrival to be in use).
            chaos.mark_rank_faults_fired(resume_step)
            cfg = replace(self.cfg, chaos=chaos.for_formation(begun_step))
            specs = rank_specs(
                cfg,
                self.shape,
                decision.layout,
                self.dataset,
                self.group.master_endpoint(timeout_s=remaining_s()),
                self.checkpoint_root,
                resume,
                self.model_spec,
            )
            # A peer lost before it joins holds the others at most for the time left.
            specs = [replace(spec, join_timeout_s=remaining_s()) for spec in specs]
            if self.copies is not None:
                specs = self.copies.assign_peers(specs, self.group.slots)
            setup = self.group.setup(specs, timeout_s=remaining_s())
        except TimeoutError as exc:
            reason = (
                f"elastic.formation_timeout_s: forming {decision.layout.describe()} took more "
                f"than {bound.seconds:.0f}s ({bound.detail}): {exc}"
            )
            raise FormationTimedOut(reason, bound) from exc
        return Formed(counts, resume, resume_step, setup, planned_bytes, formed, verified)

    def _node_of_rank(self, rank: int) -> str:
        return self.group.slots[min(rank, self.group.world_size - 1)].node_id

    def record(
        self,
        run: RunState,
        state: Resizing | Restarting,
        formed: Formed,
        old: Layout | None,
        started: float,
    ) -> CheckpointTracker:
        """Record a formation in the run's state, its files and its events; returns the new
        layout's checkpoint tracker. `old`: the layout before; `started`: perf_counter when
        the formation began (the old layout still to leave)."""
        decision, layout = state.decision, state.decision.layout
        run.layout, run.layout_nodes = layout, tuple(sorted(formed.counts))
        run.formed = True
        run.step = formed.resume_step
        tracker = CheckpointTracker(
            self.store,
            layout.dims.world_size,
            self.recorder,
            self.cfg.checkpoint.keep_last,
            self.cfg.checkpoint.keep_every,
            self.deadlines.checkpoint_committed,
        )
        run.last_progress = run.last_formed_at = time.time()
        plan = run.last_plan  # the decision's layout is the best of the latest plan
        predicted = plan.best.step_time.total_s if plan and plan.best.layout == layout else None
        setup_s = time.perf_counter() - formed.verified_at
        self.deadlines.formed(
            predicted_step_s=predicted,
            setup_s=time.perf_counter() - formed.formed_at,
            world_size=layout.dims.world_size,
            checkpoint_bytes=formed.checkpoint_bytes,
        )
        form_s = formed.formed_at - started
        run.timings.append(
            {
                "kind": type(state).__name__.lower(),
                "form_s": form_s,
                "setup_s": setup_s,
                "ranks": formed.rank_setup,
            }
        )
        (self.run_dir / "layout.json").write_text(json.dumps(layout.as_dict(), indent=2))
        if plan is not None:
            (self.run_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=2))
        lost = max(0, run.failure_step - formed.resume_step)
        # The actors the last recorded layout trained on, kept by this one; the rest are new.
        actors = [s.actor_index for s in self.group.slots]
        kept = [a for a in actors if a in run.layout_actors]
        run.layout_actors = set(actors)
        self.recorder.event(
            "resize" if old is not None else "start",
            reason=decision.reason,
            old_layout=old.as_dict() if old else None,
            new_layout=layout.as_dict(),
            resumed_from=formed.resume.uri if formed.resume else None,
            resumed_step=formed.resume_step,
            lost_steps=lost if isinstance(state, Restarting) else 0,
            form_s=form_s,
            setup_s=time.perf_counter() - formed.verified_at,
            node_ids=[s.node_id for s in self.group.slots],
            rank_setup=formed.rank_setup,
            pids=[s.pid for s in self.group.slots],
            kept_actors=kept,
            new_actors=[a for a in actors if a not in kept],
            # The in-memory copies when the layout changed: bytes held, the slowest recent
            # copy, the boundaries skipped while one was in flight.
            **(self.copies.stats() if self.copies else {}),
            **run.incident.formed(form_s, formed.rank_setup),
        )
        self.recorder.model_built(formed.rank_setup)
        # The next incident is timed afresh; this one's clock runs on to the first step.
        run.formation_timer, run.incident = run.incident, RecoveryTimer()
        return tracker

    def _verified_resume_point(
        self, resume_point: Callable[[], ResumePoint], remaining_s: Callable[[], float]
    ) -> ResumePoint:
        """The checkpoint to resume from, its files verified by the formed group's ranks before
        any loads it: each rank hashes a disjoint share (in parallel; the driver reads no
        checkpoint byte). A damaged one is marked so and the previous committed one tried."""
        while True:
            ref, step = resume_point()
            if ref is None or is_memory_point(ref):  # copies in host memory: nothing stored
                return ref, step
            shares = verification_shares(ref.record["files"], self.group.world_size)
            answers = self.group.verify_checkpoint(ref.uri, shares, timeout_s=remaining_s())
            problems = [line for answer in answers for line in answer]
            if not problems:
                return ref, step
            self.store.mark_damaged(ref, problems)
            self.recorder.event(
                "checkpoint_damaged", step=ref.step, path=ref.uri, problems=problems
            )
