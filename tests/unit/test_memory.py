"""Memory model against hand-computed numbers (ZeRO paper, Korthikanti et al. 2022)."""

from __future__ import annotations

import pytest

from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.memory import (
    activation_bytes,
    estimate_memory,
    korthikanti_layer_bytes,
    model_state_bytes,
    shape_for_params,
    stage_params,
)
from raytrain_dt.topology.parallel_dims import ParallelDims

L7 = PRESETS["llama-7b"]
P7 = 6_738_415_616  # 2*32000*4096 + 32*202_383_360 + 4096
LAYER7 = 202_383_360  # 4*4096^2 + 3*4096*11008 + 2*4096


def test_llama7b_parameter_count() -> None:
    assert L7.num_params == P7 and L7.params_per_layer == LAYER7


def test_7b_zero3_over_64_ranks_is_16_bytes_over_64() -> None:
    params, grads, opt = model_state_bytes(L7, shard=64, zero_stage=3)
    assert (params, grads, opt) == (P7 * 2 / 64, P7 * 2 / 64, P7 * 12 / 64)
    assert params + grads + opt == 1_684_603_904  # = P / 4


@pytest.mark.parametrize(
    ("zero", "bytes_per_param"),
    [(0, 16.0), (1, 2 + 2 + 12 / 8), (2, 2 + 2 / 8 + 12 / 8), (3, 16 / 8)],
)
def test_zero_stages_over_8_ranks(zero, bytes_per_param) -> None:
    assert sum(model_state_bytes(L7, shard=8, zero_stage=zero)) == pytest.approx(
        P7 * bytes_per_param
    )


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
    assert model_state_bytes(L7, tp=2, pp=2)[0] == stage / 2 * 2


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


def test_1f1b_first_stage_holds_pp_micro_batches() -> None:
    one = 8 * 34 * 4096 * 4096  # 8 layers per stage at pp=4
    kw = {"seq_len": 4096, "micro_batch": 1, "pp": 4}
    assert activation_bytes(L7, grad_accum=8, **kw) == 4 * one
    assert activation_bytes(L7, grad_accum=2, **kw) == 2 * one
    # With fewer micro-batches than stages the last stage (one micro-batch + logits) may win.
    assert activation_bytes(L7, grad_accum=1, **kw) == one + 4096 * 32000 * 4


def test_estimate_adds_gather_buffers_and_margin() -> None:
    dims = ParallelDims(world_size=64, dp_shard=64)
    layout = Layout(dims, zero_stage=3, micro_batch=1, grad_accum=1, activation_checkpointing=True)
    m = estimate_memory(L7, layout, seq_len=4096, margin=0.10)
    assert m.params == P7 * 2 / 64 + 2 * LAYER7 * 2  # shard + running and prefetched layer
    assert m.grads == P7 * 2 / 64 + LAYER7 * 2  # shard + one unsharded layer gradient
    assert m.optimizer == P7 * 12 / 64
    used = m.params + m.grads + m.optimizer + m.activations
    assert m.total == pytest.approx(used / 0.9) and m.margin == pytest.approx(0.1 * m.total)
    assert m.as_gb()["total"] == pytest.approx(m.total / 1e9)


def test_shape_for_params_is_llama_like() -> None:
    for n in (1.2e9, 7.5e9, 70e9, 405e9):
        shape = shape_for_params(n)
        assert abs(shape.num_params - n) <= shape.params_per_layer
        assert 0.5 < shape.n_layers * 128 / shape.dim < 2.0
    assert shape_for_params(7.5e9).dim == 4096
