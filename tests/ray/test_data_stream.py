"""Ray Data's stream for one DP rank, read for real from the token dataset: the same rows in
the same order as the rank's slice computed in-process, in micro-batches, across the larger
batches Ray Data hands over."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raytrain_dt.data.input_pipeline import DataSlice, _fetch, iterate_micro_batches
from raytrain_dt.data.source import TokenDataset


@pytest.mark.parametrize("micro_batch", [1, 3])  # 256- and 255-row Ray Data batches
def test_stream_yields_the_rank_rows_in_order(ray_cluster, token_data, micro_batch):
    data = DataSlice(
        dataset=TokenDataset.open(token_data, 64),
        shuffle_seed=7,
        consumed_samples=12,
        num_steps=100,
        global_batch=12,
        dp=2,
        dp_rank=1,
        micro_batch=micro_batch,
    )
    assert data.num_rows == 600  # more than two Ray Data batches
    streamed = list(iterate_micro_batches(data, prefetch_batches=2))
    assert [len(b["tokens"]) for b in streamed] == [micro_batch] * (600 // micro_batch)
    expected = _fetch({"id": np.arange(data.num_rows)}, data)
    for key in ("position", "sample_id", "tokens", "real"):
        got = torch.cat([b[key] for b in streamed])
        assert torch.equal(got, torch.as_tensor(expected[key])), key
