"""The placement groups a rank group's actors live in: one or more per node, each pinned to it.

Each batch of actors created on one node shares one STRICT_PACK placement group pinned to that
node, so a node's accelerators are reserved together and a lost node takes only its own
reservations with it. A bundle a dead or released actor freed is reused before a new one is
reserved, and a reservation no actor uses any more is given back (`release_unused`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from raytrain_dt.control.actor_slots import rank_actor_options
from raytrain_dt.control.group import PlacementTimedOut


@dataclass
class NodeReservation:
    """One placement group on one node."""

    pg: object
    node_id: str
    size: int


class NodeReservations:
    """The group's reservations, and the bundle shape of one rank: its actor's Ray resources
    and, beside them, its input pipeline's CPUs (`data.input_pipeline.DataPlacement`)."""

    def __init__(self, resource: str, cpus_per_rank: float, data_cpus_per_rank: float):
        self.resource = resource
        self.actor_options = rank_actor_options(resource, cpus_per_rank)
        self.data_cpus_per_rank = data_cpus_per_rank
        self.held: list[NodeReservation] = []

    def bundle(self) -> dict:
        options = self.actor_options
        bundle = {
            "CPU": options.get("num_cpus", 0) + self.data_cpus_per_rank,
            "GPU": options.get("num_gpus", 0),
        }
        bundle.update(options.get("resources", {}))
        return {k: v for k, v in bundle.items() if v}

    def free_bundles(self, node_id: str, used: set[tuple[int, int]]) -> list[tuple[object, int]]:
        """The node's reserved bundles no actor holds; `used`: (id(pg), bundle index) of those
        that do."""
        return [
            (r.pg, i)
            for r in self.held
            if r.node_id == node_id
            for i in range(r.size)
            if (id(r.pg), i) not in used
        ]

    def reserve(self, node_id: str, count: int, timeout_s: float | None) -> NodeReservation:
        """Reserve `count` bundles on the node; waits until they are granted unless
        `timeout_s` is None (actors placed in it start once it is). `PlacementTimedOut`, naming
        what the node lacks, when they are not granted in time."""
        import ray
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        # Pinned to the node by its `ray.io/node-id` label. A soft target (Ray's
        # `_soft_target_node_id`) lands on another node whenever this one is full for the
        # moment (actors just killed there still hold their accelerators): the reservation, and
        # every rank later placed in it, would then stand for the wrong node in the plan's
        # topology (seen: actors warmed for a node started on the other, and a later run found
        # no room where the plan put them).
        pg = placement_group(
            [self.bundle()] * count,
            strategy="STRICT_PACK",
            bundle_label_selector=[{NODE_ID_LABEL_KEY: node_id}] * count,
        )
        if timeout_s is not None:
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError as exc:
                ray.util.remove_placement_group(pg)
                raise PlacementTimedOut(
                    f"cluster.placement_timeout_s: no room for {count} ranks of {self.resource} "
                    f"(each {_describe(self.bundle())}) on node {node_id[:12]} within "
                    f"{timeout_s:.0f}s; free there: {_describe(_free_on(node_id))}",
                    node_id,
                ) from exc
        reservation = NodeReservation(pg, node_id, count)
        self.held.append(reservation)
        return reservation

    def release_unused(self, used_pgs: set[int]) -> None:
        """Give back the reservations whose placement group (by id) no actor uses."""
        import ray

        for reservation in [r for r in self.held if id(r.pg) not in used_pgs]:
            self.held.remove(reservation)
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(reservation.pg)

    def hand_over(self, pgs: set[int]) -> list[NodeReservation]:
        """Stop holding the reservations of these placement groups (by id), now the caller's."""
        taken = [r for r in self.held if id(r.pg) in pgs]
        self.held = [r for r in self.held if id(r.pg) not in pgs]
        return taken


def _free_on(node_id: str) -> dict:
    """The node's unreserved resources now, as Ray's GCS reports them (what a placement that
    timed out did not find)."""
    from ray._private.state import available_resources_per_node

    try:
        return available_resources_per_node().get(node_id, {})
    except Exception:  # a diagnostic: never the reason a time-out is not reported
        return {}


def _describe(resources: dict) -> str:
    """`CPU 0.75, accelerator 1`: Ray's own resources (node and memory keys left out)."""
    shown = {
        k: round(v, 3)
        for k, v in sorted(resources.items())
        if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }
    return ", ".join(f"{k} {v:g}" for k, v in shown.items()) or "nothing"
