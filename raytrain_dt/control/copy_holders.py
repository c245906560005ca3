"""The driver's map of the ranks' in-memory copies (`worker/peer_copies.py`): which actor holds
which rank's copy of which step, from the ranks' `MemoryCopyReport`s (metadata only: the
driver never sees a byte).

Each formation is a new generation (its rank numbers name the copies). Each rank's copy is
held by its own actor and by a peer's on another node (`assign_peers`). After a failure
without notice, `resume_point` finds the newest step whose every rank has a copy on an actor
still alive (survivors' own copies, peers' copies for lost ranks); the formation resumes from
it when it is at least as new as the newest durable checkpoint, which it falls back to
otherwise. The actors keep the copies of their newest `KEEP_POINTS` steps; this map forgets
older ones as they do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from raytrain_dt.checkpoint.store import CheckpointRef
from raytrain_dt.worker.reports import MemoryCopyReport
from raytrain_dt.worker.spec import CopyPeer, MemoryResume, RankSpec

KEEP_POINTS = 2  # as `CopyStore`'s default: the newest two (generation, step) points
MEMORY_SCHEME = "memory://"

Point = tuple[int, int]  # (generation, step)


@dataclass
class _PointCopies:
    holders: dict[int, set[int]] = field(default_factory=dict)  # rank -> actor indexes
    sizes: dict[int, int] = field(default_factory=dict)  # rank -> bytes of its copy
    train_state: dict | None = None
    copy_s: float = 0.0  # the slowest rank's copy, staging to its peer's acknowledgement


class CopyHolders:
    def __init__(self) -> None:
        self.generation = 0
        self.skipped = 0  # the current layout's boundaries whose copy all ranks skipped
        self._world: dict[int, int] = {}  # generation -> its world size
        self._points: dict[Point, _PointCopies] = {}
        # generation -> (each rank's node, each rank's peer): where its copies live.
        self._placement: dict[int, tuple[list[str], list[int | None]]] = {}

    # --- a formation -------------------------------------------------------------------------
    def assign_peers(self, specs: list[RankSpec], slots: list) -> list[RankSpec]:
        """A new generation: name each rank's copies, and give it its peer, the rank of the
        same local index on the next node (cyclic; the next rank on a single node)."""
        self.generation += 1
        self.skipped = 0
        self._world[self.generation] = len(specs)
        nodes = [s.node_id for s in slots]
        peers = peer_ranks(nodes)
        self._placement[self.generation] = (nodes, peers)
        return [
            dataclasses.replace(
                spec,
                generation=self.generation,
                actor_index=slots[rank].actor_index,
                copy_peer=(
                    None
                    if peers[rank] is None
                    else CopyPeer(slots[peers[rank]].actor_index, slots[peers[rank]].handle)
                ),
            )
            for rank, spec in enumerate(specs)
        ]

    # --- reports -----------------------------------------------------------------------------
    def absorb(self, report: MemoryCopyReport) -> None:
        point = self._points.setdefault((report.generation, report.step), _PointCopies())
        point.holders.setdefault(report.rank, set()).update(report.holders)
        point.sizes[report.rank] = sum(report.files.values())
        if report.train_state is not None:
            point.train_state = report.train_state
        point.copy_s = max(point.copy_s, report.copy_s)
        self.skipped = max(self.skipped, report.skipped)
        for actor in report.holders:
            self._evict(actor)

    def _evict(self, actor: int) -> None:
        held = sorted(
            p for p, c in self._points.items() if any(actor in h for h in c.holders.values())
        )
        for old in held[:-KEEP_POINTS]:
            for holders in self._points[old].holders.values():
                holders.discard(actor)
        for old in [p for p, c in self._points.items() if not any(c.holders.values())]:
            del self._points[old]

    def stats(self) -> dict:
        """For the `resize` event: what the copies held and cost when the layout changed."""
        return {
            "memory_copy_bytes": self.held_bytes(),
            "memory_copy_s": round(max((c.copy_s for c in self._points.values()), default=0), 3),
            "memory_copy_skipped": self.skipped,
        }

    def held_bytes(self) -> int:
        """Bytes of every copy held, counted once per holder (what host memory carries)."""
        return sum(
            c.sizes.get(rank, 0) * len(holders)
            for c in self._points.values()
            for rank, holders in c.holders.items()
        )

    # --- a planned resize ----------------------------------------------------------------------
    def cover_leaving(self, leaving: set[str]) -> bool:
        """Whether the current generation copies, and every rank on a node in `leaving` has
        its peer on a node that stays: then a drain keeps the state in memory, no storage."""
        if not any(g == self.generation for g, _ in self._points):
            return False  # no copy taken in this layout (copies off, or an engine without)
        nodes, peers = self._placement[self.generation]
        return all(
            peers[rank] is not None and nodes[peers[rank]] not in leaving
            for rank, node in enumerate(nodes)
            if node in leaving
        )

    def complete(self, step: int, live: dict[int, object]) -> bool:
        """Every rank of the current generation has a copy of `step` on a live actor."""
        copies = self._points.get((self.generation, step))
        if copies is None or copies.train_state is None:
            return False
        return all(
            any(actor in live for actor in copies.holders.get(rank, ()))
            for rank in range(self._world[self.generation])
        )

    # --- resuming ----------------------------------------------------------------------------
    def resume_point(self, live: dict[int, object], not_before: int) -> CheckpointRef | None:
        """The newest step at or after `not_before` whose every rank's copy is held by a live
        actor (`live`: actor index -> handle), as a resume point (`CheckpointRef` whose record
        carries the `MemoryResume`); None: resume from the durable checkpoint."""
        for generation, step in sorted(self._points, key=lambda p: (p[1], p[0]), reverse=True):
            if step < not_before:
                return None
            copies = self._points[(generation, step)]
            owners = self._world.get(generation, 0)
            holders = {
                rank: [(a, live[a]) for a in sorted(copies.holders.get(rank, ())) if a in live]
                for rank in range(owners)
            }
            if copies.train_state is None or not all(holders.values()):
                continue
            source = MemoryResume(generation, step, owners, holders)
            record = {"train_state": copies.train_state, "memory": source}
            return CheckpointRef(f"{MEMORY_SCHEME}g{generation}/step_{step}", step, True, record)
        return None

    def layout_copied(self) -> bool:
        """Some step of the current generation has every rank's copy reported: the layout has
        trained, and its state is held (a node fault is then recoverable without storage)."""
        world = self._world.get(self.generation, 0)
        return any(
            generation == self.generation
            and copies.train_state is not None
            and all(copies.holders.get(rank) for rank in range(world))
            for (generation, _), copies in self._points.items()
        )

    def supersede(self, live: dict[int, object], saves_in_flight: set[int]) -> bool:
        """The live actors' copies hold a step at least as new as every durable save still in
        flight: a failure need not wait for those saves, the resume does not need them."""
        return bool(saves_in_flight) and (
            self.resume_point(live, not_before=max(saves_in_flight)) is not None
        )


def is_memory_point(ref: CheckpointRef | None) -> bool:
    return ref is not None and ref.uri.startswith(MEMORY_SCHEME)


def live_actors(slots: Iterable) -> dict[int, object]:
    """Actor index -> handle of started actors (in the layout or idle)."""
    return {s.actor_index: s.handle for s in slots if getattr(s, "actor_index", None) is not None}


def peer_ranks(node_of_rank: list[str]) -> list[int | None]:
    """Each rank's peer: the rank with the same local index (modulo its count) on the next
    node, in the order nodes first appear; on a single node the next rank; None alone."""
    nodes: dict[str, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        nodes.setdefault(node, []).append(rank)
    order = list(nodes)
    peers: list[int | None] = []
    for rank, node in enumerate(node_of_rank):
        if len(order) == 1:
            peers.append(None if len(node_of_rank) == 1 else (rank + 1) % len(node_of_rank))
            continue
        others = nodes[order[(order.index(node) + 1) % len(order)]]
        peers.append(others[nodes[node].index(rank) % len(others)])
    return peers
