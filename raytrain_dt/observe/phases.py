"""Where the time of a multi-phase operation went (a rank leaving its layout), for one log
line: each `lap` closes the phase that ran since the last one."""

from __future__ import annotations

import time


class PhaseTimer:
    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._started = self._last
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def describe(self) -> str:
        """e.g. "0.42s (loop 0.01s, release 0.41s)"."""
        parts = ", ".join(f"{phase} {s:.2f}s" for phase, s in self.seconds.items())
        return f"{self._last - self._started:.2f}s ({parts})"
