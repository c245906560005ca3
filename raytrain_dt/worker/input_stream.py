"""A rank's micro-batch stream for one layout, ready as soon as set-up ends.

Starting a Ray Data pipeline (its executor, a worker for the read tasks) takes seconds, the
longest part of a re-formation on a small model. So the first `BRIDGE_STEPS` steps are read
in this process, by the very function the pipeline maps (`data.pipeline._fetch`: same
positions, same samples, same order), while the pipeline for the remaining steps starts in a
background thread. Every later micro-batch comes from Ray Data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from raytrain_dt.data.pipeline import DataSlice, _fetch, iterate_micro_batches

BRIDGE_STEPS = 2


def open_stream(data: DataSlice, prefetch_batches: int) -> Iterator[dict]:
    bridge_steps = min(BRIDGE_STEPS, data.num_steps)
    rest = dataclasses.replace(
        data,
        consumed_samples=data.consumed_samples + bridge_steps * data.global_batch,
        num_steps=data.num_steps - bridge_steps,
    )
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-start")
    pipeline = pool.submit(_start_pipeline, rest, prefetch_batches)
    pool.shutdown(wait=False)
    return _chain(data, bridge_steps * (data.global_batch // data.dp), pipeline)


def _start_pipeline(data: DataSlice, prefetch_batches: int) -> Iterator[dict]:
    """The pipeline with its first micro-batch already pulled (its start-up paid here)."""
    batches = iterate_micro_batches(data, prefetch_batches)
    first = next(batches, None)
    return batches if first is None else _prepend(first, batches)


def _prepend(first: dict, rest: Iterator[dict]) -> Iterator[dict]:
    yield first
    yield from rest


def _chain(data: DataSlice, bridge_rows: int, pipeline: Future) -> Iterator[dict]:
    for start in range(0, bridge_rows, data.micro_batch):
        rows = {"id": np.arange(start, min(start + data.micro_batch, bridge_rows))}
        yield {k: torch.as_tensor(v) for k, v in _fetch(rows, data).items()}
    yield from pipeline.result()
