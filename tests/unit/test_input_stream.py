"""A rank's stream across the hand-over from in-process reading to the Ray Data pipeline: the
same rows in the same order however late the pipeline is ready (no Ray: the pipeline's output
is stood in for by the very fetch function it maps)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import numpy as np
import pytest

from raytrain_dt.data.input_pipeline import ROW_COLUMN, DataSlice, _fetch
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.worker.input_stream import _chain


def _micro_batches(data: DataSlice) -> list[dict]:
    """What the pipeline yields for `data`: its rows in micro-batches, in order."""
    return [
        _fetch({ROW_COLUMN: np.arange(i, min(i + data.micro_batch, data.num_rows))}, data)
        for i in range(0, data.num_rows, data.micro_batch)
    ]


@pytest.mark.parametrize("start_at_once", [False, True])
@pytest.mark.parametrize("ready_after", [0, 4, 7, 1000])
def test_the_hand_over_keeps_every_row_once_in_order(token_data, ready_after, start_at_once):
    """`ready_after`: micro-batches the bridge has read when the pipeline is ready (0: before
    the first; 1000: never during the run). `start_at_once`: a run's first layout starts its
    pipeline before anything is read; any other, after the first step."""
    dataset = TokenDataset.open(token_data, 64)
    data = DataSlice(dataset, 7, 24, 6, 8, 2, 1, 2)  # 6 steps of 4 rows: 12 micro-batches
    bridge_rows = 2 * data.rows_per_step
    rest = dataclasses.replace(data, consumed_samples=24 + 2 * 8, num_steps=4)
    pipeline: Future = Future()
    requested_after = []  # micro-batches read when the pipeline was started

    def start_pipeline() -> Future:
        requested_after.append(len(got))
        return pipeline

    got: list[dict] = []
    stream = _chain(data, bridge_rows, start_pipeline, start_pipeline() if start_at_once else None)
    for pulled in range(data.num_rows // data.micro_batch):
        if pulled == ready_after:
            pipeline.set_result(iter(_micro_batches(rest)))
        got.append(next(stream))
    # Started once: before anything is read for a run's first layout, else after the first
    # step's two micro-batches (it must not slow the step a recovery waits for).
    assert requested_after == ([0] if start_at_once else [2])
    if not pipeline.done():
        pipeline.set_result(iter(_micro_batches(rest)))
    assert next(stream, None) is None
    expected = _micro_batches(data)
    assert [list(b["sample_id"]) for b in got] == [list(b["sample_id"]) for b in expected]
    assert [list(b["position"]) for b in got] == [list(b["position"]) for b in expected]
