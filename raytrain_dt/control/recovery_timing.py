"""Where the seconds of one (re)formation go, from the event that caused it to the first step
trained at the new layout: detection, re-plan, just-in-time checkpoint (drain), process-group
re-form, checkpoint verification (on the ranks) and load, warm-up, data start, first step.
The coordinator reports them in the `resize` event of `events.jsonl`; `bench/bench_elastic.py`
reads them from there.

The clock starts at the cause: the last poll that found every rank healthy (a failure), the
notice (a preemption), or the moment new nodes appeared (growth, including the
`elastic.grow_stable_s` hysteresis; a grow back onto a dead rank's replacement counts from the
failure).

The phases are sequential, so they add up to the wall time since the cause; what no phase
names (driver bookkeeping, RPC round trips, a starved host's scheduling) is reported as
`unattributed_s`, so that the breakdown always sums to the whole.
"""

from __future__ import annotations

import time

# The sequential phases up to the formation, in order (`reform_s` includes `teardown_s`).
FORMATION_PHASES = (
    "detection_s",
    "replan_s",
    "drain_s",
    "checkpoint_verify_s",
    "reform_s",
    "model_build_s",
    "checkpoint_load_s",
    "warm_up_s",
    "data_start_s",
)


class RecoveryTimer:
    def __init__(self) -> None:
        self.since: float | None = None
        self.fields: dict[str, float] = {}
        self._started_training: float | None = None

    def cause(self, at: float) -> None:
        """The incident began at `at` (perf_counter); the first cause seen wins."""
        if self.since is None:
            self.since = at

    def detected(self, at: float) -> None:
        """The driver saw the failure at `at` (perf_counter): a poll found a rank broken.
        Detection ends there; collecting its peers and tearing the layout down (`left_layout`)
        are the re-form's."""
        if "detection_s" not in self.fields and self.since is not None:
            self.fields["detection_s"] = at - self.since

    def left_layout(self, seconds: float) -> None:
        """The failed layout's teardown (settling on the broken ranks, leaving the layout)."""
        self.fields["teardown_s"] = self.fields.get("teardown_s", 0.0) + seconds

    def decided(self, started: float, finished: float) -> None:
        self.cause(started)
        self.fields.setdefault("detection_s", started - self.since)
        self.fields["replan_s"] = finished - started

    def drained(self, seconds: float) -> None:
        self.fields["drain_s"] = seconds

    def verified(self, seconds: float) -> None:
        """The ranks' check of the resume checkpoint's files (`Formation.form`)."""
        self.fields["checkpoint_verify_s"] = seconds

    def formed(self, group_s: float, rank_setup: list[dict]) -> dict[str, float]:
        """`group_s`: teardown, placement and actor creation on the driver; `rank_setup`: each
        rank's own timings (the slowest rank is what everyone waits for)."""

        def slowest(key: str) -> float:
            return max((r.get(key, 0.0) for r in rank_setup), default=0.0)

        self.fields.update(
            reform_s=self.fields.get("teardown_s", 0.0) + group_s + slowest("process_group_s"),
            model_build_s=slowest("model_build_s"),
            checkpoint_load_s=slowest("checkpoint_load_s"),
            # The first step's one-time costs, paid before it (`RankWorker._build`).
            warm_up_s=slowest("warm_up_s"),
            # The first steps' input is read in-process; Ray Data starts behind them.
            data_start_s=slowest("data_start_s"),
        )
        self._started_training = time.perf_counter()
        if self.since is not None:
            # Per-rank phases are the slowest rank's, so their sum may slightly exceed the wall.
            named = sum(self.fields.get(k, 0.0) for k in FORMATION_PHASES)
            self.fields["unattributed_s"] = max(0.0, self._started_training - self.since - named)
        return dict(self.fields)

    def first_step(self) -> dict[str, float]:
        now = time.perf_counter()
        out = dict(self.fields)
        if self._started_training is not None:
            out["first_step_s"] = now - self._started_training
        if self.since is not None:
            out["total_s"] = now - self.since
        return out
