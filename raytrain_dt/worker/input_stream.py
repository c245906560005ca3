"""A rank's micro-batch stream for one layout, ready as soon as set-up ends.

Starting a Ray Data pipeline (its executor, a worker for the read tasks) takes seconds, the
longest part of a re-formation on a small model. So the first `BRIDGE_STEPS` steps are read
in this process, by the very function the pipeline maps (`data.input_pipeline._fetch`: same
positions, same samples, same order), while the pipeline for the remaining steps starts in a
background thread, once the first step has been trained: its start-up is seconds of Python in
this process, which would slow the first step (the one a recovery waits for). A run's first
layout (`start_at_once`: no recovery waits) starts it with the set-up instead, so that the
cold start of the node's Ray Data workers (new processes importing Ray Data) overlaps the
model build, not the first steps, where a failure's recovery would compete with it. If it has not
started by the end of the bridge, the bridge reads on until it has, and the pipeline's
micro-batches already read are skipped: a slow start never stalls a step. Every later
micro-batch comes from Ray Data. A layout that is left closes its stream (`InputStream.close`):
its pipeline stops, even one still starting.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from raytrain_dt.data.input_pipeline import (
    ROW_COLUMN,
    DataPlacement,
    DataSlice,
    PipelineStop,
    _fetch,
    iterate_micro_batches,
)

BRIDGE_STEPS = 2


class InputStream(Iterator[dict]):
    """One layout's micro-batches on one rank (see the module's doc)."""

    def __init__(
        self,
        data: DataSlice,
        prefetch_batches: int,
        placement: DataPlacement,
        start_at_once: bool = False,
    ):
        bridge_steps = min(BRIDGE_STEPS, data.num_steps)
        rest = dataclasses.replace(
            data,
            consumed_samples=data.consumed_samples + bridge_steps * data.global_batch,
            num_steps=data.num_steps - bridge_steps,
        )
        self._stop = PipelineStop()

        def start_pipeline() -> Future:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-start")
            pipeline = pool.submit(_start_pipeline, rest, prefetch_batches, placement, self._stop)
            pool.shutdown(wait=False)
            return pipeline

        self._batches = _chain(
            data,
            bridge_steps * data.rows_per_step,
            start_pipeline,
            start_pipeline() if start_at_once else None,  # now, not at the first read
        )

    def __next__(self) -> dict:
        return next(self._batches)

    def close(self) -> None:
        """Stop the pipeline; returns at once. Ray Data's executor shutdown waits up to 2 s for
        its scheduling thread, so it runs on a thread of its own, off a teardown's path."""
        threading.Thread(target=self._stop.stop, name="data-stop", daemon=True).start()


def _start_pipeline(
    data: DataSlice, prefetch_batches: int, placement: DataPlacement, stop: PipelineStop
) -> Iterator[dict]:
    """The pipeline with its first micro-batch already pulled (its start-up paid here)."""
    batches = iterate_micro_batches(data, prefetch_batches, placement, stop)
    first = next(batches, None)
    return batches if first is None else _prepend(first, batches)


def _prepend(first: dict, rest: Iterator[dict]) -> Iterator[dict]:
    yield first
    yield from rest


def _chain(
    data: DataSlice,
    bridge_rows: int,
    start_pipeline: Callable[[], Future],
    pipeline: Future | None = None,
) -> Iterator[dict]:
    """The bridge, then the pipeline from `start_pipeline`, called after the first step unless
    `pipeline` was started already."""
    start = 0
    while start < data.num_rows and (
        pipeline is None or start < bridge_rows or not pipeline.done()
    ):
        if pipeline is None and start >= data.rows_per_step:  # the first step is trained
            pipeline = start_pipeline()
        stop = min(start + data.micro_batch, data.num_rows)
        yield {
            k: torch.as_tensor(v)
            for k, v in _fetch({ROW_COLUMN: np.arange(start, stop)}, data).items()
        }
        start = stop
    if pipeline is None:  # a one-step segment: all of it read here
        return
    rest = pipeline.result()  # starts at row `bridge_rows`, in micro-batches as the bridge
    for _ in range(max(0, start - bridge_rows) // data.micro_batch):
        next(rest, None)
    yield from rest
