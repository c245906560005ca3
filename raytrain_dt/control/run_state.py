"""What the run knows, in one place: the layout that trains, its progress, its failures and
the nodes it must avoid. The coordinator owns one `RunState`; its parts (formation, recovery,
capacity, report intake) read and update it instead of each other's attributes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from raytrain_dt.control.policies import FailureStreak
from raytrain_dt.control.recovery_timing import RecoveryTimer
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.plan_result import Plan


@dataclass
class RunState:
    # --- the group's layout ----------------------------------------------------------------
    # The running layout: None while no group is formed (before the first formation, after a
    # failure), so the policy plans from scratch and Waiting cannot mistake an idle group for
    # a finished one.
    layout: Layout | None = None
    layout_nodes: tuple[str, ...] = ()  # the nodes it uses, sorted
    # The layout before: reports the old group still sends after a failure are read with it.
    previous_layout: Layout | None = None
    # A formation has succeeded: later ones resume from the newest checkpoint even when the
    # run started fresh (resume=false).
    formed: bool = False
    # The group's actors have left their layout (torn down): a formation need not again.
    group_left: bool = False
    # The actors (`actor_index`) of the latest formed layout: the next one's `kept_actors`.
    layout_actors: set[int] = field(default_factory=set)
    # The latest plan: the decision's layout is its best, and plan.json records it.
    last_plan: Plan | None = None

    # --- progress --------------------------------------------------------------------------
    step: int = 0  # the last step completed (rank 0's report)
    last_progress: float = 0.0  # time.time() of that report: hang detection
    # time.time() a rank last reported its share of a save written (or failed): a save that
    # leaves flight is progress too, so the step's hang bound counts from it (the ranks finish
    # or step again after it, not within a step of the step before it).
    last_save_written: float = 0.0
    last_formed_at: float = 0.0  # time.time() of the latest formation: chaos pacing

    # --- failures --------------------------------------------------------------------------
    restarts: int = 0
    # The last completed step at the latest failure: the steps a restart loses.
    failed_step: int = -1
    # Failures at the same step in a row: a deterministic fault fails the run.
    streak: FailureStreak = field(default_factory=FailureStreak)
    # perf_counter of the last poll that found every rank healthy: a failure's clock starts
    # there.
    last_healthy: float = field(default_factory=time.perf_counter)
    # perf_counter of the latest failure: a grow back onto a dead rank's replacement is timed
    # from it.
    shrunk_at: float = float("-inf")

    # --- nodes -----------------------------------------------------------------------------
    # Nodes under a preemption notice: drained at the next step boundary, then left out.
    draining: set[str] = field(default_factory=set)
    # Nodes whose actors died with their node: excluded before Ray's health check says so.
    lost_nodes: set[str] = field(default_factory=set)
    # Nodes that could not host their ranks within cluster.placement_timeout_s in a
    # re-formation, left out of the plans until time.time() passes the value.
    benched_nodes: dict[str, float] = field(default_factory=dict)
    # The node set seen last and since when (time.time()): growth waits for it to be stable.
    nodes_key: tuple[str, ...] | None = None
    nodes_since: float = 0.0
    last_cluster_check: float = 0.0  # time.time(); 0 makes the next watch decide at once
    capacity_requested: list[dict] = field(default_factory=list)  # asked of the autoscaler

    # --- timings ---------------------------------------------------------------------------
    timings: list[dict] = field(default_factory=list)  # one per formation (`RunResult`)
    # The incident being timed (its cause onwards), and the formation's once it has formed:
    # that one runs on until the first step at the new layout.
    incident: RecoveryTimer = field(default_factory=RecoveryTimer)
    formation_timer: RecoveryTimer | None = None

    @property
    def failure_step(self) -> int:
        """The furthest step trained before the latest failure."""
        return max(self.step, self.failed_step)

    @property
    def last_alive(self) -> float:
        """time.time() of the group's latest progress, a step or a save written: the hang
        bound is held against the time since."""
        return max(self.last_progress, self.last_save_written)

    def left_layout(self) -> None:
        """No group trains any more (a failure): plan from scratch. After a failed formation
        the layout before stays the previous one (the next resize's old layout)."""
        if self.layout is not None:
            self.previous_layout = self.layout
        self.layout, self.layout_nodes = None, ()
