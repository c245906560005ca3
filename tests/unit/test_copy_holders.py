"""The driver's map of in-memory copies: peers on other nodes, the newest step whose every
rank's copy survives, eviction as the actors evict, and the fallback to durable storage."""

from __future__ import annotations

from raytrain_dt.control.copy_holders import CopyHolders, is_memory_point, peer_ranks
from raytrain_dt.worker.reports import MemoryCopyReport

STATE = {"step": 0, "consumed_samples": 0}


def test_peers_sit_on_the_next_node():
    assert peer_ranks(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert peer_ranks(["a", "a", "b", "c"]) == [2, 2, 3, 0]
    assert peer_ranks(["a", "a", "a"]) == [1, 2, 0]  # one node: the next rank
    assert peer_ranks(["a"]) == [None]


def _copies(world: int, steps: range, actor_of_rank: list[int], peer_of_rank: list[int]):
    """Generation 1 of `world` ranks reported full copies (own + peer) for `steps`."""
    holders = CopyHolders()
    holders.generation, holders._world[1] = 1, world
    for step in steps:
        for rank in range(world):
            state = {**STATE, "step": step} if rank == 0 else None
            held = (actor_of_rank[rank], actor_of_rank[peer_of_rank[rank]])
            holders.absorb(MemoryCopyReport(1, step, rank, held, {"f": 10}, state))
    return holders


def test_a_lost_rank_resumes_from_its_peers_copy():
    holders = _copies(4, range(1, 6), [10, 11, 12, 13], [2, 3, 0, 1])
    live = {a: f"handle{a}" for a in (10, 11, 13)}  # rank 2's actor died
    ref = holders.resume_point(live, not_before=0)
    assert is_memory_point(ref) and ref.step == 5 and ref.train_state["step"] == 5
    source = ref.record["memory"]
    assert (source.generation, source.step, source.owners) == (1, 5, 4)
    assert source.holders == {
        0: [(10, "handle10")],  # its own actor; its peer (12) is gone
        1: [(11, "handle11"), (13, "handle13")],
        2: [(10, "handle10")],  # only its peer's copy survives
        3: [(11, "handle11"), (13, "handle13")],
    }


def test_no_surviving_copy_falls_back_to_the_durable_checkpoint():
    holders = _copies(4, range(1, 6), [10, 11, 12, 13], [2, 3, 0, 1])
    # Ranks 0 and 2 are each other's peers: both gone, rank 0's copy is nowhere.
    assert holders.resume_point({11: "h", 13: "h"}, not_before=0) is None
    # A durable checkpoint newer than the newest complete copy wins.
    assert holders.resume_point({a: "h" for a in (10, 11, 12, 13)}, not_before=6) is None
    assert holders.resume_point({a: "h" for a in (10, 11, 12, 13)}, not_before=5).step == 5


def test_an_incomplete_step_resumes_from_the_one_before():
    holders = _copies(2, range(1, 4), [10, 11], [1, 0])
    holders.absorb(MemoryCopyReport(1, 4, 0, (10, 11), {"f": 10}, {**STATE, "step": 4}))
    ref = holders.resume_point({10: "h", 11: "h"}, not_before=0)
    assert ref.step == 3  # rank 1 never reported step 4


def test_actors_keep_two_steps_and_so_does_the_map():
    holders = _copies(2, range(1, 6), [10, 11], [1, 0])
    assert sorted(holders._points) == [(1, 4), (1, 5)]
    assert holders.held_bytes() == 2 * 2 * 2 * 10  # 2 steps x 2 ranks x 2 holders x 10 bytes


def test_a_drain_stays_in_memory_only_where_every_leaving_rank_has_a_staying_peer():
    holders = _copies(4, range(1, 3), [10, 11, 12, 13], [2, 3, 0, 1])
    holders._placement[1] = (["a", "a", "b", "b"], [2, 3, 0, 1])
    assert holders.cover_leaving({"b"}) and holders.cover_leaving({"a"})
    assert not holders.cover_leaving({"a", "b"})  # every peer leaves too
    # Only the actors that stay count: node b's copies are on node a's actors.
    assert holders.complete(2, {10: "h", 11: "h"}) and holders.complete(1, {10: "h", 11: "h"})
    assert not holders.complete(3, {10: "h", 11: "h"}) and not holders.complete(2, {10: "h"})
    assert not CopyHolders().cover_leaving({"b"})  # no copy taken: drain to storage


def test_a_failure_abandons_only_saves_the_surviving_copies_supersede():
    """A durable save still in flight when ranks fail is not waited for only where the live
    actors' copies hold a step at least as new (`Recovery._drop_dead_then_leave`)."""
    holders = _copies(4, range(1, 6), [10, 11, 12, 13], [2, 3, 0, 1])
    everyone = {a: "h" for a in (10, 11, 12, 13)}
    assert holders.supersede(everyone, {5}) and holders.supersede({10: "h", 11: "h"}, {4, 5})
    assert not holders.supersede(everyone, {6})  # the save is newer than every copy
    assert not holders.supersede({11: "h", 13: "h"}, {5})  # rank 0's copy is lost
    assert not holders.supersede(everyone, set())  # nothing in flight: nothing to abandon


def test_a_layout_counts_as_copied_once_every_rank_copied_one_step():
    holders = _copies(2, range(1, 3), [10, 11], [1, 0])
    assert holders.layout_copied()
    holders.generation, holders._world[2] = 2, 2  # a new layout, nothing copied yet
    assert not holders.layout_copied()
    holders.absorb(MemoryCopyReport(2, 3, 0, (10, 11), {"f": 10}, {**STATE, "step": 3}))
    assert not holders.layout_copied()  # rank 1's copy of step 3 has not come in
