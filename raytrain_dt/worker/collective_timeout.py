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
