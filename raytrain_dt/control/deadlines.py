"""The control plane's deadlines, from what the run measures: when a group is hung, how long a
drain may take, how long a formation may take.

- **Hang.** No step for max(`elastic.hang_timeout_s`, `elastic.hang_step_multiple` x the p99
  of the layout's last STEP_WINDOW step intervals). Until a layout has measured one interval
  (its first two steps), the bound comes from the planner's step-time estimate for it, taken
  FIRST_STEP_WARMUP times (the first step also pays one-time costs: lazy communicator
  creation, allocator growth, autotuning), times the multiple, plus the layout's measured
  set-up time (build, load, warm-up: one-time work of the same size). While a checkpoint is
  in flight a save bound is added: a synchronous save writes between two steps, and an async
  one holds the next save's step until it is written.
- **Save.** The rank's share of the checkpoint (its size: measured at the last commit, else
  the memory model's `checkpoint_bytes`) at the per-rank write rate (the slowest of the last
  RATE_WINDOW commits, else `checkpoint.assumed_write_gbps`), SAVE_HEADROOM times, plus
  SAVE_FIXED_S for what does not scale (planning, metadata, the commit).
- **Drain** (checkpoint at the next step boundary, then stop): the step in progress, a save
  still in flight, and its own save.
- **Leave** (a survivor told to leave its layout): its loop reaches the next step boundary, or,
  blocked in a collective with a dead peer, returns once its communicators are aborted: the p99
  step interval (until one is measured, the planned step times FIRST_STEP_WARMUP), at least
  LEAVE_FLOOR_S. A fixed grace would drop a healthy survivor whose step is longer (a loaded
  host, a large model) and replace it with an actor that must load.
- **Formation** (placement, actor start, process group, build, load): `elastic.
  formation_timeout_s`, plus reading the checkpoint it resumes from at the write rate.

Pure: times and sizes are handed in, so unit tests drive it without Ray or a clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from raytrain_dt.config.schema import TrainConfig

STEP_WINDOW = 100  # step intervals the p99 is taken over: the layout's recent steps
FIRST_STEP_WARMUP = 2.0
RATE_WINDOW = 5  # commits whose write rates are remembered
SAVE_HEADROOM = 3.0
SAVE_FIXED_S = 10.0
LEAVE_FLOOR_S = 2.0


@dataclass(frozen=True)
class Bound:
    """A deadline in seconds and why it is what it is (recorded with the failure it causes)."""

    seconds: float
    basis: str  # which rule set it: hang_timeout_s, p99, plan, drain, formation
    detail: str

    def fields(self) -> dict:
        """For events.jsonl."""
        return {
            "bound_s": round(self.seconds, 3),
            "bound_basis": self.basis,
            "bound_detail": self.detail,
        }


def p99(samples: list[float]) -> float:
    """The nearest-rank 99th percentile: the smallest sample >= 99% of them."""
    ordered = sorted(samples)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


class Deadlines:
    def __init__(
        self,
        hang_timeout_s: float,
        step_multiple: float,
        formation_timeout_s: float,
        assumed_write_bytes_per_s: float,
    ):
        self.floor_s = hang_timeout_s
        self.multiple = step_multiple
        self.formation_s = formation_timeout_s
        self.assumed_rate = assumed_write_bytes_per_s
        self.rates: deque[float] = deque(maxlen=RATE_WINDOW)  # bytes/s per rank, measured
        self.checkpoint_bytes = 0.0  # the whole checkpoint: measured, else the memory model's
        self.measured_size = False
        self.world_size = 1
        self.intervals: deque[float] = deque(maxlen=STEP_WINDOW)
        self.predicted_step_s: float | None = None
        self.setup_s = 0.0
        self._last_step_at: float | None = None

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> Deadlines:
        e = cfg.elastic
        return cls(
            e.hang_timeout_s,
            e.hang_step_multiple,
            e.formation_timeout_s,
            cfg.checkpoint.assumed_write_gbps * 1e9,
        )

    # --- what the coordinator tells it -------------------------------------------------------
    def formed(
        self,
        *,
        predicted_step_s: float | None,
        setup_s: float,
        world_size: int,
        checkpoint_bytes: float,
    ) -> None:
        """A layout was formed: its steps are timed afresh. `checkpoint_bytes`: the memory
        model's size of its checkpoint, used until a commit has measured one."""
        self.intervals.clear()
        self._last_step_at = None
        self.predicted_step_s, self.setup_s, self.world_size = predicted_step_s, setup_s, world_size
        if not self.measured_size:
            self.checkpoint_bytes = checkpoint_bytes

    def step_finished(self, at: float) -> None:
        """A step completed at `at` (seconds, one clock per layout: rank 0's)."""
        if self._last_step_at is not None:
            self.intervals.append(max(0.0, at - self._last_step_at))
        self._last_step_at = at

    def checkpoint_committed(self, nbytes: float, write_s: float) -> None:
        """A checkpoint of `nbytes` was written by the current layout's ranks in `write_s`."""
        if nbytes <= 0:
            return
        self.checkpoint_bytes, self.measured_size = float(nbytes), True
        if write_s > 0:
            self.rates.append(nbytes / self.world_size / write_s)

    # --- the bounds --------------------------------------------------------------------------
    def hang_bound(self, saving: bool = False) -> Bound:
        """How long the group may go without completing a step; `saving`: a checkpoint is in
        flight."""
        if self.intervals:
            recent = p99(list(self.intervals))
            bound = Bound(
                self.multiple * recent,
                "p99",
                f"{self.multiple:g} x p99 step {recent:.2f}s of the last "
                f"{len(self.intervals)} steps",
            )
        elif self.predicted_step_s is not None:
            first = self.multiple * FIRST_STEP_WARMUP * self.predicted_step_s + self.setup_s
            bound = Bound(
                first,
                "plan",
                f"first steps: {self.multiple:g} x {FIRST_STEP_WARMUP:g} x planned step "
                f"{self.predicted_step_s:.2f}s + set-up {self.setup_s:.1f}s",
            )
        else:
            bound = Bound(
                self.setup_s, "plan", f"first steps, no estimate: set-up {self.setup_s:.1f}s"
            )
        if bound.seconds < self.floor_s:
            bound = Bound(
                self.floor_s,
                "hang_timeout_s",
                f"elastic.hang_timeout_s {self.floor_s:g}s ({bound.detail})",
            )
        if saving:
            save = self.save_bound()
            bound = Bound(
                bound.seconds + save.seconds,
                bound.basis,
                f"{bound.detail} + a save in flight {save.seconds:.1f}s",
            )
        return bound

    def leave_bound(self) -> Bound:
        """How long a rank's loop may take to end once told to leave its layout."""
        if self.intervals:
            step, detail = p99(list(self.intervals)), "p99 step"
        elif self.predicted_step_s is not None:
            step = FIRST_STEP_WARMUP * self.predicted_step_s
            detail = f"{FIRST_STEP_WARMUP:g} x planned step"
        else:
            step, detail = 0.0, "no step measured"
        if step < LEAVE_FLOOR_S:
            return Bound(LEAVE_FLOOR_S, "leave", f"{LEAVE_FLOOR_S:g}s floor ({detail} {step:.2f}s)")
        return Bound(step, "leave", f"{detail} {step:.2f}s")

    def write_rate(self) -> tuple[float, str]:
        """Bytes/s one rank writes (or reads) its share at, and where the figure comes from."""
        if self.rates:
            return min(self.rates), f"measured at the last {len(self.rates)} commits"
        return self.assumed_rate, "checkpoint.assumed_write_gbps"

    def save_bound(self) -> Bound:
        return self._transfer_bound(self.checkpoint_bytes, self.world_size, "save")

    def _transfer_bound(self, nbytes: float, world_size: int, basis: str) -> Bound:
        rate, source = self.write_rate()
        share = nbytes / max(1, world_size)
        seconds = SAVE_HEADROOM * share / rate + SAVE_FIXED_S
        return Bound(
            seconds,
            basis,
            f"{SAVE_HEADROOM:g} x {share / 1e9:.2f} GB per rank at {rate / 1e9:.3g} GB/s "
            f"({source}) + {SAVE_FIXED_S:g}s",
        )

    def drain_bound(self, saving: bool = False) -> Bound:
        """Reaching the next step boundary (a save in flight included), then saving there."""
        step, save = self.hang_bound(saving), self.save_bound()
        return Bound(
            step.seconds + save.seconds,
            "drain",
            f"step {step.seconds:.1f}s ({step.detail}) + save {save.seconds:.1f}s ({save.detail})",
        )

    def formation_bound(self, world_size: int, resuming: bool, checkpoint_bytes: float) -> Bound:
        """Placement, actor start, process group, build, and when `resuming` the load of the
        checkpoint (its size as measured at a commit, else `checkpoint_bytes`: the model's)."""
        detail = f"elastic.formation_timeout_s {self.formation_s:g}s"
        if not resuming:
            return Bound(self.formation_s, "formation", detail)
        size = self.checkpoint_bytes if self.measured_size else checkpoint_bytes
        load = self._transfer_bound(size, world_size, "load")
        return Bound(
            self.formation_s + load.seconds,
            "formation",
            f"{detail} + load {load.seconds:.1f}s ({load.detail})",
        )
