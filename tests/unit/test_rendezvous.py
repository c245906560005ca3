"""The abortable join (`worker/rendezvous.py`): ranks meet on rank 0's store before the process
group forms, and a rank told to leave stops waiting for a peer that never comes."""

import datetime
import threading
import time

import pytest

from raytrain_dt.worker.rendezvous import (
    JOIN_POLL_S,
    KEY_POLL_MAX_S,
    JoinAborted,
    join_store,
    serve_store,
)

LONG = datetime.timedelta(seconds=60)


def _unserved_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join_in_threads(ranks, world_size, timeout, leave):
    """`ranks` join in threads; rank 0 (when among them) on the store it serves, as the actor
    does (`RankWorker.serve_layout_store`)."""
    served = serve_store("127.0.0.1") if 0 in ranks else None
    port, outcomes = served.port if served else _unserved_port(), {}

    def join(rank):
        started = time.monotonic()
        try:
            store = join_store(
                "127.0.0.1", port, rank, world_size, timeout, leave, served if rank == 0 else None
            )
            outcomes[rank] = (store, time.monotonic() - started)
        except Exception as exc:  # the outcome under test
            outcomes[rank] = (exc, time.monotonic() - started)

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    return threads, outcomes


def test_every_rank_returns_once_all_have_joined():
    threads, outcomes = _join_in_threads(range(3), 3, LONG, threading.Event())
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == [0, 1, 2]
    assert all(not isinstance(store, Exception) for store, _ in outcomes.values())


def test_a_rank_told_to_leave_stops_waiting_for_a_dead_peer():
    leave = threading.Event()
    threads, outcomes = _join_in_threads([0, 1], 3, LONG, leave)  # rank 2 never comes
    time.sleep(1.0)
    assert outcomes == {}  # still waiting
    left_at = time.monotonic()
    leave.set()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(outcomes) == [0, 1]
    for exc, _ in outcomes.values():
        assert isinstance(exc, JoinAborted) and "2 of 3 ranks had joined" in str(exc)
    assert time.monotonic() - left_at < 1.0 + 4 * JOIN_POLL_S


def test_a_join_past_its_deadline_says_how_many_came():
    threads, outcomes = _join_in_threads(
        [0, 1], 3, datetime.timedelta(seconds=1), threading.Event()
    )
    for thread in threads:
        thread.join(timeout=10)
    for exc, took in outcomes.values():
        assert isinstance(exc, TimeoutError) and "2 of 3 ranks joined within 1s" in str(exc)
        assert 1.0 <= took < 5.0


def test_a_rank_whose_rank_0_never_listens_leaves_when_told():
    leave = threading.Event()
    threads, outcomes = _join_in_threads([1], 2, LONG, leave)
    time.sleep(0.5)
    leave.set()
    threads[0].join(timeout=10)
    exc, took = outcomes[1]
    assert isinstance(exc, JoinAborted) and "before reaching rank 0" in str(exc)
    assert took >= 0.5  # it waited until it was told, not less


def test_a_group_forming_on_the_joined_store_stops_waiting_for_a_peer_lost_after_joining():
    """Both ranks join; rank 1 is lost before the next group forms. Rank 0, forming that group
    (gloo's full-mesh connect waits in C++ for rank 1's address), leaves when told, within a
    poll of the store, instead of waiting out the store's 60 s; a group both ranks form is
    unaffected."""
    import torch.distributed as dist

    leave = threading.Event()
    threads, outcomes = _join_in_threads(range(2), 2, LONG, leave)
    for thread in threads:
        thread.join(timeout=30)
    stores = {rank: store for rank, (store, _) in outcomes.items()}

    def form(rank, prefix, formed):
        started = time.monotonic()
        try:
            dist.ProcessGroupGloo(dist.PrefixStore(prefix, stores[rank]), rank, 2, LONG)
            formed[rank] = ("formed", time.monotonic() - started)
        except Exception as exc:  # the outcome under test
            formed[rank] = (exc, time.monotonic() - started)

    both = {}
    pair = [threading.Thread(target=form, args=(r, "both", both)) for r in range(2)]
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join(timeout=30)
    assert [both[r][0] for r in range(2)] == ["formed", "formed"]

    alone = {}
    forming = threading.Thread(target=form, args=(0, "alone", alone), daemon=True)
    forming.start()
    time.sleep(1.0)
    assert alone == {}  # still waiting for rank 1's address
    leave.set()
    forming.join(timeout=10)
    exc, took = alone[0]
    assert isinstance(exc, JoinAborted) and "left while waiting" in str(exc)
    assert 1.0 <= took < 1.0 + 2 * KEY_POLL_MAX_S + 1.0


def test_rank_0_joins_only_on_the_store_it_serves():
    """The port in the spec is the one rank 0's server bound: one it would bind only now could
    have been taken since it was chosen."""
    served = serve_store("127.0.0.1")
    for held in (None, served):
        port = served.port + 1 if held is served else served.port
        with pytest.raises(RuntimeError, match=f"rank 0 serves no store at port {port}"):
            join_store("127.0.0.1", port, 0, 1, LONG, threading.Event(), held)
    store = join_store("127.0.0.1", served.port, 0, 1, LONG, threading.Event(), served)
    assert store.add("raytrain_dt/joined", 0) == 1
