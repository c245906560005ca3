"""Joining a layout's process group in a way that leaving can interrupt.

`init_process_group` waits in C++ for every peer's address, for as long as its timeout: a rank
whose peer died before joining cannot be told to stop waiting, so the coordinator would have
to give the whole actor up (and its in-memory copies with it). Here the ranks first meet on the
layout's TCPStore, polling a counter between short waits: a rank told to leave
(`leave` set by `RankWorker.teardown`) stops within `JOIN_POLL_S`, and one that waited past
its deadline says how many peers came. Only once every peer has arrived does
`init_process_group` run, on the same store, and then it returns at once.

A peer can still be lost after it joined: while the world group, the mesh's groups or the
checkpoint's side groups form, each rank waits in C++ (gloo's full-mesh connect) for every
peer's address in the store, for the store's whole timeout. So the store the groups form on
is a `LeavableStore`: every wait for a key polls, and a rank told to leave stops within a
poll instead of being given up with its in-memory copies.

`join_layout` is the whole join of a rank's set-up, in this order: the rendezvous, the world
group, the device mesh and the checkpoint's side groups, within the join deadline.

Rank 0 serves the store from before its peers learn the port (`serve_store`, when the
coordinator asks it for the layout's endpoint): the OS picks the port as the server binds it,
so nothing on the node can take the port between its choice and the bind, as it can take a
port found free and bound later (on a busy node, Ray's own workers and connections).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from raytrain_dt.parallel.device_mesh import build_mesh
from raytrain_dt.worker.checkpointing import side_groups
from raytrain_dt.worker.collective_timeout import (
    join_timeout,
    restore_world_timeout,
    set_collective_timeout,
)
from raytrain_dt.worker.rank_chaos import die_joining
from raytrain_dt.worker.spec import RankSpec

# How often a joining rank looks at the counter of arrived peers (and at `leave`).
JOIN_POLL_S = 0.05
# One attempt to reach rank 0's store; attempts repeat until the deadline or `leave`.
CONNECT_ATTEMPT_S = 1.0
JOINED_KEY = "raytrain_dt/joined"
# A wait for a key polls fast at first (peers publish within moments) and backs off to this,
# so that thousands of waiting ranks ask rank 0's store a few times a second, not thousands.
KEY_POLL_MAX_S = 0.2


class JoinAborted(RuntimeError):
    """The rank was told to leave its layout while its peers were still joining."""


@dataclass
class JoinedLayout:
    store: dist.Store  # rank 0's server lives as long as this object is held
    mesh: DeviceMesh
    checkpoint_groups: tuple[dist.ProcessGroup, dist.ProcessGroup]  # `side_groups`


def serve_store(host: str) -> dist.TCPStore:
    """A store server on a port the OS picks as it binds (`.port`); `host` is this node's
    address, which its peers connect to."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)


def join_layout(
    spec: RankSpec,
    backend: str,
    device_type: str,
    leave: threading.Event,
    served: dist.TCPStore | None,
):
    """Join `spec`'s layout: meet every peer on the layout's store (rank 0's `served`, within
    the join deadline, `leave` ending the wait), form the world group on it with `backend`,
    then the device mesh and the checkpoint's side groups while every peer is known to be
    there. Collectives get `comm.timeout_s` once the group has formed. Chaos may end the
    process at "forming" and "joined" (`die_joining`)."""
    os.environ.update(
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
    )
    collective = set_collective_timeout(spec.cfg.comm.timeout_s)
    joining = join_timeout(collective, spec.join_timeout_s)
    die_joining(spec.cfg.chaos, spec.rank, "forming")
    # Every peer is in before the group forms; a teardown meanwhile (`leave`) ends the wait,
    # and the waits of the groups' formation on this store (`LeavableStore`).
    store = join_store(
        spec.master_addr, spec.master_port, spec.rank, spec.world_size, joining, leave, served
    )
    die_joining(spec.cfg.chaos, spec.rank, "joined")
    dist.init_process_group(
        backend=backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=joining
    )
    restore_world_timeout(collective)
    mesh = build_mesh(spec.layout.dims, device_type)
    return JoinedLayout(store, mesh, side_groups())


def join_store(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    leave: threading.Event,
    served: dist.TCPStore | None = None,
) -> dist.Store:
    """The layout's store once all `world_size` ranks have joined it (rank 0 serves it:
    `served`, from `serve_store` at `master_port`). JoinAborted when `leave` is set first;
    TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout.total_seconds()
    inner = _connect(master_addr, master_port, rank, timeout, deadline, leave, served)
    store = LeavableStore(inner, leave)
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


class LeavableStore(dist.Store):
    """Rank 0's store, whose waits for a key end when `leave` is set (JoinAborted). c10d calls
    it from C++ for every group it forms on this store (through its PrefixStores), so no
    group's formation can hold a rank past its teardown. Reads and writes go straight to the
    TCPStore; only the waits poll (`check`), instead of blocking in the server."""

    def __init__(self, inner: dist.Store, leave: threading.Event):
        super().__init__()
        self._inner, self._leave = inner, leave
        super().set_timeout(inner.timeout)

    def _wait_for(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or self._inner.timeout).total_seconds()
        started, pause = time.monotonic(), 0.001
        while not self._inner.check(keys):
            if self._leave.is_set():
                raise JoinAborted(f"left while waiting for {keys} in the layout's store")
            if time.monotonic() - started > limit:
                raise dist.DistStoreError(f"{keys} not in the layout's store within {limit:.0f}s")
            time.sleep(pause)
            pause = min(2 * pause, KEY_POLL_MAX_S)

    def get(self, key: str) -> bytes:
        self._wait_for([key])
        return self._inner.get(key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_for(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def set(self, key: str, value) -> None:
        self._inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        super().set_timeout(timeout)
        self._inner.set_timeout(timeout)


def _connect(
    addr: str,
    port: int,
    rank: int,
    timeout: datetime.timedelta,
    deadline: float,
    leave: threading.Event,
    served: dist.TCPStore | None,
) -> dist.Store:
    if rank == 0:  # its peers' connections are what the counter waits for
        if served is None or served.port != port:
            raise RuntimeError(
                f"rank 0 serves no store at port {port}: the layout's endpoint comes from rank "
                "0's `serve_store`"
            )
        served.set_timeout(timeout)
        return served
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
