"""The CPU priority of a checkpoint's background work.

An async save's write (serialisation, checksums, the device's writes, fsync) runs on a thread
of its own while training goes on. On a GPU host that thread finds idle cores; where training
keeps every core busy (CPU ranks, or a host whose cores all feed input pipelines) each of its
cycles is taken from a training thread, and the background save costs about what a synchronous
one does. So the write runs at Linux's `SCHED_IDLE`: it takes the cycles training leaves (its
waits in collectives, for input, for the GPU) and yields a core to training at once. A save
still in flight when the next one is due is waited for (`RankCheckpointer.save`), and while
training waits nothing else wants the core: the write then runs at full speed, so idle priority
can delay a save but never starve it.

It is off for now (`storage.BACKGROUND_AT_IDLE_PRIORITY`): on this project's loaded 2-core
CI host a save at idle priority was still being written when a node was lost a few steps
later, so the run resumed from the save before it; what that trade costs has not been
measured. The staging copy never runs here: the next optimizer step waits for it.
Not, so far, the in-memory copies' hand-off: a copy still in flight at the next boundary is a
skipped copy, and what idle priority would do to the steps lost on a failure is not measured.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

_lowered = threading.local()
P = ParamSpec("P")
R = TypeVar("R")


def lower_this_thread() -> None:
    """Run the calling thread (and the threads it starts) at idle CPU priority; once per
    thread. Where the platform has no such policy, the thread keeps its priority."""
    if getattr(_lowered, "done", False):
        return
    _lowered.done = True
    try:
        # pid 0: the calling thread (Linux schedules threads, and policies are per thread).
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux, or refused: a slower save, no more
        log.debug("background checkpoint thread keeps its priority: %s", exc)


def in_background(work: Callable[P, R]) -> Callable[P, R]:
    """`work`, lowering the thread that runs it first (`lower_this_thread`)."""

    @functools.wraps(work)
    def lowered(*args: P.args, **kwargs: P.kwargs) -> R:
        lower_this_thread()
        return work(*args, **kwargs)

    return lowered
