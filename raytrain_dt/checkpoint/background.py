"""The CPU priority of a checkpoint's background work.

An async save's write (serialisation, checksums, the page cache's copy, fsync) and an
in-memory copy's hand-off run on threads of their own while training goes on. On a GPU host
those threads find idle cores; where training keeps every core busy (CPU ranks, or a host whose
cores all feed input pipelines) each of their cycles is taken from a training thread, and the
background save costs about what a synchronous one does. So these threads run at Linux's
`SCHED_IDLE`: they take the cycles training leaves (its waits in collectives, for input, for
the GPU) and yield a core to training at once. A save still in flight when the next one is due
is waited for (`RankCheckpointer.save`), and while training waits nothing else wants the core:
the write then runs at full speed, so idle priority can delay a save but never starve it.

Not the staging copy: the next optimizer step waits for it, so it keeps training's priority.
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
