"""Kept rank actors on nodes about to be removed are released with those nodes' reservations;
the rest stay kept (`warm_actors.release_on_nodes`). Without Ray up, a release kills nothing:
what is checked here is which actors and reservations stay kept."""

from __future__ import annotations

from raytrain_dt.control import warm_actors
from raytrain_dt.control.actor_slots import ActorSlot
from raytrain_dt.control.node_reservations import NodeReservation


def _kept_on(nodes: list[str]) -> warm_actors.WarmActors:
    slots = [
        ActorSlot(handle=None, node_id=node, actor_index=i, ip="", pg=f"pg-{node}", bundle_index=0)
        for i, node in enumerate(nodes)
    ]
    reservations = [NodeReservation(pg=f"pg-{n}", node_id=n, size=1) for n in dict.fromkeys(nodes)]
    return warm_actors.WarmActors(key=("job",), slots=slots, reservations=reservations)


def test_actors_on_removed_nodes_go_and_the_others_stay_kept():
    warm_actors.keep(_kept_on(["a", "a", "b", "b"]), 600)
    try:
        assert warm_actors.release_on_nodes({"b", "dead"}) == 2
        kept = warm_actors.take()
        assert [(s.node_id, s.actor_index) for s in kept.slots] == [("a", 0), ("a", 1)]
        assert [r.node_id for r in kept.reservations] == ["a"]
        assert kept.key == ("job",)
    finally:
        warm_actors.release_kept()


def test_nothing_left_kept_when_every_actor_was_on_a_removed_node():
    warm_actors.keep(_kept_on(["b", "b"]), 600)
    try:
        assert warm_actors.release_on_nodes({"b"}) == 2
        assert warm_actors.take() is None
        assert warm_actors.release_on_nodes({"b"}) == 0  # none kept: nothing to release
    finally:
        warm_actors.release_kept()
