"""Rank-side fault injection (tests and demos): the faults a chaos config aims at one rank.

`kill_rank` and `hang_rank` fire at the start of their step, inside the rank's train loop;
`kill_rank_mid_save` exits once this rank's shards of that step's save are written; a
`kill_rank` with `at: forming` exits as the rank begins joining its peers (`die_joining`): they
wait in the join for a peer that never comes; with `at: joined` it exits once all have joined,
and they wait in the process groups' formation for its address. Node-level faults are the
driver's (`control/node_chaos.py`). The coordinator drops actions that already fired
from the config it hands to later layouts, so each fires once per run.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from raytrain_dt.config.schema import ChaosAction

log = logging.getLogger("raytrain_dt.rank")

# How long a rank about to exit waits for the coordinator to collect its queued reports.
REPORTS_COLLECTED_WAIT_S = 10.0


def die_joining(actions: list[ChaosAction], rank: int, at: str) -> None:
    """Exit now if a `kill_rank` `at` this moment of the set-up ("forming": beginning to join
    the peers; "joined": all of them in, the process groups about to form) aims at this rank
    (the coordinator hands a rank such an action only in the formation it is due in:
    `Chaos.for_formation`)."""
    for action in actions:
        if action.action == "kill_rank" and action.at == at and action.target == rank:
            log.warning("chaos: rank %d exits while joining its peers (%s)", rank, at)
            os._exit(1)


class RankChaos:
    def __init__(
        self,
        actions: list[ChaosAction],
        rank: int,
        step_delay_s: float,
        wait_for_save: Callable[[], object],
        reports: queue.Queue,
        polls: Callable[[], int],
    ):
        """`wait_for_save`: blocks until the save in flight is reported; `reports`: the
        queue the coordinator's polls drain; `polls`: how many polls the actor has answered."""
        self.actions = [a for a in actions if a.target == rank and a.at == "step"]
        self.any_actions = bool(actions)
        self.rank = rank
        self.step_delay_s = step_delay_s
        self.wait_for_save = wait_for_save
        self.reports = reports
        self.polls = polls

    def die_while_saving(self) -> list[int]:
        """The steps whose save this rank dies in the middle of (`DieAfterWriting`)."""
        return [a.at_step for a in self.actions if a.action == "kill_rank_mid_save"]

    def __call__(self, step: int) -> None:
        """Fire the faults aimed at this rank at the start of `step`."""
        if self.any_actions and self.step_delay_s:
            time.sleep(self.step_delay_s)  # lets a chaos story play out with tiny steps
        for action in self.actions:
            if action.at_step != step:
                continue
            if action.action == "kill_rank":
                self._wait_until_reports_collected()
                log.warning("chaos: rank %d exits at step %d", self.rank, step)
                os._exit(1)
            if action.action == "hang_rank":
                log.warning("chaos: rank %d hangs at step %d", self.rank, step)
                threading.Event().wait()

    def _wait_until_reports_collected(self) -> None:
        # The previous step's save is written and reported first, so the fault lands at the
        # same point every run (otherwise whether that checkpoint commits is a race).
        self.wait_for_save()
        deadline = time.time() + REPORTS_COLLECTED_WAIT_S
        while not self.reports.empty() and time.time() < deadline:
            time.sleep(0.02)  # the coordinator's next poll collects them
        # ... and has received them: its poll replies may still be in flight when the queue
        # is empty, and die with the process. It polls again only after that.
        drained_by = self.polls()
        while self.polls() <= drained_by and time.time() < deadline:
            time.sleep(0.02)


class DieAfterWriting:
    """Chaos: the engine's DCP writer, except that the process exits as soon as this rank's
    shards are written, before the save completes (DCP's metadata is written only after every
    rank's write results have arrived, and this rank never reports `saved`)."""

    def __init__(self, writer):
        self._writer = writer

    def __getattr__(self, name: str):
        return getattr(self._writer, name)

    def write_data(self, plan, planner):
        self._writer.write_data(plan, planner).wait()
        log.warning("chaos: rank exits in the middle of a checkpoint save")
        os._exit(1)
