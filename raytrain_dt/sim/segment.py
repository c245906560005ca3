"""A stretch of training at one layout, in closed form: which step ends when, and which periodic
checkpoint is committed by when. Arithmetic only, so a week of steps costs nothing to simulate.

Step s (global numbering) of a segment that starts at `t0` after step `s0` completes at
`t0 + (s - s0) * step_s + stall_s * (number of checkpoint steps in (s0, s - 1])`: an async
periodic save blocks only for `stall_s` (CPU staging) after its step, and is committed
`save_s` later, once written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Segment:
    t0: float  # when step s0 + 1 starts
    s0: int
    step_s: float
    samples0: int  # samples trained up to s0
    samples_per_step: int
    world: int
    every: int = 0  # periodic checkpoint interval in steps (0: none)
    stall_s: float = 0.0
    save_s: float = 0.0
    stop_step: float = math.inf  # a drain stops the segment at this step boundary

    def _checkpoints_in(self, lo: int, hi: int) -> int:
        """Checkpoint steps in (lo, hi]."""
        if not self.every or hi <= lo:
            return 0
        return hi // self.every - lo // self.every

    def time_of(self, step: int) -> float:
        if step <= self.s0:
            return self.t0
        return (
            self.t0
            + (step - self.s0) * self.step_s
            + self.stall_s * self._checkpoints_in(self.s0, step - 1)
        )

    def steps_at(self, t: float) -> int:
        """Steps completed by time t (capped at stop_step)."""
        if t <= self.t0:
            return self.s0
        per_step = self.step_s + (self.stall_s / self.every if self.every else 0.0)
        s = self.s0 + int((t - self.t0) / per_step)
        while self.time_of(s + 1) <= t:
            s += 1
        while s > self.s0 and self.time_of(s) > t:
            s -= 1
        return int(min(s, self.stop_step))

    def samples_at(self, step: int) -> int:
        return self.samples0 + (step - self.s0) * self.samples_per_step

    def committed_at(self, t: float) -> int | None:
        """The newest periodic checkpoint of this segment committed by time t (None: none)."""
        if not self.every:
            return None
        c = self.steps_at(t) // self.every * self.every
        while c > self.s0 and self.time_of(c) + self.stall_s + self.save_s > t:
            c -= self.every
        return c if c > self.s0 else None
