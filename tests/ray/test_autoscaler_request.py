"""The cluster's one autoscaler request while Ray Data runs in the cluster
(`data/autoscaler_requests.py`): Ray Data's autoscaling coordinator, which sends its own merge
of requests at every tick and so replaces any request made beside it, keeps the run's capacity
request; and an input pipeline in its rank's placement group adds nothing to the request.

The request is read where Ray keeps it (the autoscaler's KV entry) after the coordinator's
periodic tick, run at once here instead of in up to 20 s.
"""

from __future__ import annotations

import json

import pytest

from raytrain_dt.control.cluster import RayClusterView
from raytrain_dt.data.input_pipeline import (
    DataPlacement,
    DataSlice,
    PipelineStop,
    iterate_micro_batches,
)
from raytrain_dt.data.source import TokenDataset

WANTED = [{"accelerator": 2}] * 3  # a run's elastic.max_nodes=3, in node-sized bundles
REQUESTER = "raytrain_dt:test-autoscaler-request"


def _cluster_request() -> list[dict]:
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    assert not is_autoscaler_v2()  # the session cluster's request is this KV entry
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


@pytest.fixture
def tick(ray_cluster):
    """Ray Data's coordinator, as a driver's own pipeline leaves it running (a user's, or a
    `data.source` run's materialization); calling this runs its periodic tick now."""
    import ray
    import ray.data

    ray.data.range(8).materialize()
    coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")

    def run_tick() -> None:
        ray.get(coordinator.__ray_call__.remote(lambda actor: actor._tick()), timeout=60)

    yield run_tick
    RayClusterView("accelerator", requester=REQUESTER).request_capacity([])


def test_the_runs_request_outlasts_ray_datas_coordinator(tick):
    from ray.autoscaler.sdk import request_resources

    tick()
    others = _cluster_request()  # what Ray Data itself asks for now
    # Asked beside the coordinator, as runs did: replaced at its next tick.
    request_resources(bundles=WANTED)
    assert _cluster_request() == WANTED
    tick()
    assert _cluster_request() == others

    view = RayClusterView("accelerator", requester=REQUESTER)
    view.request_capacity(WANTED)
    assert _cluster_request() == others + WANTED  # in force at once
    tick()
    assert _cluster_request() == others + WANTED
    view.request_capacity([])  # the run's end withdraws it
    assert _cluster_request() == others
    tick()
    assert _cluster_request() == others


def test_a_pipeline_in_its_ranks_group_asks_the_autoscaler_for_nothing(tick, token_data):
    """Ray Data's own choice for a pipeline in a placement group: ask for every bundle of the
    group, for as long as it streams (each of a node's ranks, the node's whole reservation)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 0.25}, {"CPU": 0.25}])
    ray.get(group.ready(), timeout=60)
    # Rows enough (160k, 39 blocks read one at a time) for the executor to be running still
    # when the coordinator ticks: one that has read everything has withdrawn its request.
    data = DataSlice(
        dataset=TokenDataset.open(token_data, 64),
        shuffle_seed=7,
        consumed_samples=0,
        num_steps=20_000,
        global_batch=8,
        dp=1,
        dp_rank=0,
        micro_batch=2,
    )
    stop = PipelineStop()
    try:
        tick()
        before = _cluster_request()
        stream = iterate_micro_batches(data, 2, DataPlacement(0.25, group), stop)
        assert len(next(stream)["tokens"]) == 2  # its executor runs, reading in the group
        tick()
        assert _cluster_request() == before
    finally:
        stop.stop()
        remove_placement_group(group)
