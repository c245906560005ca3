"""Forming the rank group at a decided layout: place its ranks on the nodes, start and order
the actors, verify the checkpoint to resume from (on the ranks), hand each rank its spec and
wait for every rank's set-up, all within the formation's deadline (`control/deadlines.py`).

`Formation.form` takes what it needs explicitly and returns a `Formed` result, or raises
`NoRoomForLayout` (re-plan) or `FormationTimedOut` (the run fails with the reason). Recording
the formation in the run's state and events is the coordinator's part.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from raytrain_dt.checkpoint.digests import verification_shares
from raytrain_dt.checkpoint.store import CheckpointRef, CheckpointStore
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.control.chaos import Chaos
from raytrain_dt.control.deadlines import Bound, Deadlines
from raytrain_dt.control.group import RankGroupLike
from raytrain_dt.control.placement import counts_by_node
from raytrain_dt.control.policies import Resize
from raytrain_dt.control.recovery_timing import RecoveryTimer
from raytrain_dt.control.run_setup import planned_checkpoint_bytes, rank_specs
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.models.spec import ModelSpec
from raytrain_dt.observe.metrics import RunRecorder

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
    shape: ModelShape
    model_spec: ModelSpec
    dataset: object  # handed through to the ranks' data slices
    checkpoint_root: str
    store: CheckpointStore
    resource: str
    group: RankGroupLike
    deadlines: Deadlines
    recorder: RunRecorder

    def form(
        self,
        decision: Resize,
        capacity: dict[str, int],
        resume_point: Callable[[], ResumePoint],
        chaos: Chaos,
        incident: RecoveryTimer,
    ) -> Formed:
        """Form the group at `decision.layout` on `capacity` (node id -> accelerators)."""
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
            resume, resume_step = self._verified_resume_point(resume_point, remaining_s)
            verified = time.perf_counter()
            incident.verified(verified - formed)
            self.recorder.rewind(resume_step)
            # Rank faults before the resume point are past; node actions fire when the driver
            # reaches them (they may have waited for an arrival to be in use).
            chaos.mark_rank_faults_fired(resume_step)
            cfg = replace(self.cfg, chaos=chaos.remaining())
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
            setup = self.group.setup(specs, timeout_s=remaining_s())
        except TimeoutError as exc:
            reason = (
                f"elastic.formation_timeout_s: forming {decision.layout.describe()} took more "
                f"than {bound.seconds:.0f}s ({bound.detail}): {exc}"
            )
            raise FormationTimedOut(reason, bound) from exc
        return Formed(counts, resume, resume_step, setup, planned_bytes, formed, verified)

    def _verified_resume_point(
        self, resume_point: Callable[[], ResumePoint], remaining_s: Callable[[], float]
    ) -> ResumePoint:
        """The checkpoint to resume from, its files verified by the formed group's ranks before
        any loads it: each rank hashes a disjoint share (in parallel; the driver reads no
        checkpoint byte). A damaged one is marked so and the previous committed one tried."""
        while True:
            ref, step = resume_point()
            if ref is None:
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
