"""The load-balanced causal split of context parallelism and its loss scaling (no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.llama import next_token_loss
from raytrain_dt.models.model_spec import llama_spec
from raytrain_dt.models.presets import PRESETS
from raytrain_dt.parallel.context_parallel import (
    IGNORE_INDEX,
    ContextShardLoss,
    chunk_positions,
    shard_batch,
)


def test_each_rank_holds_a_chunk_and_its_mirror():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


def test_a_length_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match=r"^parallel\.cp: 2 does not split data\.seq_len=6"):
        chunk_positions(6, 2, 0)


def test_labels_are_the_next_token_and_the_last_position_has_none():
    tokens = torch.arange(16).view(2, 8)
    inputs, labels = shard_batch(tokens, 2, 0)
    assert inputs.tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert labels.tolist() == [[1, 2, 7, IGNORE_INDEX], [9, 10, 15, IGNORE_INDEX]]


def test_cp_ranks_losses_add_up_to_the_reference_mean_times_cp():
    """The sum over the cp ranks of their losses is cp x the mean next-token loss: FSDP's
    average over dp_shard_cp divides the cp back out."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (3, 12), generator=gen)
    logits = torch.randn(3, 12, 11, generator=gen)
    loss = ContextShardLoss(seq_len=12, cp=3)
    total = 0.0
    for rank in range(3):
        _, labels = shard_batch(tokens, 3, rank)
        total += loss(logits[:, chunk_positions(12, 3, rank)], labels)
    torch.testing.assert_close(total, 3 * next_token_loss(logits, tokens))


def test_a_model_without_ring_attention_refuses_cp_naming_the_key():
    spec = dataclasses.replace(llama_spec(PRESETS["tiny"]), name="hf:gpt2", context_parallel=None)
    with pytest.raises(ConfigError, match=r"^parallel\.cp: model 'hf:gpt2' has no"):
        spec.apply_context_parallel(None, None, 64)
