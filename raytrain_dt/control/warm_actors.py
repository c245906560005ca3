"""Rank actors kept warm between runs of one driver (`cluster.keep_warm_s`).

Starting a rank actor is a process importing torch: seconds of CPU each, paid again by every
run. A driver that trains run after run (a sweep, a notebook, a test session) may keep the
healthy actors of a finished run, torn down (no process group, no model) but with torch
loaded, for the next run, which takes them with their placement-group bundles
(`RankGroup.adopt_warm`) and rebinds each to itself (`RankWorker.rebind`). Only a run that
would have started the same actors reuses them: the same Ray job, accelerator resource, CPUs
per rank, `cluster.device` (a process keeps what its first device set up) and actor
environment (bar the variables that name one run's files, `comm_env.RUN_SCOPED_ENV`).
Otherwise, and once `keep_warm_s` has passed with no run taking them, they are released: kept
actors hold their accelerators, and (`RankWorker.park`) no longer their last model's heap.

One set is kept per driver process: the last finished run's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class WarmActors:
    key: tuple  # what a run must match to take them (`RankGroup._warm_key`)
    slots: list  # `ActorSlot`s, torn down (in no layout)
    reservations: list  # the `NodeReservation`s whose bundles they hold


_kept: WarmActors | None = None
_expiry: threading.Timer | None = None
_lock = threading.Lock()


def keep(warm: WarmActors, keep_s: float) -> None:
    """Hold `warm` for the driver's next run, for at most `keep_s` seconds; a set kept before
    is released."""
    global _kept, _expiry
    timer = threading.Timer(keep_s, release_kept)
    timer.daemon = True  # the driver's exit is not held up: its actors die with it
    with _lock:
        previous, _kept = _kept, warm
        if _expiry is not None:
            _expiry.cancel()
        _expiry = timer
    timer.start()
    log.info("keeping %d rank actors warm for %.0fs", len(warm.slots), keep_s)
    if previous is not None:
        release(previous)


def take() -> WarmActors | None:
    """The kept set, now the caller's (None when there is none)."""
    global _kept, _expiry
    with _lock:
        kept, _kept = _kept, None
        if _expiry is not None:
            _expiry.cancel()
            _expiry = None
    return kept


def release_kept() -> None:
    """Release the kept set, if any (its time is up, or its resources are wanted)."""
    kept = take()
    if kept is not None:
        release(kept)


def release(warm: WarmActors) -> None:
    """Kill the actors and give their bundles back (nothing to do once Ray is down: they went
    with it)."""
    import ray

    if not ray.is_initialized():
        return
    for slot in warm.slots:
        with contextlib.suppress(Exception):  # dead already, or of a finished job
            ray.kill(slot.handle)
    for reservation in warm.reservations:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(reservation.pg)
    log.info("released %d warm rank actors", len(warm.slots))
