"""Memory model against hand-computed numbers (ZeRO paper, Korthikanti et al. 2022)."""

from __future__ import annotations

import pytest

from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.memory import (
    DEEPSPEED_REDUCE_BUCKET,
    activation_bytes,
    estimate_memory,
    korthikanti_layer_bytes,
    model_state_bytes,
    shape_for_params,
    stage_params,
    working_state_bytes,
)
from raytrain_dt.topology.parallel_dims import ParallelDims
from raytrain_dt.topology.pipeline_stages import split_of

L7 = PRESETS["llama-7b"]
P7 = 6_738_415_616  # 2*32000*4096 + 32*202_383_360 + 4096
LAYER7 = 202_383_360  # 4*4096^2 + 3*4096*11008 + 2*4096


def test_llama7b_parameter_count() -> None:
    assert L7.num_params == P7 and L7.params_per_layer == LAYER7


def test_7b_zero3_over_64_ranks_is_16_bytes_over_64() -> None:
    # FSDP2 keeps fp32 shards (the master copy) and fp32 gradients under bf16 compute.
    params, grads, opt = model_state_bytes(L7, shard=64, zero_stage=3)
    assert (params, grads, opt) == (P7 * 4 / 64, P7 * 4 / 64, P7 * 8 / 64)
    assert params + grads + opt == 1_684_603_904  # = P / 4
    # DeepSpeed: bf16 partitions, plus an fp32 master partition and its fp32 gradient.
    ds = model_state_bytes(L7, shard=64, zero_stage=3, engine="deepspeed")
    assert ds == (P7 * 2 / 64, P7 * (2 + 4) / 64, P7 * (4 + 8) / 64)


@pytest.mark.parametrize(
    ("engine", "zero", "bytes_per_param"),
    [
        ("fsdp2", 0, 16.0),
        ("fsdp2", 1, 16 / 8),
        ("fsdp2", 2, 16 / 8),
        ("fsdp2", 3, 16 / 8),
        ("deepspeed", 0, 16.0),
        # At the optimizer step ZeRO-1 and 2 both hold fp32 gradient partitions only.
        ("deepspeed", 1, 2 + 8 / 8 + 12 / 8),
        ("deepspeed", 2, 2 + 8 / 8 + 12 / 8),
        ("deepspeed", 3, (2 + 6 + 12) / 8),
    ],
)
def test_zero_stages_over_8_ranks(engine, zero, bytes_per_param) -> None:
    states = model_state_bytes(L7, shard=8, zero_stage=zero, engine=engine)
    assert sum(states) == pytest.approx(P7 * bytes_per_param)


def test_deepspeed_fp32_still_clones_a_master_partition() -> None:
    assert model_state_bytes(L7, precision="fp32", engine="deepspeed") == (P7 * 4, P7 * 4, P7 * 8)
    ds1 = model_state_bytes(L7, shard=2, zero_stage=1, precision="fp32", engine="deepspeed")
    assert ds1 == (P7 * 4, P7 * 8 / 2, P7 * 12 / 2)
    with pytest.raises(ValueError, match="engine"):
        model_state_bytes(L7, engine="megatron")


def test_working_states_follow_each_engines_sync_and_reshard() -> None:
    kw = {"shard": 8, "precision": "bf16"}
    root = P7 - 32 * LAYER7
    # FSDP2 full sharding: root and two blocks all-gathered; grad-op: every block.
    assert working_state_bytes(L7, zero_stage=3, **kw) == ((root + 2 * LAYER7) * 2, LAYER7 * 4)
    assert working_state_bytes(L7, zero_stage=2, **kw)[0] == P7 * 2
    # Stages 0/1 accumulate without sync: every gradient stays unsharded (fp32) till the last
    # micro-step; stage 2 reduce-scatters every micro-step; a pipeline always defers.
    assert working_state_bytes(L7, zero_stage=1, grad_accum=4, **kw)[1] == P7 * 4 - P7 * 4 / 8
    assert working_state_bytes(L7, zero_stage=2, grad_accum=4, **kw)[1] == LAYER7 * 4
    stage = stage_params(L7, 2)
    assert working_state_bytes(L7, zero_stage=3, pp=2, **kw) == (
        stage * 2,
        stage * 4 - stage * 4 / 8,
    )
    # DeepSpeed: ZeRO-1 accumulates full gradients and ZeRO-1/2 stage them in a reduce bucket.
    bucket = DEEPSPEED_REDUCE_BUCKET * 4
    ds = {"engine": "deepspeed", "grad_accum": 4, **kw}
    assert working_state_bytes(L7, zero_stage=1, **ds) == (0.0, bucket + P7 * 4 - P7 * 4 / 8)
    assert working_state_bytes(L7, zero_stage=2, **ds) == (0.0, bucket)
    assert working_state_bytes(L7, zero_stage=3, **ds) == (2 * LAYER7 * 2, LAYER7 * 2)


def test_fp32_has_no_master_copy_and_offload_leaves_the_device() -> None:
    assert model_state_bytes(L7, precision="fp32") == (P7 * 4, P7 * 4, P7 * 8)
    assert model_state_bytes(L7, shard=8, zero_stage=1, offload_optimizer=True)[2] == 0.0
    assert model_state_bytes(L7, shard=8, zero_stage=3, offload_params=True)[0] == 0.0
    with pytest.raises(ValueError, match="precision"):
        model_state_bytes(L7, precision="fp8")


def test_tp_and_pp_split_the_heaviest_stage() -> None:
    # The last of 2 stages: 16 layers + LM head + final norm.
    stage = 16 * LAYER7 + 32000 * 4096 + 4096
    assert stage_params(L7, 2) == stage
    assert model_state_bytes(L7, tp=2, pp=2)[0] == stage / 2 * 4


def test_korthikanti_gpt3_layer() -> None:
    # GPT-3 175B: s=2048, b=1, h=12288, a=96 -> sbh = 25_165_824 and 5as/h = 80.
    s, h, a = 2048, 12288, 96
    assert korthikanti_layer_bytes(s, 1, h, a, fused_attention=False) == 25_165_824 * 114
    assert korthikanti_layer_bytes(s, 1, h, a, fused_attention=True) == 25_165_824 * 34
    sp = korthikanti_layer_bytes(s, 1, h, a, tp=8, sequence_parallel=True, fused_attention=False)
    assert sp == 25_165_824 * 114 / 8
    no_sp = korthikanti_layer_bytes(s, 1, h, a, tp=8, fused_attention=False)
    assert no_sp == 25_165_824 * (10 + 24 / 8 + 80 / 8)


def test_activation_checkpointing_keeps_layer_inputs_plus_one_layer() -> None:
    sbh = 4096 * 4096
    logits = 4096 * 32000 * 4
    full = activation_bytes(L7, seq_len=4096, micro_batch=1)
    assert full == 32 * 34 * sbh + logits
    ac = activation_bytes(L7, seq_len=4096, micro_batch=1, activation_checkpointing=True)
    assert ac == 32 * 2 * sbh + 34 * sbh + logits
    # fp32 doubles every stored activation; the logits are fp32 either way.
    fp32 = activation_bytes(L7, seq_len=4096, micro_batch=1, precision="fp32")
    assert fp32 == 2 * (full - logits) + logits


def test_1f1b_stage_i_holds_pp_minus_i_micro_batches() -> None:
    block = 34 * 4096 * 4096
    kw = {"seq_len": 4096, "micro_batch": 1, "pp": 4}
    assert split_of(L7, 4) == [8, 9, 8, 7]
    # Rank 0: 8 blocks x 4 in flight; rank 1: 9 x 3.
    assert activation_bytes(L7, grad_accum=8, **kw) == 8 * 4 * block
    # Two micro-batches in flight at most: rank 1's 9 blocks x 2 outweigh rank 0's 8 x 2.
    assert activation_bytes(L7, grad_accum=2, **kw) == 9 * 2 * block
    # One micro-batch: on an even split the last stage (its blocks + the logits) wins.
    even = activation_bytes(L7, grad_accum=1, pp_layers=(8, 8, 8, 8), **kw)
    assert even == 8 * block + 4096 * 32000 * 4
    gpipe = activation_bytes(L7, grad_accum=8, pp_layers=(8, 8, 8, 8), pp_schedule="gpipe", **kw)
    assert gpipe == 8 * 8 * block + 8 * 4096 * 32000 * 4


def test_estimate_adds_gather_buffers_and_margin() -> None:
    dims = ParallelDims(world_size=64, dp_shard=64)
    layout = Layout(dims, zero_stage=3, micro_batch=1, grad_accum=1, activation_checkpointing=True)
    m = estimate_memory(L7, layout, seq_len=4096, margin=0.10)
    root = P7 - 32 * LAYER7  # embedding, final norm and head: never resharded after forward
    assert m.params == P7 * 4 / 64 + (root + 2 * LAYER7) * 2  # + running and prefetched block
    assert m.grads == P7 * 4 / 64 + LAYER7 * 4  # shard + one unsharded fp32 block gradient
    assert m.optimizer == P7 * 8 / 64
    used = m.params + m.grads + m.optimizer + m.activations
    assert m.total == pytest.approx(used / 0.9) and m.margin == pytest.approx(0.1 * m.total)
    assert m.as_gb()["total"] == pytest.approx(m.total / 1e9)
    ds = estimate_memory(L7, layout, seq_len=4096, margin=0.10, engine="deepspeed")
    assert ds.params == P7 * 2 / 64 + 2 * LAYER7 * 2
    assert ds.grads == P7 * 6 / 64 + LAYER7 * 2
    assert ds.activations == m.activations


def test_shape_for_params_is_llama_like() -> None:
    for n in (1.2e9, 7.5e9, 70e9, 405e9):
        shape = shape_for_params(n)
        assert abs(shape.num_params - n) <= shape.params_per_layer
        assert 0.5 < shape.n_layers * 128 / shape.dim < 2.0
    assert shape_for_params(7.5e9).dim == 4096
