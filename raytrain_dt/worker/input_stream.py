"""A rank's micro-batch stream for one layout, ready as soon as set-up ends.

Starting a Ray Data pipeline (its executor, a worker for the read tasks) takes seconds, the
longest part of a re-formation on a small model. So the first `BRIDGE_STEPS` steps are read
in this process, by the very function the pipeline maps (`data.input_pipeline._fetch`: same
positions, same samples, same order), while the pipeline for the remaining steps starts in a
background thread, once the first step has been trained: its start-up is seconds of Python in
this process, which would slow the first step (the one a recovery waits for). If it has not
started by the end of the bridge, the bridge reads on until it has, and the pipeline's
micro-batches already read are skipped: a slow start never stalls a step. Every later
micro-batch comes from Ray Data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from raytrain_dt.data.input_pipeline import DataSlice, _fetch, iterate_micro_batches

BRIDGE_STEPS = 2


def open_stream(data: DataSlice, prefetch_batches: int) -> Iterator[dict]:
    bridge_steps = min(BRIDGE_STEPS, data.num_steps)
    rest = dataclasses.replace(
        data,
        consumed_samples=data.consumed_samples + bridge_steps * data.global_batch,
        num_steps=data.num_steps - bridge_steps,
    )

    def start_pipeline() -> Future:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-start")
        pipeline = pool.submit(_start_pipeline, rest, prefetch_batches)
        pool.shutdown(wait=False)
        return pipeline

    return _chain(data, bridge_steps * data.rows_per_step, start_pipeline)


def _start_pipeline(data: DataSlice, prefetch_batches: int) -> Iterator[dict]:
    """The pipeline with its first micro-batch already pulled (its start-up paid here)."""
    batches = iterate_micro_batches(data, prefetch_batches)
    first = next(batches, None)
    return batches if first is None else _prepend(first, batches)


def _prepend(first: dict, rest: Iterator[dict]) -> Iterator[dict]:
    yield first
    yield from rest


def _chain(
    data: DataSlice, bridge_rows: int, start_pipeline: Callable[[], Future]
) -> Iterator[dict]:
    pipeline: Future | None = None
    start = 0
    while start < data.num_rows and (
        pipeline is None or start < bridge_rows or not pipeline.done()
    ):
        if pipeline is None and start >= data.rows_per_step:  # the first step is trained
            pipeline = start_pipeline()
        stop = min(start + data.micro_batch, data.num_rows)
        yield {
            k: torch.as_tensor(v) for k, v in _fetch({"id": np.arange(start, stop)}, data).items()
        }
        start = stop
    if pipeline is None:  # a one-step segment: all of it read here
        return
    rest = pipeline.result()  # starts at row `bridge_rows`, in micro-batches as the bridge
    for _ in range(max(0, start - bridge_rows) // data.micro_batch):
        next(rest, None)
    yield from rest
