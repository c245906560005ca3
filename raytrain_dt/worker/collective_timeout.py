"""The collective timeout (`comm.timeout_s`) for every process group a rank creates.

`init_process_group(timeout=)` sets it for the world group only: groups created later (the
device-mesh dimensions FSDP, TP and PP talk on, the checkpoint side groups) take torch's
per-backend default, 30 minutes for Gloo. torch reads that default from module globals when a
group is created, so setting them before the world group exists covers every group.
"""

from __future__ import annotations

import datetime

import torch.distributed.distributed_c10d as c10d


def set_collective_timeout(seconds: float) -> datetime.timedelta:
    """Make `seconds` the timeout of every process group created from now on; returns it."""
    timeout = datetime.timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    return timeout


def join_timeout(collective: datetime.timedelta, join_s: float | None) -> datetime.timedelta:
    """The world group's timeout while it forms: `join_s` (the formation's time left) when
    shorter than the collectives'. `init_process_group` waits that long for every peer's
    address; `restore_world_timeout` then gives the world group's collectives theirs."""
    if join_s is None:
        return collective
    return min(collective, datetime.timedelta(seconds=max(1.0, join_s)))


def restore_world_timeout(collective: datetime.timedelta) -> None:
    c10d._set_pg_timeout(collective)
