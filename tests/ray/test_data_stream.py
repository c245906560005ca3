"""Ray Data's stream for one DP rank, read for real from the token dataset: the same rows in
the same order as the rank's slice computed in-process, in micro-batches, across the larger
batches Ray Data hands over; run in the rank's own placement group on the CPUs reserved there,
in the worker process started beside the rank; and stopped from another thread when its
layout is left."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from raytrain_dt.data.input_pipeline import (
    ROW_COLUMN,
    DataPlacement,
    DataSlice,
    PipelineStop,
    _fetch,
    iterate_micro_batches,
    start_input_worker,
)
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.observe.metrics import read_jsonl


def _slice(token_data: str, micro_batch: int, num_steps: int = 100) -> DataSlice:
    return DataSlice(
        dataset=TokenDataset.open(token_data, 64),
        shuffle_seed=7,
        consumed_samples=12,
        num_steps=num_steps,
        global_batch=12,
        dp=2,
        dp_rank=1,
        micro_batch=micro_batch,
    )


def _assert_rows_in_order(streamed: list[dict], data: DataSlice) -> None:
    expected = _fetch({ROW_COLUMN: np.arange(data.num_rows)}, data)
    for key in ("position", "sample_id", "tokens", "real"):
        got = torch.cat([b[key] for b in streamed])
        assert torch.equal(got, torch.as_tensor(expected[key])), key


@pytest.mark.parametrize("micro_batch", [1, 3])  # 256- and 255-row Ray Data batches
def test_stream_yields_the_rank_rows_in_order(ray_cluster, token_data, micro_batch):
    data = _slice(token_data, micro_batch)
    assert data.num_rows == 600  # more than two Ray Data batches
    streamed = list(iterate_micro_batches(data, 2, DataPlacement(0.25)))
    assert [len(b["tokens"]) for b in streamed] == [micro_batch] * (600 // micro_batch)
    _assert_rows_in_order(streamed, data)


def test_stream_runs_on_the_cpus_reserved_in_the_ranks_placement_group(ray_cluster, token_data):
    """An actor in a bundle of 0.3 CPUs, 0.1 of them its own, while every other CPU of the
    cluster is reserved by someone else: the stream completes only if its tasks run in the
    actor's group, on the 0.2 CPUs left there (a task asking more, a read task's default whole
    CPU, or a task outside the group, would never be scheduled, and the stream would hang).
    It streams once before the other CPUs are taken: Ray Data's own actors start then."""
    import ray
    from ray._private.state import available_resources_per_node
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    @ray.remote
    class Holder:
        pass

    @ray.remote(num_cpus=0.1)
    class Rank:
        def stream(self, data: DataSlice) -> list[dict]:
            placement = DataPlacement.of_this_actor(0.2)
            assert placement.placement_group is not None
            return list(iterate_micro_batches(data, 2, placement))

    own = placement_group([{"CPU": 0.3}])
    ray.get(own.ready(), timeout=60)
    rank = Rank.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(own, placement_group_bundle_index=0)
    ).remote()
    data = _slice(token_data, 2)
    _assert_rows_in_order(ray.get(rank.stream.remote(data), timeout=120), data)
    # Every other free CPU, node by node, held by an actor pinned there.
    blockers = [
        Holder.options(
            num_cpus=free["CPU"],
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote()
        for node_id, free in available_resources_per_node().items()
        if free.get("CPU", 0) > 0
    ]
    ray.get([b.__ray_ready__.remote() for b in blockers], timeout=60)
    try:
        _assert_rows_in_order(ray.get(rank.stream.remote(data), timeout=120), data)
    finally:
        for actor in [rank, *blockers]:
            ray.kill(actor)
        remove_placement_group(own)


def test_a_stopped_stream_ends_in_order_and_one_stopped_before_it_starts_is_empty(
    ray_cluster, token_data
):
    """`PipelineStop.stop` from another thread: mid-stream, the executor is shut down and the
    stream ends with what was already fetched, a prefix of the rank's rows in order; before the
    first read (a layout left while its pipeline starts), the executor created by that read is
    shut down as it attaches, and the stream is empty."""
    data = _slice(token_data, 4, num_steps=400)  # 2,400 rows
    stop = PipelineStop()
    stream = iterate_micro_batches(data, 2, DataPlacement(0.25), stop)
    first = next(stream)
    stopper = threading.Thread(target=stop.stop)
    stopper.start()
    stopper.join(timeout=30)
    assert not stopper.is_alive() and stop._executor._shutdown
    rest = list(stream)
    rows = 4 * (1 + len(rest))
    assert rows <= data.num_rows
    _assert_rows_in_order([first, *rest], _slice(token_data, 4, num_steps=rows // 6))

    for stopped_before_first_read in (True, False):
        late = PipelineStop()
        if stopped_before_first_read:
            late.stop()
        stream = iterate_micro_batches(data, 2, DataPlacement(0.25), late)
        late.stop()  # the executor is created by the first read
        assert list(stream) == []


def test_a_stream_stopped_while_its_first_output_is_awaited_ends_at_once(ray_cluster, token_data):
    """A layout left while its pipeline's task is still starting (on a loaded host a cold start
    takes 10 s and more; here another actor holds the CPUs of the placement group's one
    bundle, so the first read waits for good): the stop shuts the executor down, cancelling the
    task, and the waiting first read ends with an empty stream."""
    import ray
    import ray.data
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0.5)
    class Holder:
        pass

    ctx = ray.data.DataContext.get_current()
    scheduling = ctx.scheduling_strategy, ctx.scheduling_strategy_large_args
    starved = placement_group([{"CPU": 0.5}])
    ray.get(starved.ready(), timeout=60)
    holder = Holder.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(starved, 0)
    ).remote()
    ray.get(holder.__ray_ready__.remote(), timeout=60)
    stop, streamed = PipelineStop(), []
    reader = threading.Thread(
        target=lambda: streamed.extend(
            iterate_micro_batches(_slice(token_data, 2), 2, DataPlacement(0.5, starved), stop)
        )
    )
    try:
        reader.start()
        deadline = time.time() + 60
        while stop._executor is None and time.time() < deadline:  # started, awaiting output
            time.sleep(0.05)
        assert stop._executor is not None, "the executor was not handed over once started"
        time.sleep(1.0)
        assert reader.is_alive() and not streamed  # still waiting for the first output
        stop.stop()
        reader.join(timeout=30)
        assert not reader.is_alive() and stop._executor._shutdown
        assert streamed == []
    finally:
        stop.stop()
        ray.kill(holder)
        remove_placement_group(starved)
    # The stream scheduled into the group on its own dataset's context: this process's Ray
    # Data scheduling is as it was.
    assert (ctx.scheduling_strategy, ctx.scheduling_strategy_large_args) == scheduling


def test_the_stream_starts_no_process_once_its_worker_started_beside_the_rank(
    ray_cluster, token_data
):
    """`start_input_worker`, called as a formation creates the rank actor (`RankGroup`),
    starts the process the rank's pipeline tasks then run in: streaming starts no process of
    the rank's runtime environment. That environment has a variable of its own, so no idle
    worker of another test can serve the stream; without the warm-up, the stream starts one.
    Ray Data's own actors are started before (by a stream from here), as in a run, where the
    first pipeline of the cluster starts them."""
    import psutil
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR

    marker = uuid.uuid4().hex
    runtime_env = {"env_vars": {"RTDT_INPUT_WORKER_TEST": marker}}

    def processes_of_this_env() -> set[int]:
        found = set()
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.environ().get("RTDT_INPUT_WORKER_TEST") == marker:
                    found.add(process.pid)
        return found

    @ray.remote(num_cpus=0.1)
    class Rank:
        def stream(self, data: DataSlice) -> list[dict]:
            return list(iterate_micro_batches(data, 2, DataPlacement.of_this_actor(0.2)))

    data = _slice(token_data, 2)
    _assert_rows_in_order(list(iterate_micro_batches(data, 2, DataPlacement(0.25))), data)
    own = placement_group([{"CPU": 0.3, SIMULATED_ACCELERATOR: 1}])  # on a worker node
    ray.get(own.ready(), timeout=60)
    rank = Rank.options(
        runtime_env=runtime_env,
        scheduling_strategy=PlacementGroupSchedulingStrategy(own, placement_group_bundle_index=0),
    ).remote()
    try:
        worker = ray.get(start_input_worker(own, 0, 0.2, runtime_env), timeout=120)
        ray.get(rank.__ray_ready__.remote(), timeout=120)
        started = processes_of_this_env()
        assert worker in started
        _assert_rows_in_order(ray.get(rank.stream.remote(data), timeout=120), data)
        assert processes_of_this_env() == started
    finally:
        ray.kill(rank)
        remove_placement_group(own)


# Ray Data's cluster-wide actors (name, namespace): its stats and its stats summaries.
DATA_SERVICES = (
    ("datasets_stats_actor", "_dataset_stats_actor"),
    ("dataset_stats_summary_actor", "_dataset_stats_summary_actor"),
)


def test_ray_datas_own_actors_live_on_the_drivers_node(ray_cluster, make_config):
    """A run creates Ray Data's stats actors on the driver's node (`RankGroup.host_data_services`,
    which its first set-up waits for), not on the node of the first rank to read, which a lost
    node would take with it."""
    import ray
    from ray._private import state

    from raytrain_dt.control.coordinator import train

    for name, namespace in DATA_SERVICES:  # as on a cluster where no dataset has run yet
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(name, namespace=namespace))
    deadline = time.monotonic() + 30
    for name, namespace in DATA_SERVICES:
        while True:  # a killed actor's name is freed asynchronously
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                break
            assert time.monotonic() < deadline, f"{name} still named 30 s after it was killed"
            time.sleep(0.05)
    result = train(make_config("trainer.steps=2"), show_progress=False)
    assert result.final_step == 2
    driver_node = ray.get_runtime_context().get_node_id()
    (start,) = [e for e in read_jsonl(f"{result.run_dir}/events.jsonl") if e["event"] == "start"]
    rank_nodes = set(start["node_ids"])
    assert driver_node not in rank_nodes  # the head node of the simulated cluster
    for name, namespace in DATA_SERVICES:
        actor = ray.get_actor(name, namespace=namespace)
        node = state.actors(actor._actor_id.hex())["Address"]["NodeID"]
        assert node == driver_node, name
