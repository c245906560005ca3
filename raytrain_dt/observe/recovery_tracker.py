"""Recovery accounting, live: one `recovery` event per interruption of training.

An interruption is any re-formation of the rank group after steps had been trained: a failure
or hang (restart), a preemption notice or growth (planned resize), or a driver restart that
resumes a run directory. Its `recovery_s` runs from the moment training stopped to the moment
it started again:

- stopped: the arrival of the last step trained before the re-formation (kept or later
  discarded), plus the checkpoint stall of a save at that step boundary (that stall is
  accounted as checkpoint stall, not twice);
- started: the arrival of the first step after the re-formation minus that step's own time.

So it holds detection (the hang timeout, settling), draining, teardown, placement, process
group and model set-up, checkpoint load and data start. Steps trained after the checkpoint
that the group resumed from are the `lost_steps`; their step time is `lost_work_s`.
The `resize` event's breakdown (`control/recovery_timing.py`) times the same incident from
its cause to the end of the first step, which overlaps steps that still count (those trained
while a drain was pending, and that first step); `recovery_s` holds only time in which no
step ran, so that the goodput parts add up to the wall time.

The first step a run directory ever trains closes its `startup` event instead: `startup_s`
runs from the recorder's start (the driver is connected to Ray) to that step's start.
`observe/goodput.py` sums these events; nothing else defines recovery or startup.
"""

from __future__ import annotations


class RecoveryTracker:
    def __init__(self, stalls: dict[int, float] | None = None):
        self.last_step_end: float | None = None  # arrival time of the newest step record
        self.last_step = 0
        self.stalls = stalls or {}  # checkpoint stall by step
        self.cause: str | None = None
        self.lost_steps, self.lost_work_s = 0, 0.0
        self._pending: dict | None = None  # an interruption waiting for its first step
        self._session_started: float | None = None

    @classmethod
    def from_history(cls, metrics: list[dict], events: list[dict]) -> RecoveryTracker:
        """Pick up where an earlier driver session of the same run directory stopped."""
        tracker = cls({e["step"]: e["stall_s"] for e in events if e["event"] == "checkpoint"})
        if metrics:
            last = max(metrics, key=lambda r: r["time"])
            tracker.last_step_end, tracker.last_step = last["time"], last["step"]
            tracker.cause = "driver restart"
        return tracker

    def on_rewind(self, resumed_step: int, num_dropped: int, dropped_time_s: float) -> None:
        """A (re)formation begins from `resumed_step`, discarding `num_dropped` steps."""
        self.lost_steps += num_dropped
        self.lost_work_s += dropped_time_s
        if self.last_step_end is None:
            return  # nothing trained yet: this is startup, not recovery
        if self._pending is None:  # a formation that failed and was retried: one interruption
            stopped = self.last_step_end + self.stalls.get(self.last_step, 0.0)
            self._pending = {"stopped_at": stopped, "stopped_after_step": self.last_step}
        self._pending["resumed_step"] = resumed_step

    def on_event(self, record: dict) -> None:
        kind = record["event"]
        if kind == "session" and self.last_step_end is None:
            self._session_started = record["time"]
        elif kind == "checkpoint":
            self.stalls[record["step"]] = record["stall_s"]
        elif kind == "failure":
            self.cause = self.cause or record["health"]  # "failed" or "hung"
        elif kind == "preemption_notice":
            self.cause = self.cause or "preemption"

    def on_step(self, record: dict) -> dict | None:
        """A step line (rank 0's metrics); returns the `startup` or `recovery` event it
        completes, if any."""
        first_ever = self.last_step_end is None
        self.last_step_end, self.last_step = record["time"], record["step"]
        started = record["time"] - record["step_time_s"]
        if first_ever and self._session_started is not None:
            return {
                "event": "startup",
                "step": record["step"],
                "startup_s": started - self._session_started,
            }
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        event = {
            "event": "recovery",
            "step": record["step"],
            "cause": self.cause or "resize",
            "stopped_after_step": pending["stopped_after_step"],
            "resumed_step": pending["resumed_step"],
            "recovery_s": started - pending["stopped_at"],
            "lost_steps": self.lost_steps,
            "lost_work_s": self.lost_work_s,
        }
        self.cause, self.lost_steps, self.lost_work_s = None, 0, 0.0
        return event
