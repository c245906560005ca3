"""Connecting to Ray: join a cluster, or start the embedded local one (optionally as several
simulated nodes), and read the accelerator topology the cluster actually has.

Simulated nodes are real raylets from `ray.cluster_utils.Cluster`, each declaring the
accelerator resource, so placement groups, node ids and node failures behave as on a cluster.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from raytrain_dt.config.schema import ClusterConfig
from raytrain_dt.data.autoscaler_requests import ask_with_ray_data

# NodeInfo is the planner's view of a node (topology/nodes.py); alive_nodes builds them here.
from raytrain_dt.topology.nodes import NodeInfo

log = logging.getLogger(__name__)

# The resource that stands for an accelerator on the embedded CPU instance.
SIMULATED_ACCELERATOR = "accelerator"

# Ray settings of the instances started here (embedded, simulated); a real cluster's nodes get
# them from their `ray start` (see cluster.yaml).
# - Ray kills a worker process that has been idle for 1 s whenever its node runs more workers
#   than it has CPUs, and it counts the rank actors. On a small node (a simulated one declares
#   one CPU for two ranks), every layout's Ray Data pipelines therefore started new processes,
#   each paying ~2.3 s of CPU to import Ray Data while the ranks train or re-form beside it.
#   Idle ones now wait 10 minutes for the next pipeline; they are bounded by the most tasks the
#   driver's runs ever had at once, since an idle worker is reused before a new one starts
#   (the actors' runtime_env, which the pipelines' tasks inherit, is the same from run to run:
#   `control/comm_env.py`).
# - No worker processes started ahead of need when the driver connects (Ray starts one per CPU
#   on every node, with no runtime_env): the rank actors and their pipelines have a runtime_env
#   of their own and can never take them, so they sat idle, ~2 CPU-s of imports each and then
#   ~0.6 CPU-s a minute each (measured: 12 of them, never used, in a 4.5-minute test session of
#   a head and two simulated nodes).
# - A lost raylet is noticed in ~1.5 s instead of Ray's default ~15 s (simulated nodes), so a
#   killed node is reported dead before the coordinator re-plans without it.
OWN_INSTANCE_SYSTEM_CONFIG = {
    "idle_worker_killing_time_threshold_ms": 600_000,
    "prestart_worker_first_driver": False,
}
SIMULATED_SYSTEM_CONFIG = {
    **OWN_INSTANCE_SYSTEM_CONFIG,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
}


@dataclass
class ClusterHandle:
    mode: str  # "embedded", "simulated", "joined" or "existing"
    accelerator_resource: str
    simulated: object | None = None  # ray.cluster_utils.Cluster when mode == "simulated"


def _embedded_cpus(cluster: ClusterConfig) -> int:
    # Every rank's bundle (its actor's CPUs and its input pipeline's), and room for the driver's
    # own tasks.
    return max(
        4,
        os.cpu_count() or 1,
        int(cluster.accelerators_per_node * _cpus_per_bundle(cluster)) + 2,
    )


def _cpus_per_bundle(cluster: ClusterConfig) -> float:
    """A rank's reservation: its actor's CPUs and its input pipeline's
    (`NodeReservations.bundle`)."""
    return cluster.cpus_per_rank + cluster.data_cpus_per_rank


def _node_resources(cluster: ClusterConfig, resource: str) -> dict:
    return {
        "num_cpus": _embedded_cpus(cluster),
        "resources": {resource: cluster.accelerators_per_node},
    }


@contextmanager
def connect(cluster: ClusterConfig, temp_dir: str | None = None) -> Iterator[ClusterHandle]:
    """Yield a connected cluster; tear down only what this call started."""
    import ray

    address = cluster.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        yield ClusterHandle("existing", resolve_accelerator_resource(cluster))
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        try:
            yield ClusterHandle("joined", resolve_accelerator_resource(cluster))
        finally:
            ray.shutdown()
        return
    resource = cluster.accelerator_resource or SIMULATED_ACCELERATOR
    if cluster.local_nodes == 1:
        log.info(
            "starting an embedded Ray instance (%d x %s)", cluster.accelerators_per_node, resource
        )
        res = _node_resources(cluster, resource)
        ray.init(
            # "local": always a new instance. With no address, Ray would join whatever cluster
            # /tmp/ray/ray_current_cluster names (any `ray start` on this machine) and fail.
            address="local",
            num_cpus=res["num_cpus"],
            resources=res["resources"],
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=temp_dir,
            _system_config=OWN_INSTANCE_SYSTEM_CONFIG,
            configure_logging=False,
        )
        try:
            yield ClusterHandle("embedded", resource)
        finally:
            ray.shutdown()
        return
    simulated = start_simulated_cluster(cluster, resource, temp_dir)
    ray.init(address=simulated.address, log_to_driver=False)
    try:
        yield ClusterHandle("simulated", resource, simulated)
    finally:
        ray.shutdown()
        simulated.shutdown()


def start_simulated_cluster(cluster: ClusterConfig, resource: str, temp_dir: str | None = None):
    """A head raylet with no accelerators (as on a real cluster: the driver and Ray Data run
    there, no ranks) plus `cluster.local_nodes` worker raylets with accelerators each."""
    from ray.cluster_utils import Cluster

    log.info(
        "starting a simulated cluster: %d nodes x %d %s",
        cluster.local_nodes,
        cluster.accelerators_per_node,
        resource,
    )
    head_args = {
        "num_cpus": _embedded_cpus(cluster),
        "include_dashboard": False,
        # Any free port for the dashboard agent, as Ray's Cluster gives its worker nodes: Ray's
        # fixed default (52365) is taken by any other Ray on the machine, and an agent that
        # cannot bind spends seconds retrying before the raylet's 15 s wait for it runs out.
        "dashboard_agent_listen_port": None,
        # No log monitor: it exists to stream every worker's output to drivers, and ours are
        # connected with log_to_driver=False (each rank writes its own log in the run
        # directory). It rescans every worker's log files about once a second: ~1 CPU-s a
        # minute on a fresh instance, 1.7 in a long test session with its hundreds of
        # workers' files, taken from training on a small host.
        "include_log_monitor": False,
        "_system_config": SIMULATED_SYSTEM_CONFIG,
    }
    if temp_dir:
        head_args["temp_dir"] = temp_dir
    # Ray's Cluster records the head's address in /tmp/ray/ray_current_cluster whatever the
    # temp dir, and fails if that folder is missing (`ray stop` removes it).
    from ray._common.utils import get_default_ray_temp_dir

    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    sim = Cluster(initialize_head=True, head_node_args=head_args)
    for _ in range(cluster.local_nodes):
        sim.add_node(**simulated_node_args(cluster, resource))
    sim.wait_for_nodes()
    return sim


def simulated_node_args(cluster: ClusterConfig, resource: str) -> dict:
    """What one simulated worker node declares: a couple of CPUs, its accelerators, its object
    store, and the memory of its node type (`simulated_node_memory`)."""
    cpus = max(1, int(cluster.accelerators_per_node * _cpus_per_bundle(cluster) + 0.999))
    return {
        "num_cpus": cpus,
        "object_store_memory": SIMULATED_OBJECT_STORE_BYTES,
        "memory": simulated_node_memory(),
        "resources": {resource: cluster.accelerators_per_node},
    }


# A simulated node's object store: what `ray.cluster_utils.Cluster` gives a node by default,
# declared here because the node's memory is reckoned from it.
SIMULATED_OBJECT_STORE_BYTES = 150 * 2**20


@functools.cache
def simulated_node_memory() -> int:
    """The `memory` resource every simulated node of this process declares: what Ray gives a
    node by default (the host's available memory less its object store), taken once, when the
    first one starts. A replacement node is the same node type as the one it replaces, as on a
    cloud. Left to Ray, a node added later declared what was free at that moment: one replacing
    a lost node while another run on the host held 10 GB was priced by the planner (host
    memory, `topology/host_memory.py`) too small for two ranks, and runs planned for fewer
    ranks, or for none, than the config asked."""
    from ray._private.utils import estimate_available_memory

    return int(estimate_available_memory() - SIMULATED_OBJECT_STORE_BYTES)


def resolve_accelerator_resource(cluster: ClusterConfig) -> str:
    """The configured resource; else GPU if the cluster has GPUs; else the simulated one if
    declared; else CPU (one rank per CPU)."""
    import ray

    if cluster.accelerator_resource:
        return cluster.accelerator_resource
    total = ray.cluster_resources()
    for candidate in ("GPU", SIMULATED_ACCELERATOR):
        if total.get(candidate, 0) >= 1:
            return candidate
    return "CPU"


def check_device_available(cluster: ClusterConfig) -> None:
    """Refuse, before any actor starts, a `cluster.device` the connected cluster cannot give.

    The driver may sit on a node without GPUs, so CUDA is judged by the GPUs Ray sees; the
    emulated device is built (once, cached) and loaded here, where a missing compiler shows.
    """
    import ray

    from raytrain_dt.accel.device import DeviceUnavailable

    if cluster.device == "cuda" and ray.cluster_resources().get("GPU", 0) < 1:
        raise DeviceUnavailable(
            "cluster.device=cuda: the Ray cluster has no GPUs; use cluster.device=auto, cpu or "
            "emulated, or join a cluster with GPU nodes (cluster.address)"
        )
    if cluster.device == "emulated":
        from raytrain_dt.accel.emulated import EmulatedDeviceUnavailable
        from raytrain_dt.accel.emulated.build import load_library

        try:
            load_library()
        except EmulatedDeviceUnavailable as exc:
            raise DeviceUnavailable(f"cluster.device=emulated: {exc}") from exc


class ClusterView(Protocol):
    """What the coordinator asks of the cluster (a fake in the coordinator's unit tests)."""

    def nodes(self) -> list[NodeInfo]: ...

    def draining(self) -> set[str]: ...

    def request_capacity(self, bundles: list[dict]) -> None: ...


@dataclass
class RayClusterView:
    resource: str
    requester: str = "raytrain_dt"  # the run, to Ray Data's autoscaling coordinator

    def nodes(self) -> list[NodeInfo]:
        return alive_nodes(self.resource)

    def draining(self) -> set[str]:
        """Nodes the GCS is draining: `ray drain-node`, or the autoscaler before it takes a
        spot node (`DrainNode` with a deadline). Their actors still run until the deadline."""
        from ray._private.state import state

        try:
            return set(state.get_draining_nodes())
        except Exception as exc:  # an older GCS without the call: no drain notices
            log.debug("no drain information: %s", exc)
            return set()

    def request_capacity(self, bundles: list[dict]) -> None:
        """Tell the autoscaler what the run wants (none: nothing), in force until replaced (a
        no-op on a cluster without an autoscaler): through Ray Data's autoscaling coordinator
        where one runs, which would otherwise replace it (`data/autoscaler_requests.py`),
        directly where none does."""
        if ask_with_ray_data(self.requester, bundles):
            return
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)


def alive_nodes(resource: str) -> list[NodeInfo]:
    """Alive nodes holding the accelerator resource, sorted by node id (deterministic)."""
    import ray

    nodes = []
    for node in ray.nodes():
        count = int(node.get("Resources", {}).get(resource, 0)) if node.get("Alive") else 0
        if count > 0:
            nodes.append(NodeInfo(node["NodeID"], count, node["Resources"].get("memory", 0.0)))
    return sorted(nodes, key=lambda n: n.node_id)
