"""The cluster autoscaler's one request, shared with Ray Data.

Ray keeps a single autoscaler request per cluster: each `ray.autoscaler.sdk.request_resources`
call replaces the last. Ray Data sends one too. Its autoscaling coordinator (a detached actor,
created by the first Ray Data execution in the cluster and kept for the cluster's life) merges
what every Ray Data execution asks for and sends the merge at every change and every 20 s,
replacing whatever else was asked. Measured on ray 2.60 (a run's request for 3 nodes, then one
tick of the coordinator): the request became the rank pipelines' placement-group bundles, or
nothing once they had ended. On an autoscaled cluster the run's growth and the replacement of
preempted nodes were then never asked for.

So, on both sides:
- a rank's input pipeline, which runs in the placement group the coordinator reserved for its
  rank (`input_pipeline`), asks the autoscaler for nothing (`pipelines_in_groups_ask_nothing`).
  Ray Data has such an execution ask for every bundle of its group, again every 10 s: each rank
  of a node asked for the node's whole reservation (8 ranks of a node: 64 accelerators);
- the run's own request joins Ray Data's merge as one requester wherever the coordinator runs
  (`ask_with_ray_data`), and is sent directly where it does not.

Ray Data's internals (`ray.data._internal.cluster_autoscaler`, ray 2.60, pinned in
pyproject.toml): missing or changed, both fall back to what Ray does by itself, with a warning.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

# Where Ray Data's coordinator lives (`get_or_create_autoscaling_coordinator`).
_COORDINATOR_NAME = "AutoscalingCoordinator"
_COORDINATOR_NAMESPACE = "AutoscalingCoordinator"

# A run's request held by Ray Data's coordinator lapses this long after its last refresh
# (`control/capacity.py` refreshes it well within): a killed driver's request ends by itself.
REQUEST_EXPIRY_S = 600.0
# How long the driver waits for Ray Data's coordinator to take a request (it answers at once):
# the run's control loop (`control/coordinator.py`) waits meanwhile, so a coordinator that does
# not answer costs the run a direct request, not its failure detection.
_ANSWER_TIMEOUT_S = 10.0


@functools.cache
def pipelines_in_groups_ask_nothing() -> None:
    """From now on, in this process, a Ray Data execution whose tasks all run in a placement
    group asks the autoscaler for nothing; it still budgets the group's bundles, as Ray Data
    does for such executions. Once per process."""
    try:
        from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import (
            AutoscalingCoordinator,
        )
        from ray.data._internal.cluster_autoscaler.placement_group_cluster_autoscaler import (
            PlacementGroupClusterAutoscaler,
        )
        from ray.data._internal.execution import streaming_executor
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        create_as_ray_data_does = streaming_executor.create_cluster_autoscaler
    except (ImportError, AttributeError) as exc:
        log.warning("Ray Data's pipelines will ask the autoscaler for their groups: %s", exc)
        return

    class AsksNothing(AutoscalingCoordinator):
        """The coordinator a group's execution talks to: its group is placed already."""

        def request_resources(self, *args, **kwargs) -> None:
            pass

        def cancel_request(self) -> None:
            pass

        def get_reserved_resources(self) -> dict:
            return {}

    def create_cluster_autoscaler(topology, resource_manager, data_context, *, execution_id):
        strategies = (data_context.scheduling_strategy, data_context.scheduling_strategy_large_args)
        if all(isinstance(s, PlacementGroupSchedulingStrategy) for s in strategies):
            return PlacementGroupClusterAutoscaler(
                execution_id=execution_id,
                scheduling_strategy=strategies[0],
                scheduling_strategy_large_args=strategies[1],
                autoscaling_coordinator=AsksNothing(),
            )
        return create_as_ray_data_does(
            topology, resource_manager, data_context, execution_id=execution_id
        )

    streaming_executor.create_cluster_autoscaler = create_cluster_autoscaler


def ask_with_ray_data(requester: str, bundles: list[dict]) -> bool:
    """Ask for `bundles` (none: withdraw) as `requester` through Ray Data's coordinator, which
    merges them with Ray Data's own requests and sends the merge at once. False where no
    coordinator runs in the cluster (nothing then replaces a direct request) or it cannot be
    reached: the caller asks directly."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        coordinator = ray.get_actor(_COORDINATOR_NAME, namespace=_COORDINATOR_NAMESPACE)
    except ValueError:  # none in this cluster
        return False
    try:
        if bundles:
            call = coordinator.request_resources.remote(
                requester_id=requester, resources=bundles, expire_after_s=REQUEST_EXPIRY_S
            )
        else:
            call = coordinator.cancel_request.remote(requester)
        ray.get(call, timeout=_ANSWER_TIMEOUT_S)
    except Exception as exc:  # an older or newer Ray Data, or the actor restarting
        log.warning("Ray Data's autoscaling coordinator did not take the request: %s", exc)
        return False
    return True
