"""Where a rank actor lives and how the driver reaches it: its Ray resources, its slot (handle,
node, placement-group bundle), the node reservations, and waiting for calls on several actors
at once, where one dead actor fails the wait at once (`get_all`). Used by `rank_group.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from raytrain_dt.control.group import NODE_DIED, FormationFault


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
class NodeReservation:
    """One placement group on one node; a bundle freed by a dead actor is reused."""

    pg: object
    node_id: str
    size: int


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
