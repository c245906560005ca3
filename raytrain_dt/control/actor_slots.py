"""Where a rank actor lives and how the driver reaches it: its Ray resources, its slot (handle,
node, placement-group bundle), and calls on every rank's actor at once:
a collective's (`call_all`: one dead actor fails the wait at once, `get_all`), a control call
that tolerates dead ones (`try_call_all`), and the status poll (`poll_all`). Used by
`rank_group.py`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from raytrain_dt.control.group import NODE_DIED, FormationFault
from raytrain_dt.worker.reports import CONTROL_GROUP, RankStatus

log = logging.getLogger(__name__)


@dataclass
class ActorSlot:
    handle: object
    node_id: str
    actor_index: int
    ip: str
    pg: object
    bundle_index: int
    pid: int = 0  # the actor's worker process


def rank_actor_options(resource: str, cpus_per_rank: float) -> dict:
    """Ray resources of one rank actor: one accelerator (a GPU, or the simulated resource) and
    its share of CPUs; a whole CPU where the CPU is the accelerator."""
    if resource == "CPU":
        return {"num_cpus": 1}
    if resource == "GPU":
        return {"num_gpus": 1, "num_cpus": cpus_per_rank}
    return {"num_cpus": cpus_per_rank, "resources": {resource: 1}}


@dataclass
class StartingActor:
    """An actor created ahead of need, until its `where` answers (it has imported torch)."""

    handle: object
    where: object  # the ObjectRef of its `where` call
    node_id: str
    pg: object
    bundle_index: int
    since: float


def started_slot(actor: StartingActor, where: dict) -> ActorSlot:
    return ActorSlot(
        actor.handle,
        where["node_id"],
        where.get("actor_index", -1),
        where.get("ip", ""),
        actor.pg,
        actor.bundle_index,
        where.get("pid", 0),
    )


def get_all(refs: list, timeout_s: float | None, nodes: list[str]) -> list:
    """The results of `refs` (calls on actors on `nodes`), waited for together: `FormationFault` as
    soon as one actor is dead (not after the others: survivors of a formation may wait on the
    dead one in a collective), a TimeoutError (Ray's GetTimeoutError) past `timeout_s`."""
    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise ray.exceptions.GetTimeoutError(
                f"{len(pending)} of {len(refs)} calls not answered within {timeout_s:.0f}s"
            )
        try:
            ray.get(ready)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            node = nodes[next(i for i, ref in enumerate(refs) if ref == ready[0])]
            died = isinstance(exc, ray.exceptions.RayActorError)
            lines = [line for line in str(exc).splitlines() if line.strip()] or [""]
            # An actor's death says so first; a raised call ends with its exception.
            raise FormationFault(
                f"{type(exc).__name__} on node {node[:12]}: {lines[0 if died else -1].strip()}",
                frozenset({node} if NODE_DIED in str(exc) else ()),
                actor_died=died,
            ) from exc
    return ray.get(refs)


def call_all(
    slots: list[ActorSlot],
    method: str,
    per_rank_args: list[tuple] | None = None,
    timeout_s: float | None = None,
) -> list:
    """Call `method` on every rank's actor (`slots` in rank order) concurrently (collectives
    need all ranks in) and wait: a TimeoutError (Ray's GetTimeoutError) once that is more than
    `timeout_s`, `FormationFault` as soon as one of them died."""
    refs = [
        getattr(slot.handle, method).remote(*(per_rank_args[rank] if per_rank_args else ()))
        for rank, slot in enumerate(slots)
    ]
    return get_all(refs, timeout_s, [slot.node_id for slot in slots])


def try_call_all(
    slots: list[ActorSlot],
    method: str,
    timeout_s: float = 30.0,
    args: tuple = (),
    concurrency_group: str | None = None,
) -> list[int]:
    """Call `method(*args)` on every rank's actor (in the actor's `concurrency_group`),
    tolerating dead ones; returns the ranks that failed (raised, timed out, or answered
    False)."""
    import ray

    options = {"concurrency_group": concurrency_group} if concurrency_group else {}
    refs = {
        rank: getattr(slot.handle, method).options(**options).remote(*args)
        for rank, slot in enumerate(slots)
    }
    failed = []
    for rank, ref in refs.items():
        try:
            answer = "answered False" if ray.get(ref, timeout=timeout_s) is False else None
        except Exception as exc:
            lines = str(exc).strip().splitlines() or [""]
            answer = f"{type(exc).__name__}: {lines[-1].strip()}"
            if isinstance(exc, ray.exceptions.RayTaskError):  # our code raised: where
                log.warning("rank %d: %s raised:\n%s", rank, method, str(exc).strip())
        if answer is not None:
            # Why an actor is given up (replaced, with its in-memory copies) is worth a line.
            log.warning("rank %d: %s failed (%s)", rank, method, answer)
            failed.append(rank)
    return failed


def poll_all(slots: list[ActorSlot], timeout_s: float = 30.0) -> list[RankStatus]:
    """Every rank's status (`slots` in rank order), asked in the actors' control group; an
    actor that died (or whose node died) is state "dead", one that does not answer in time
    "unresponsive"."""
    import ray

    refs = [slot.handle.poll.options(concurrency_group=CONTROL_GROUP).remote() for slot in slots]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    statuses = []
    for rank, (slot, ref) in enumerate(zip(slots, refs, strict=True)):
        try:
            statuses.append(replace(ray.get(ref, timeout=0.5), node_id=slot.node_id))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            dead = isinstance(exc, ray.exceptions.RayActorError)
            statuses.append(
                RankStatus(
                    rank,
                    "dead" if dead else "unresponsive",
                    error=f"{type(exc).__name__}: {exc}",
                    node_id=slot.node_id,
                )
            )
    return statuses
