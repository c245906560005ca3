"""The driver's progress display: tqdm's bar on a terminal, plain lines anywhere else.

Without a terminal (a `ray job submit` log, `make demo | tee`, CI) a bar's carriage-return
redraws land in the log as they are, so one log line holds dozens of bar states between the
INFO lines. There the display prints one plain line every `LINE_EVERY_FRACTION` of the run's
steps or every `LINE_EVERY_S` seconds, whichever comes first, and at the last step.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Protocol, TextIO

# Without a terminal: a line every 10% of the steps, or every 30 s on a slow run.
LINE_EVERY_FRACTION = 0.1
LINE_EVERY_S = 30.0


class Progress(Protocol):
    def update(self, step: int, loss: float, tokens_per_s: float, world_size: int) -> None:
        """Step `step` (counted from 1) finished with these metrics."""

    def reset(self, step: int) -> None:
        """The run goes on from `step` (a resume, or a restart from a checkpoint)."""

    def close(self) -> None: ...


def progress_display(total_steps: int, enabled: bool, stream: TextIO | None = None) -> Progress:
    """The display for a run of `total_steps`: a bar if `stream` (default stderr, where tqdm
    draws) is a terminal, else plain lines; nothing when not `enabled`."""
    stream = stream or sys.stderr
    if not enabled:
        return NoProgress()
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return BarProgress(total_steps, stream)
    return LineProgress(total_steps, stream)


class NoProgress:
    def update(self, step: int, loss: float, tokens_per_s: float, world_size: int) -> None:
        pass

    def reset(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class BarProgress:
    """tqdm's bar, redrawn in place on the terminal."""

    def __init__(self, total_steps: int, stream: TextIO):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total_steps, desc="train", unit="step", dynamic_ncols=True, file=stream
        )

    def update(self, step: int, loss: float, tokens_per_s: float, world_size: int) -> None:
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", world=world_size)

    def reset(self, step: int) -> None:
        self.bar.n = step

    def close(self) -> None:
        self.bar.close()


class LineProgress:
    """One self-contained line per interval: `train 30/300 (10%) | 0:00:12 elapsed, 0:01:48
    left | 2.50 step/s | loss 4.1234 | 1234 tok/s | world 4`."""

    def __init__(
        self,
        total_steps: int,
        stream: TextIO,
        every_fraction: float = LINE_EVERY_FRACTION,
        every_s: float = LINE_EVERY_S,
        clock=time.monotonic,
    ):
        self.total, self.stream, self.clock = total_steps, stream, clock
        self.every_steps = max(1, math.ceil(total_steps * every_fraction))
        self.every_s = every_s
        self.started = clock()
        self.reset(0)

    def reset(self, step: int) -> None:
        # Rate and time left count from here: steps before a resume took no time of this run.
        self.from_step, self.from_time = step, self.clock()
        self.shown_step, self.shown_time = step, self.from_time

    def update(self, step: int, loss: float, tokens_per_s: float, world_size: int) -> None:
        now = self.clock()
        due = (
            step - self.shown_step >= self.every_steps
            or now - self.shown_time >= self.every_s
            or step == self.total
        )
        if not due or step <= self.shown_step:
            return
        self.shown_step, self.shown_time = step, now
        rate = (step - self.from_step) / max(now - self.from_time, 1e-9)
        left = _clock_time((self.total - step) / rate) if rate > 0 else "?"
        percent = 100 * step // max(self.total, 1)
        self.stream.write(
            f"train {step}/{self.total} ({percent}%) | {_clock_time(now - self.started)} "
            f"elapsed, {left} left | {rate:.2f} step/s | loss {loss:.4f} | "
            f"{tokens_per_s:.0f} tok/s | world {world_size}\n"
        )
        self.stream.flush()

    def close(self) -> None:
        pass


def _clock_time(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"
