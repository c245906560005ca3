"""Driver-side checkpoint bookkeeping: collect the ranks' save reports, commit a checkpoint
once every rank has written its shards, record stalls and failures, apply retention.

Each `saved` report carries the files that rank wrote with their sizes and SHA-256s (hashed as
they were written); the commit's manifest is their union, so committing reads no checkpoint
byte however large the checkpoint is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from raytrain_dt.checkpoint.store import CheckpointStore, merge_manifests
from raytrain_dt.errors import CheckpointError
from raytrain_dt.observe.metrics import RunRecorder
from raytrain_dt.worker.reports import (
    CheckpointStagedReport,
    SavedReport,
    SaveFailedReport,
    TrainStateReport,
)

# The reports that concern checkpoints (`worker/reports.py`).
CheckpointReport = TrainStateReport | CheckpointStagedReport | SavedReport | SaveFailedReport

log = logging.getLogger(__name__)


class CheckpointTracker:
    def __init__(
        self,
        store: CheckpointStore,
        world_size: int,
        recorder: RunRecorder,
        keep_last: int,
        keep_every: int,
        on_commit: Callable[[float, float], None] = lambda nbytes, write_s: None,
    ):
        """`on_commit(bytes, write_s)`: told each committed checkpoint's size and write time."""
        self.store = store
        self.on_commit = on_commit
        self.world_size = world_size
        self.recorder = recorder
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._saved: dict[int, dict[int, dict]] = {}  # step -> rank -> the files it wrote
        self._train_state: dict[int, dict] = {}
        self._stall: dict[int, float] = {}
        self._failed: set[int] = set()
        self._started: dict[int, float] = {}
        self.last_committed: int | None = None

    @property
    def in_flight(self) -> set[int]:
        return set(self._saved) | set(self._train_state)

    def on_report(self, report: CheckpointReport) -> None:
        step = report.step
        if isinstance(report, TrainStateReport):
            self._train_state[step] = report.train_state
            self._started[step] = time.time()
        elif isinstance(report, CheckpointStagedReport):
            # The slowest rank's staging is what training waited for.
            self._stall[step] = max(self._stall.get(step, 0.0), report.stall_s)
        elif isinstance(report, SaveFailedReport):
            self._fail(step, report.error)
        elif isinstance(report, SavedReport) and step not in self._failed:
            self._saved.setdefault(step, {})[report.rank] = report.files
            if len(self._saved[step]) == self.world_size and step in self._train_state:
                self._commit(step)

    def _fail(self, step: int, error: str) -> None:
        if step not in self._failed:
            self._failed.add(step)
            if self.last_committed is None:
                # Not one save of this layout has committed: a run going on like this would
                # train for ever with nothing to resume from, so this is an error, not a note.
                log.error(
                    "checkpoint step %d failed: %s (%d saves failed, none committed: %s)",
                    step,
                    error,
                    len(self._failed),
                    "this run has no checkpoint to resume from",
                )
            else:
                log.warning(
                    "checkpoint step %d failed: %s (previous latest stays latest)", step, error
                )
            self.recorder.event("checkpoint_failed", step=step, error=error)
        self._forget(step)

    def summary(self) -> str | None:
        """One line when every save of this layout failed (said again as the run ends)."""
        if self._failed and self.last_committed is None:
            steps = ", ".join(str(s) for s in sorted(self._failed))
            return f"every checkpoint save failed (steps {steps}): no checkpoint was committed"
        return None

    def _commit(self, step: int) -> None:
        try:
            files = merge_manifests(self._saved[step])
            ref = self.store.commit(step, self._train_state[step], files)
        except CheckpointError as exc:  # the files are not what the ranks reported
            self._fail(step, str(exc))
            return
        self.last_committed = step
        nbytes = sum(f["size"] for f in ref.record["files"].values())
        write_s = time.time() - self._started.get(step, time.time())
        self.recorder.event(
            "checkpoint",
            step=step,
            path=ref.uri,
            stall_s=self._stall.get(step, 0.0),
            write_s=write_s,
            bytes=nbytes,
        )
        self.on_commit(nbytes, write_s)
        self._forget(step)
        for uri in self.store.prune(self.keep_last, self.keep_every, self.in_flight):
            self.recorder.event("checkpoint_deleted", path=uri)

    def _forget(self, step: int) -> None:
        for table in (self._saved, self._train_state, self._stall, self._started):
            table.pop(step, None)
