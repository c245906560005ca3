"""The driver's progress display: tqdm's bar on a terminal; on a stream that is not one (a job
log), whole lines every 10% of the steps or every 30 s, whichever comes first."""

from __future__ import annotations

import io

from raytrain_dt.observe.progress import (
    BarProgress,
    LineProgress,
    NoProgress,
    progress_display,
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _steps(progress, steps, clock: Clock, seconds_per_step: float) -> None:
    for step in steps:
        clock.now += seconds_per_step
        progress.update(step, 2.5, 1234.4, 4)


def test_a_terminal_gets_the_bar_redrawn_in_place():
    stream = Terminal()
    progress = progress_display(50, True, stream)
    assert isinstance(progress, BarProgress)
    for step in range(1, 51):
        progress.update(step, 2.5, 1234.4, 4)
    progress.close()
    out = stream.getvalue()
    assert "\r" in out and "50/50" in out and "loss=2.5000" in out


def test_no_terminal_gets_a_line_every_tenth_of_the_steps():
    stream, clock = io.StringIO(), Clock()
    progress = progress_display(100, True, stream)
    assert isinstance(progress, LineProgress)
    progress = LineProgress(100, stream, clock=clock)
    _steps(progress, range(1, 101), clock, 0.5)
    out = stream.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == [
        f"train {s}/100 ({s}%)" for s in range(10, 101, 10)
    ]
    assert lines[0] == (
        "train 10/100 (10%) | 0:00:05 elapsed, 0:00:45 left | 2.00 step/s | loss 2.5000 | "
        "1234 tok/s | world 4"
    )


def test_slow_steps_get_a_line_every_30_seconds_and_the_last_step_always():
    stream, clock = io.StringIO(), Clock()
    progress = LineProgress(1000, stream, clock=clock)
    _steps(progress, range(1, 14), clock, 10.0)
    shown = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert shown == [3, 6, 9, 12]
    _steps(progress, [1000], clock, 1.0)  # the run ends: its last step is always shown
    assert stream.getvalue().splitlines()[-1].startswith("train 1000/1000 (100%)")


def test_a_resume_counts_rate_and_time_left_from_where_it_starts():
    stream, clock = io.StringIO(), Clock()
    progress = LineProgress(100, stream, clock=clock)
    progress.reset(50)  # resumed from step 50: those steps took no time of this run
    _steps(progress, range(51, 61), clock, 1.0)
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("train 60/100 (60%) | 0:00:10 elapsed, 0:00:40 left | 1.00 step/s")


def test_disabled_shows_nothing():
    stream = Terminal()
    progress = progress_display(10, False, stream)
    assert isinstance(progress, NoProgress)
    progress.update(1, 1.0, 1.0, 1)
    progress.close()
    assert stream.getvalue() == ""
