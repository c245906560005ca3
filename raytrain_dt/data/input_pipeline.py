"""Ray Data input for one DP rank: positions -> sample ids -> token rows, streamed ahead.

Each DP rank gets its own streaming Ray Data pipeline over exactly the positions it must read
(see `data.order`). Ray Data does the reading in its own tasks and prefetches, so the train
step only pops ready micro-batches. Order is preserved, which the exactly-once guarantee needs.
The tasks run in the rank's own placement group, on its node, on the CPUs reserved there with
the rank (`cluster.data_cpus_per_rank`, `DataPlacement`): the batches never cross the network,
and the pipeline never waits for a share of the cluster that other pipelines hold.
TP and PP peers of one DP rank build identical pipelines and so see identical batches. Each row
carries `real`: False for a padding row of a layout whose DP degree does not divide the global
batch (see `data.order.rank_rows`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from raytrain_dt.data.autoscaler_requests import pipelines_in_groups_ask_nothing
from raytrain_dt.data.order import rank_rows, sample_ids
from raytrain_dt.data.source import TokenDataset

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataSlice:
    """What one DP rank reads in one run segment; built by the coordinator, used by workers."""

    dataset: TokenDataset
    shuffle_seed: int
    consumed_samples: int
    num_steps: int
    global_batch: int
    dp: int
    dp_rank: int
    micro_batch: int
    # Rows per step (the layout's micro_batch * grad_accum); 0: global_batch / dp, no padding.
    slots: int = 0

    @property
    def rows_per_step(self) -> int:
        return self.slots or -(-self.global_batch // self.dp)

    @property
    def num_rows(self) -> int:
        return self.num_steps * self.rows_per_step

    def rows(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(global positions, real) of this rank's rows [start, stop) (all rows by default)."""
        steps = -(-(self.num_rows if stop is None else stop) // self.rows_per_step)
        positions, real = rank_rows(
            self.consumed_samples,
            steps,
            self.global_batch,
            self.dp,
            self.dp_rank,
            self.rows_per_step,
        )
        return positions[start:stop], real[start:stop]

    def positions(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Global positions of this rank's rows [start, stop) (all rows by default)."""
        return self.rows(start, stop)[0]


# The column of row numbers that `_fetch` reads.
ROW_COLUMN = "row"


@dataclass(frozen=True)
class DataPlacement:
    """Where a rank's pipeline tasks run and on how many CPUs: `placement_group` is the rank's
    own (None outside one: Ray's default scheduling)."""

    cpus: float
    placement_group: object | None = None

    @classmethod
    def of_this_actor(cls, cpus: float) -> DataPlacement:
        from ray.util import get_current_placement_group

        return cls(cpus, get_current_placement_group())


def host_data_services_here() -> threading.Thread:
    """Create Ray Data's cluster-wide actors (its stats, stats-summary and usage actors) from
    this process, the driver, in the background, so that they live on the driver's node.

    Ray Data pins each one to the node of the first process that runs a dataset, otherwise a
    rank's. When that node is lost, the next pipeline recreates them inside the recovery, a new
    process each that imports Ray Data (measured: 3.4 CPU-s in a 4.5 s node-loss recovery on 2
    cores), and a pipeline that ends waits for the stats-summary actor to answer. The caller
    joins the thread before any rank reads (`RankGroup.setup`). These are Ray Data's
    internals: missing (another Ray version), this does nothing."""

    def create() -> None:
        try:
            from ray.data._internal.stats import get_or_create_stats_actor
            from ray.data._internal.stats_summary_actor import _get_or_create_stats_summary_actor
            from ray.data._internal.usage.actor import get_or_create_usage_collection_actor
            from ray.data._internal.usage.collector import usage_collection_disabled

            get_or_create_stats_actor()
            _get_or_create_stats_summary_actor()
            if not usage_collection_disabled():
                get_or_create_usage_collection_actor()
        except Exception as exc:  # ImportError, or a cluster going away: the pipelines do it
            log.debug("Ray Data's actors left to the first pipeline: %s", exc)

    thread = threading.Thread(target=create, name="data-services", daemon=True)
    thread.start()
    return thread


def start_input_worker(placement_group, bundle_index: int, cpus: float, runtime_env: dict | None):
    """Start, beside a rank actor being created in `placement_group`'s bundle, the worker
    process its pipeline's tasks will run in, and import Ray Data there.

    A pipeline's first task otherwise starts that process when the rank first reads, after the
    whole group has formed: on a loaded host its start (about 2 CPU-s, Ray Data's imports
    included) ran on into the first minutes of training, and a failure then found it still
    competing with its recovery (measured: three of them, 3.6 CPU-s, inside a 3.8 s rank-death
    recovery on 2 cores). Ray hands an idle worker of the same job and runtime environment to
    the next task on its node, so `runtime_env` must be the rank actor's own: the pipeline's
    tasks, submitted by the actor, inherit it. The pipeline runs one task at a time
    (`iterate_micro_batches`), so this is the only process it uses. Fire-and-forget: nothing
    waits on it."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return (
        _input_worker_task()
        .options(
            num_cpus=cpus,
            runtime_env=runtime_env,
            max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=bundle_index
            ),
        )
        .remote()
    )


@functools.cache
def _input_worker_task():
    """The remote task, made once per process: each `ray.remote` of a function exports it to
    the cluster again at its first call, once per rank of a formation otherwise."""
    import ray

    return ray.remote(_import_input_modules)


def import_rank_pipeline_modules() -> None:
    """What a rank's own pipeline (`iterate_micro_batches`) imports at its first read: Ray
    Data, with pandas's modules among its own (0.6 to 1.2 s of CPU, by host), set to ask the
    autoscaler for nothing from a placement group (`autoscaler_requests`). A rank actor
    imports it when it starts (`worker.rank_actor.import_lazy_torch_modules`), before it
    freezes the garbage collector's view, not in its first layout. There the import competed
    with its set-up and first step, and every teardown's full collection scanned its objects
    again: in bench/bench_elastic.py a grown-back replacement's first step took 1.15 s, now
    0.79 (median of 3), and a rank death's teardown 0.74 s, now 0.23 (a failed rank's
    collection frees the groups its blocked peers wait on)."""
    import ray.data  # noqa: F401

    pipelines_in_groups_ask_nothing()


def _import_input_modules() -> int:
    """What every task of a pipeline imports first (`_fetch_runs` itself is this module's)."""
    import ray.data  # noqa: F401

    return os.getpid()


def _fetch(batch: dict[str, np.ndarray], data: DataSlice) -> dict[str, np.ndarray]:
    rows = batch[ROW_COLUMN]
    positions, real = data.rows(int(rows[0]), int(rows[-1]) + 1)
    ids = sample_ids(positions, data.dataset.num_samples, data.shuffle_seed)
    return {"position": positions, "sample_id": ids, "tokens": data.dataset.read(ids), "real": real}


def _fetch_runs(
    runs: dict[str, np.ndarray], data: DataSlice, rows_per_fetch: int
) -> Iterator[dict[str, np.ndarray]]:
    """`_fetch` of runs of row numbers, given as their bounds, `rows_per_fetch` rows at a time:
    a task's memory is bounded by that, not by its run."""
    for start, stop in zip(runs["start"], runs["stop"], strict=True):
        for first in range(int(start), int(stop), rows_per_fetch):
            rows = np.arange(first, min(first + rows_per_fetch, int(stop)))
            yield _fetch({ROW_COLUMN: rows}, data)


class PipelineStop:
    """Stops a pipeline's Ray Data executor from another thread.

    Ray Data shuts an executor down when its iteration ends. A layout that is left mid-stream
    (a failure, a resize) must stop its pipelines itself: otherwise they go on starting worker
    processes and reading for ranks that no longer exist, on the CPU the next layout's set-up
    needs (measured: three workers started for a dead layout inside a rank death's recovery).
    The executor is created when the pipeline is first read, possibly after `stop`: a stopped
    pipeline never starts one (`PipelineStopped`), and one stopped once its executor has started
    has it shut down, also while the first read still waits for the first output. That wait is
    the cold start of the pipeline's task (a worker process importing Ray Data, a first read of
    the files): on a loaded host 10 s and more, during which a stop must already cancel the
    task (measured: a layout failed 7 s into a run left each survivor's starting pipeline
    reading on, a core of the 2-core host, through the whole recovery)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor = None
        self.stopped = False

    def attach(self, executor) -> None:
        with self._lock:
            self._executor = executor
            stopped = self.stopped
        if stopped:
            self._shut_down(executor)

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            executor = self._executor
        self._shut_down(executor)

    @staticmethod
    def _shut_down(executor) -> None:
        # Not forced: running tasks are cancelled, their worker processes live on for the next
        # pipeline. The reader blocked on this executor then sees the end of its stream.
        if executor is not None:
            executor.shutdown(force=False)


class PipelineStopped(Exception):
    """The first read of a pipeline stopped before its executor started: nothing to read."""


def _stoppable_iterator(ds, stop: PipelineStop):
    """`ds.iterator()` that hands its executor to `stop` as soon as the executor has started.

    Ray Data creates and starts the executor inside the first read (`_execute_to_iterator`,
    through `Dataset._create_executor` and the executor's `execute`), then waits there for the
    first output before returning it: attached only on return, a pipeline stopped during that
    wait would run on until its first output. So the executor's `execute` is wrapped to attach
    it once started (a stop before then refuses the start). Ray Data's internals, ray 2.60."""
    from ray.data._internal.iterator.iterator_impl import DataIteratorImpl

    create_executor = ds._create_executor

    def create_attached_executor():
        executor = create_executor()
        execute = executor.execute

        def execute_then_attach(*args, **kwargs):
            if stop.stopped:
                raise PipelineStopped
            outputs = execute(*args, **kwargs)
            stop.attach(executor)  # a stop from here on shuts it down, even before its output
            return outputs

        executor.execute = execute_then_attach
        return executor

    ds._create_executor = create_attached_executor

    class StoppableIterator(DataIteratorImpl):
        def _to_ref_bundle_iterator(self):
            try:
                bundles, stats, executor = super()._to_ref_bundle_iterator()
            except PipelineStopped:
                return iter(()), None, None
            return _until_stopped(bundles, stop), stats, executor

    return StoppableIterator(ds)


def _until_stopped(bundles: Iterator, stop: PipelineStop) -> Iterator:
    """The executor's output until `stop`; its executor starts on the first read, which a
    stopped pipeline never makes."""
    while not stop.stopped:
        bundle = next(bundles, None)
        if bundle is None:
            return
        yield bundle


def iterate_micro_batches(
    data: DataSlice,
    prefetch_batches: int,
    placement: DataPlacement,
    stop: PipelineStop | None = None,
) -> Iterator[dict]:
    """Yield {'position', 'sample_id', 'tokens', 'real'} torch batches of `micro_batch` rows, in
    order. `stop` (optional) ends the stream early from another thread."""
    import ray.data

    pipelines_in_groups_ask_nothing()  # its placement group is reserved already

    if data.num_rows == 0 or (stop is not None and stop.stopped):
        return iter(())
    # Row i of this rank's stream is an arithmetic function of i, so the source is just one run
    # of row numbers per block, built here (`from_items` runs no task; `range` and `from_numpy`
    # do, outside the placement group), and `_fetch_runs` turns each run into tokens.
    blocks = max(1, min(64, data.num_rows // 4096))
    bounds = [data.num_rows * i // blocks for i in range(blocks + 1)]
    runs = [{"start": a, "stop": b} for a, b in itertools.pairwise(bounds)]
    ds = ray.data.from_items(runs, override_num_blocks=blocks)
    # The dataset's own context (`from_items` copies the process's; what derives from `ds`
    # shares it), not the process-wide one: another stream of the same process, or the test
    # calling this, keeps its own settings.
    ctx = ds.context
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    if placement.placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # Any bundle of the rank's node reservation (each holds its rank's data CPUs). With
        # both strategies in a placement group, Ray Data budgets the group's bundles, at once,
        # instead of a share of the cluster granted by its coordinator actor (which starved
        # concurrent pipelines for tens of seconds on a small cluster).
        in_group = PlacementGroupSchedulingStrategy(
            placement.placement_group, placement_group_bundle_index=-1
        )
        with warnings.catch_warnings():
            # Deprecated in ray 2.60 ("Ray Data manages scheduling internally") but still the
            # one way to that budget; ray is pinned (pyproject.toml).
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.scheduling_strategy = ctx.scheduling_strategy_large_args = in_group
    ds = ds.map_batches(
        _fetch_runs,
        fn_kwargs={"data": data, "rows_per_fetch": max(data.micro_batch, 256)},
        batch_size=1,  # a run per call, a task per block: its reads share the opened files
        batch_format="numpy",
        # In the rank's group, on the CPUs reserved with it, one task at a time: in the
        # process started beside the rank (`start_input_worker`). More would each start a
        # process of their own, on a loaded host late, into the training and its recoveries;
        # one task streams thousands of times what a rank consumes (bench/bench_input.py).
        num_cpus=placement.cpus,
        compute=ray.data.TaskPoolStrategy(size=1),
    )
    # Ray Data hands over batches of about 256 rows, cut here into micro-batches (views): its
    # per-batch cost (~3 ms on CPU, while the train step holds the GIL) would be a visible share
    # of a short step at one row per micro-batch. Rows per rank are a multiple of micro_batch.
    per_batch = max(1, 256 // data.micro_batch)  # micro-batches per Ray Data batch
    source = ds if stop is None else _stoppable_iterator(ds, stop)
    # Numpy batches made tensors here, not `iter_torch_batches`: that imports ray.train (0.56 s
    # of CPU in every rank process, on a 2-core host) to learn that it is not in a Ray Train
    # worker, and leaves the host-to-device copy to the engine all the same.
    batches = source.iter_batches(
        batch_size=data.micro_batch * per_batch,
        prefetch_batches=-(-prefetch_batches // per_batch),  # at least as many rows ahead
        batch_format="numpy",
        drop_last=False,
    )
    return (
        {k: v[start : start + data.micro_batch] for k, v in tensors.items()}
        for tensors in map(_as_tensors, batches)
        for start in range(0, len(tensors["tokens"]), data.micro_batch)
    )


def _as_tensors(batch: dict[str, np.ndarray]) -> dict:
    """A Ray Data batch's columns as host tensors sharing its arrays' memory. Those may be
    read-only views of its Arrow blocks, which torch warns of; the micro-batches are only read
    (Ray Data's own collation shares them the same way)."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.as_tensor(column) for name, column in batch.items()}
