"""Rank actors kept warm between runs of one driver (`cluster.keep_warm_s`).

Starting a rank actor is a process importing torch: seconds of CPU each, paid again by every
run. A driver that trains run after run (a sweep, a notebook, a test session) may keep the
healthy actors of a finished run, torn down (no process group, no model) but with torch
loaded, for the next run, which takes them with their placement-group bundles
(`RankGroup.adopt_warm`) and rebinds each to itself (`rebind`). Only a run that would have
started the same actors reuses them (`actor_key`): the same Ray job, accelerator resource, CPUs
per rank, `cluster.device` (a process keeps what its first device set up) and actor
environment (which names no run's files: `control/comm_env.py`).
Otherwise, and once `keep_warm_s` has passed with no run taking them, they are released: kept
actors hold their accelerators, and (`RankWorker.park`) no longer their last model's heap.

One set is kept per driver process: the last finished run's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)

# How long a kept actor may take to answer its rebind (torn down and idle, it answers at once;
# one whose node died answers with an error, not silence).
REBIND_TIMEOUT_S = 30.0


@dataclass
class WarmActors:
    key: tuple  # what a run must match to take them (`actor_key`)
    slots: list  # `ActorSlot`s, torn down (in no layout)
    reservations: list  # the `node_reservations.NodeReservation`s whose bundles they hold


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


def release_on_nodes(node_ids: set[str]) -> int:
    """Release the kept actors on these nodes, and the reservations there, before whoever
    started the nodes removes them (the test harness removes the nodes its chaos added): a
    reservation on a removed node would be re-placed by Ray elsewhere, on accelerators the next
    run wants. The rest stay kept for the next run, on the same timer. Returns how many were
    released."""
    global _kept
    with _lock:
        kept = _kept
        if kept is None:
            return 0
        staying = replace(
            kept,
            slots=[s for s in kept.slots if s.node_id not in node_ids],
            reservations=[r for r in kept.reservations if r.node_id not in node_ids],
        )
        if staying.slots:
            _kept = staying
            going = WarmActors(
                kept.key,
                [s for s in kept.slots if s.node_id in node_ids],
                [r for r in kept.reservations if r.node_id in node_ids],
            )
        else:  # nothing left to keep: every reservation goes too (its timer finds none)
            _kept, going = None, kept
    release(going)
    return len(going.slots)


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


def actor_key(
    resource: str, cpus_per_rank: float, data_cpus_per_rank: float, device: str, runtime_env: dict
) -> tuple:
    """What a kept actor must share with a rank group to join it: the Ray job, the resource,
    the CPUs per rank, the device setting and the environment it was started with."""
    import ray

    env = runtime_env.get("env_vars") or {}
    rest = {k: v for k, v in runtime_env.items() if k != "env_vars"}
    return (
        ray.get_runtime_context().get_job_id(),
        resource,
        cpus_per_rank,
        data_cpus_per_rank,
        device,
        tuple(sorted(env.items())),
        repr(sorted(rest.items())),
    )


def rebind(warm: WarmActors, run_dir: str, first_index: int) -> tuple[list, list]:
    """Rebind each kept actor to a new run (`RankWorker.rebind`: its run directory, its actor
    index from `first_index` on); the slots of those that answered (with their new index,
    address and pid) and of those that did not."""
    import ray

    # Asked together, each answering for itself: a dead one costs no other's answer.
    refs = [
        slot.handle.rebind.remote(run_dir, first_index + i) for i, slot in enumerate(warm.slots)
    ]
    alive, dead = [], []
    for i, (slot, ref) in enumerate(zip(warm.slots, refs, strict=True)):
        try:
            where = ray.get(ref, timeout=REBIND_TIMEOUT_S)
        except Exception as exc:
            log.warning("a warm actor on node %s is gone: %s", slot.node_id[:12], exc)
            dead.append(slot)
            continue
        alive.append(replace(slot, actor_index=first_index + i, ip=where["ip"], pid=where["pid"]))
    return alive, dead
