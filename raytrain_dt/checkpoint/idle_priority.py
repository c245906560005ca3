"""Background checkpoint work at the lowest CPU priority: Linux's SCHED_IDLE.

A save's writer process and the in-memory copies' threads (sending a copy to the peer, and the
peer copying it into its own memory) run where a core would otherwise be idle: training leaves
cycles idle while it waits in collectives, and at normal priority this work took cycles from
the training ranks instead (in-memory copies of every step: 1.23x the step time on a saturated
2-core host, 1.06-1.12x at SCHED_IDLE; `bench/bench_overhead.py`). It is not starved: Linux
still gives a SCHED_IDLE thread a small share (weight 3 against nice 19's 15) on a saturated host.
Linux schedules threads, so this applies to the calling thread (a process's main thread, for a
process of its own). A niceness would not do: nice 19 under a rank already at nice 19 changes
nothing, and a lowered thread that holds a lock training needs stalls training (the GIL: work
run this way holds it only in short stretches, between GIL-free copies).
"""

from __future__ import annotations

import contextlib
import os


def run_at_idle_priority() -> None:
    """Put the calling thread at SCHED_IDLE (nothing where the platform has no such policy)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
