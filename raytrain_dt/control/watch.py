"""Watching the running group: poll the ranks, take in their reports (progress, metrics and
the sample ledger, checkpoint saves for the tracker, preemption notices), and tell what comes
next: finished, a failure or a hang (handed to recovery), or a decision due (a periodic check
of the cluster). It fires the driver's node chaos as the run reaches its steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from raytrain_dt.control.checkpoint_tracker import CheckpointTracker
from raytrain_dt.control.copy_holders import CopyHolders
from raytrain_dt.control.deadlines import Deadlines
from raytrain_dt.control.group import RankGroupLike
from raytrain_dt.control.node_chaos import CHAOS_ARRIVAL_WAIT_S, Chaos
from raytrain_dt.control.recovery import POLL_INTERVAL_S, Recovery, broken_statuses
from raytrain_dt.control.run_state import RunState
from raytrain_dt.control.states import Deciding, Finished, Running, State
from raytrain_dt.observe.metrics import RunRecorder
from raytrain_dt.observe.progress import Progress
from raytrain_dt.topology.layout import Layout
from raytrain_dt.worker.reports import (
    MemoryCopyReport,
    RankStatus,
    SavedReport,
    SaveFailedReport,
    StepReport,
    StoppedReport,
)

log = logging.getLogger("raytrain_dt.control.coordinator")

# How often a running group's cluster is looked at for a decision (seconds).
CLUSTER_CHECK_INTERVAL_S = 0.5


@dataclass
class GroupWatch:
    run: RunState
    group: RankGroupLike
    recorder: RunRecorder
    deadlines: Deadlines
    chaos: Chaos
    progress: Progress
    # notice(node, source, detail): a preemption notice for a node the group uses.
    notice: Callable[[str, str, str], None]
    recovery: Recovery | None = None  # set once built (it takes this watch's reports)
    tracker: CheckpointTracker | None = None  # the formed layout's (one per formation)
    copies: CopyHolders | None = None  # where the ranks' in-memory copies are

    def handle_reports(self, statuses: list[RankStatus]) -> None:
        run = self.run
        # The layout that sent them (after a failure, the group is still the old layout's).
        layout = run.layout or run.previous_layout
        if layout is None:  # no layout has trained yet (a first formation failed)
            return
        dims = layout.dims
        for status in statuses:
            notice = status.notice
            if notice and status.state != "dead":
                node = self.group.slots[status.rank].node_id
                if node not in run.draining | run.lost_nodes:
                    self.notice(node, notice.source, notice.detail)
            for report in status.reports:
                if isinstance(report, StepReport):
                    self.recorder.rank_step(status.rank, report.as_record())
                    if report.sample_ids is not None:
                        self.recorder.step_samples(
                            report.step, dims.coords(status.rank).dp, dims.dp, report.sample_ids
                        )
                    if report.metrics is not None:
                        self._on_step(report, layout)
                elif isinstance(report, MemoryCopyReport):
                    if self.copies is not None:
                        self.copies.absorb(report)
                elif not isinstance(report, StoppedReport):
                    self.tracker.on_report(report)
                    if isinstance(report, SavedReport | SaveFailedReport):
                        run.last_save_written = time.time()

    def _on_step(self, report: StepReport, layout: Layout) -> None:
        run = self.run
        self.recorder.step_metrics(report.as_record(), layout.dims.world_size, layout.describe())
        self.progress.update(
            report.step, report.metrics.loss, report.metrics.tokens_per_s, layout.dims.world_size
        )
        run.step, run.last_progress = report.step, time.time()
        self.deadlines.step_finished(report.finished_at)
        run.streak.progressed(run.step)
        if run.formation_timer is not None:  # the whole breakdown, first step included
            timer, run.formation_timer = run.formation_timer, None
            self.recorder.event("first_step", step=run.step, **timer.first_step())
            # The capacity held back while the layout re-formed (a dead rank's replacement)
            # may start now: look at the cluster in this iteration, not at the next periodic
            # check up to CLUSTER_CHECK_INTERVAL_S later.
            run.last_cluster_check = 0.0

    def check(self) -> State:
        """One look at the running group: its reports, failures, hangs, chaos and the
        periodic check of the cluster (a decision due)."""
        run = self.run
        statuses = self.group.poll()
        self.handle_reports(statuses)
        broken = broken_statuses(statuses)
        if broken:
            return self.recovery.on_failure("failed", broken)
        run.last_healthy = time.perf_counter()
        # Every rank of a formed group is done (an empty group has trained nothing).
        if statuses and all(s.state == "done" for s in statuses):
            return Finished(run.step)
        bound = self.deadlines.hang_bound(saving=bool(self.tracker.in_flight))
        if time.time() - run.last_alive > bound.seconds:
            log.warning(
                "no step or save completed for %.0fs (%s): the group is hung",
                bound.seconds,
                bound.detail,
            )
            return self.recovery.on_failure("hung", [], bound)
        young = time.time() - run.last_formed_at < CHAOS_ARRIVAL_WAIT_S
        # Actors warming for a grow back hold the next fault however long they take to start
        # (on a busy host, longer than CHAOS_ARRIVAL_WAIT_S): the story's order is kept.
        warming = bool(self.group.starting or self.group.idle)
        # The layout has trained once it has committed a checkpoint or every rank's in-memory
        # copy of one step (without the latter, a run saving only at its end waited out the
        # whole CHAOS_ARRIVAL_WAIT_S, and a fast one could finish before its fault fired).
        held = self.tracker.last_committed is not None or (
            self.copies is not None and self.copies.layout_copied()
        )
        self.chaos.fire_node_actions(
            run.step,
            run.layout_nodes,
            settled=not warming and not (young and not held),
            node_of_rank=self.node_of_rank,
            notice=self.notice,
        )
        if time.time() - run.last_cluster_check > CLUSTER_CHECK_INTERVAL_S:
            run.last_cluster_check = time.time()
            return Deciding("notice" if run.draining else "ok", pause_s=POLL_INTERVAL_S)
        time.sleep(POLL_INTERVAL_S)
        return Running()

    def node_of_rank(self, rank: int) -> str:
        return self.group.slots[min(rank, self.group.world_size - 1)].node_id
