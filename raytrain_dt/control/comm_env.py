"""The rank actors' environment: the NCCL/Gloo settings of a run (overridable from config), the
host allocator's, and the driver variables `cluster.forward_env` names, nothing else of the
driver's.

Computed on the driver and handed to the actors through their Ray `runtime_env` (env_vars),
because NCCL and torch read these variables when a process creates its first communicator,
so they must be in place before the actor's process group exists. The reason for every
setting is in docs/communication.md. Ray keeps a runtime_env in the GCS and shows it in the
dashboard, so a driver variable (a credential) reaches it only when the config names it.

Actors outlive layouts (a resize rebuilds only the process group), so the environment is
decided per run, not per layout: a run that may span nodes gets the multi-node settings even
while it sits on one node. Hardware facts of a node type (the libfabric/EFA provider) belong
to the node and are set in cluster.yaml, not here.

Nothing here names one run's files: each actor points the flight recorder's dumps at its own
run's logs (`RankWorker._bind_to_run`), so every run of one config has the same environment.
Ray starts a worker process per distinct runtime_env and gives an idle one only to work of an
equal one: a variable that changed from run to run made every run of a driver (a sweep, a
notebook, the test suite) start its input pipelines' workers afresh, and left the last run's
idle beside them (`cluster.OWN_INSTANCE_SYSTEM_CONFIG` keeps idle workers for 10 minutes).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from raytrain_dt.config.schema import CommConfig, TrainConfig

log = logging.getLogger(__name__)

# torch's ProcessGroupNCCL: 2 (CleanUpOnly) = on a failed or timed-out collective, abort the
# communicators and raise in the rank; the process lives. A survivor whose peer died thus
# returns from its collective (the actor's teardown also aborts its groups, as torchft does)
# and is reused for the next layout with torch, CUDA context and warm caches in place, instead
# of being killed (3) and replaced by a fresh process.
_ABORT_AND_RAISE_ON_NCCL_ERROR = "2"

# torch's host allocator backs each tensor of 2 MB or more with transparent huge pages (c10's
# THP_MEM_ALLOC_ENABLE, read at the process's first allocation: set from its start). FSDP2
# allocates every layer's unsharded parameters and gradients afresh at each step, and on the
# host (cpu, emulated) every new 4 KB page of them is a page fault: allocating and filling 2.2
# GB cost 2.0 s of kernel time with 4 KB pages, 0.66 s with huge pages (docs/communication.md).
# Accelerator memory and pinned host buffers have their own allocators: unaffected.
HOST_ALLOCATOR_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def spans_nodes(cfg: TrainConfig, cluster_mode: str) -> bool:
    """May this run's ranks sit on more than one node? (cluster_mode: ClusterHandle.mode)"""
    if cluster_mode == "embedded":
        return False
    return cfg.elastic.max_nodes != 1


def run_comm_env(cfg: TrainConfig, cluster_mode: str) -> dict:
    """The environment of this run's rank actors."""
    return comm_env(cfg.comm, spans_nodes(cfg, cluster_mode))


def comm_env(comm: CommConfig, multi_node: bool) -> dict:
    """Environment variables for every rank actor of a run (all values are strings)."""
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": _ABORT_AND_RAISE_ON_NCCL_ERROR,
        "TORCH_NCCL_BLOCKING_WAIT": "1" if comm.blocking_wait else "0",
        "NCCL_DEBUG": comm.debug,
    }
    if comm.trace_buffer:
        # NCCL's flight recorder; each actor points its dumps at its run's logs.
        env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(comm.trace_buffer)
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    for name, value in (
        ("NCCL_ALGO", comm.algo),
        ("NCCL_PROTO", comm.proto),
        ("NCCL_BUFFSIZE", comm.buffsize_bytes),
    ):
        if value is not None:
            env[name] = str(value)
    env.update(_multi_node_env(comm) if multi_node else _single_node_env(comm))
    # Names were checked when the config was loaded (config/schema.py `validate`).
    env.update((name, str(value)) for name, value in comm.env.items())
    return env


def _single_node_env(comm: CommConfig) -> dict:
    # Every peer is on this machine: bootstrap and Gloo traffic stay on loopback, so a VPN,
    # docker bridge or firewalled primary interface can never be picked by mistake.
    interface = comm.socket_ifname or "lo"
    return {"NCCL_SOCKET_IFNAME": interface, "GLOO_SOCKET_IFNAME": interface}


def _multi_node_env(comm: CommConfig) -> dict:
    env: dict[str, str] = {}
    if comm.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = comm.socket_ifname
        env["GLOO_SOCKET_IFNAME"] = comm.socket_ifname
    if comm.network == "ib":
        # InfiniBand on, and GPUDirect RDMA whenever NIC and GPU share a PCIe host bridge
        # (NCCL's own default only allows it below one PCIe switch).
        env.update(NCCL_IB_DISABLE="0", NCCL_NET_GDR_LEVEL="PHB")
    elif comm.network == "socket":
        # TCP only: no probing of absent or broken RDMA devices, and more sockets and threads
        # per connection, which a single TCP stream needs to fill a 25-100 Gb/s link.
        env.update(
            NCCL_IB_DISABLE="1",
            NCCL_NET="Socket",
            NCCL_SOCKET_NTHREADS="4",
            NCCL_NSOCKS_PERTHREAD="4",
        )
    return env


def rank_runtime_env(
    cfg: TrainConfig, cluster_mode: str, environ: Mapping[str, str] | None = None
) -> dict:
    """The rank actors' `runtime_env`: the driver variables `cluster.forward_env` names, the
    host allocator's setting, then this run's communication settings (which win, as `comm.env`
    wins over everything). The same for every run of one config (the module's note)."""
    env = forwarded_env(cfg.cluster.forward_env, os.environ if environ is None else environ)
    env.update(HOST_ALLOCATOR_ENV)
    env.update(run_comm_env(cfg, cluster_mode))
    return {"env_vars": env}


def forwarded_env(names: list[str], environ: Mapping[str, str]) -> dict:
    """The values `environ` has for `names` (`cluster.forward_env`); a name it lacks is left
    out with a warning, since the setting then has no effect."""
    missing = [name for name in names if name not in environ]
    if missing:
        log.warning(
            "cluster.forward_env: %s not set in the driver's environment; not forwarded",
            ", ".join(missing),
        )
    return {name: environ[name] for name in names if name in environ}
