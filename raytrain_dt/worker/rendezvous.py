"""Joining a layout's process group in a way that leaving can interrupt.

`init_process_group` waits in C++ for every peer's address, for as long as its timeout: a rank
whose peer died before joining cannot be told to stop waiting, so the coordinator would have
to give the whole actor up (and its in-memory copies with it). Here the ranks first meet on the
layout's TCPStore, polling a counter between short waits: a rank told to leave
(`leave` set by `RankWorker.teardown`) stops within `JOIN_POLL_S`, and one that waited past
its deadline says how many peers came. Only once every peer has arrived does
`init_process_group` run, on the same store, and then it returns at once.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

# How often a joining rank looks at the counter of arrived peers (and at `leave`).
JOIN_POLL_S = 0.05
# One attempt to reach rank 0's store; attempts repeat until the deadline or `leave`.
CONNECT_ATTEMPT_S = 1.0
JOINED_KEY = "raytrain_dt/joined"


class JoinAborted(RuntimeError):
    """The rank was told to leave its layout while its peers were still joining."""


def join_store(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    leave: threading.Event,
) -> dist.Store:
    """The layout's store once all `world_size` ranks have joined it (rank 0 serves it).
    JoinAborted when `leave` is set first; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout.total_seconds()
    store = _connect(master_addr, master_port, rank, timeout, deadline, leave)
    store.add(JOINED_KEY, 1)
    while (joined := store.add(JOINED_KEY, 0)) < world_size:
        if leave.is_set():
            raise JoinAborted(f"rank {rank} left while {joined} of {world_size} ranks had joined")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: {joined} of {world_size} ranks joined within "
                f"{timeout.total_seconds():.0f}s"
            )
        time.sleep(JOIN_POLL_S)
    return store


def _connect(
    addr: str,
    port: int,
    rank: int,
    timeout: datetime.timedelta,
    deadline: float,
    leave: threading.Event,
) -> dist.Store:
    if rank == 0:  # binds at once; its peers' connections are what the counter waits for
        return dist.TCPStore(addr, port, is_master=True, timeout=timeout, wait_for_workers=False)
    attempt = datetime.timedelta(seconds=CONNECT_ATTEMPT_S)
    while True:
        try:
            store = dist.TCPStore(addr, port, is_master=False, timeout=attempt)
        except (RuntimeError, dist.DistError) as exc:  # rank 0 not listening (yet)
            if leave.is_set():
                raise JoinAborted(f"rank {rank} left before reaching rank 0's store") from exc
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {rank}: rank 0's store at {addr}:{port} not reachable within "
                    f"{timeout.total_seconds():.0f}s: {exc}"
                ) from exc
            continue
        store.set_timeout(timeout)
        return store
