"""Routing, capacity and the load-balancing loss of the MoE block on hand-checkable inputs; the
block against a token-by-token computation; the aux loss's gradient path; the layouts refused."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from raytrain_dt.engines.moe_step import check_moe_layout
from raytrain_dt.models.model_spec import llama_spec
from raytrain_dt.models.moe import (
    MoEFeedForward,
    capacity_keep,
    expert_capacity,
    load_balancing_loss,
    route,
    take_router_stats,
)
from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.parallel_dims import ParallelDims


def test_top_k_weights_are_renormalized_fp32_softmax_scores():
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
    scores, experts, weights = route(logits, top_k=2)
    torch.testing.assert_close(scores, torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert experts.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]))


def test_capacity_takes_each_sequences_earliest_assignments():
    assert expert_capacity(1.0, seq_len=4, top_k=2, n_experts=4) == 2
    assert expert_capacity(1.25, seq_len=4, top_k=1, n_experts=4) == 2  # ceil(1.25)
    assert expert_capacity(0.0, seq_len=4, top_k=2, n_experts=4) == 0  # no limit
    # Sequence 0: all four tokens pick experts 0 and 1, so both accept positions 0 and 1 only.
    # Sequence 1 is counted on its own: expert 0 gets positions 0 and 3, within capacity.
    experts = torch.tensor([[[0, 1], [1, 0], [0, 1], [1, 0]], [[0, 2], [3, 2], [1, 3], [0, 1]]])
    keep = capacity_keep(experts, n_experts=4, capacity=2)
    assert keep.tolist() == [
        [[True, True], [True, True], [False, False], [False, False]],
        [[True, True], [True, True], [True, True], [True, True]],
    ]
    assert capacity_keep(experts, 4, 0).all()


def test_load_balancing_loss_is_k_when_balanced_and_grows_with_imbalance():
    uniform = torch.full((1, 4, 4), 0.25)
    balanced = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    # 4 * sum_e (2/4 routed share) * (1/4 mean score) = 2 = k.
    assert load_balancing_loss(uniform, balanced, 4).tolist() == [pytest.approx(2.0)]
    # Every token to experts 0 and 1, which hold 0.4 of the score each: 4 * (1*0.4 + 1*0.4).
    skewed = torch.tensor([[[0.4, 0.4, 0.1, 0.1]] * 4])
    lopsided = torch.tensor([[[0, 1]] * 4])
    assert load_balancing_loss(skewed, lopsided, 4).tolist() == [pytest.approx(3.2)]


def _block(capacity_factor: float, coef: float = 0.01, seed: int = 0) -> MoEFeedForward:
    shape = dataclasses.replace(
        PRESETS["moe-tiny"], capacity_factor=capacity_factor, router_aux_loss_coef=coef
    )
    torch.manual_seed(seed)
    block = MoEFeedForward(shape)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


def _token_by_token(block: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The block's output computed one token at a time, capacity counted by hand."""
    e = block.experts
    batch, seq_len, _ = x.shape
    capacity = math.ceil(block.capacity_factor * seq_len * block.top_k / block.n_experts)
    out = torch.zeros_like(x)
    for b in range(batch):
        taken = [0] * block.n_experts
        for s in range(seq_len):
            scores = torch.softmax(block.router(x[b, s]).float(), -1)
            weights, chosen = scores.topk(block.top_k)
            for w, i in zip((weights / weights.sum()).tolist(), chosen.tolist(), strict=True):
                taken[i] += 1
                if capacity and taken[i] > capacity:
                    continue
                h = F.silu(e.w1[i] @ x[b, s]) * (e.w3[i] @ x[b, s])
                out[b, s] += w * (e.w2[i] @ h)
    return out


def test_block_equals_the_token_by_token_computation_and_counts_its_drops():
    block = _block(capacity_factor=0.5)
    x = torch.randn(3, 8, 64)
    with torch.no_grad():
        assert torch.allclose(block(x), _token_by_token(block, x), atol=1e-5)
    # Evaluation forwards are not counted; training forwards are.
    assert take_router_stats(block, torch.device("cpu"), 4).sum() == 0
    block(torch.randn(3, 8, 64, requires_grad=True))  # counted, then left out: forwards=1
    block(x.requires_grad_())
    stats = take_router_stats(block, torch.device("cpu"), forwards=1)
    # capacity ceil(0.5 * 8 * 2 / 4) = 2 per expert and sequence: at most 8 of 16 kept each.
    accepted, dropped = stats[:-1], int(stats[-1])
    assert int(accepted.sum()) + dropped == 3 * 8 * 2
    counts = _per_sequence_counts(block, x)
    assert dropped == sum(max(0, c - 2) for c in counts) > 0
    per_expert = torch.tensor([min(c, 2) for c in counts]).view(3, 4).sum(dim=0)
    assert accepted.tolist() == per_expert.tolist()
    assert take_router_stats(block, torch.device("cpu"), 4).sum() == 0  # taken: reset


def _per_sequence_counts(block: MoEFeedForward, x: torch.Tensor) -> list[int]:
    _, experts, _ = route(block.router(x), block.top_k)
    return F.one_hot(experts, block.n_experts).sum(dim=(1, 2)).flatten().tolist()


def test_aux_loss_gradient_is_added_without_changing_the_output():
    """The autoscaler's gradient equals backpropagating output loss + coef * mean aux loss."""
    x = torch.randn(2, 8, 64)
    block = _block(capacity_factor=0.0, coef=0.1)
    out = block(x)
    out.pow(2).mean().backward()
    attached = [p.grad.clone() for p in block.parameters()]
    plain = _block(capacity_factor=0.0, coef=0.0)
    torch.testing.assert_close(out, plain(x))  # the forward is unchanged
    out = plain(x)
    scores, experts, _ = route(plain.router(x), plain.top_k)
    aux = 0.1 * load_balancing_loss(scores, experts, plain.n_experts).mean()
    (out.pow(2).mean() + aux).backward()
    for got, want in zip(attached, [p.grad for p in plain.parameters()], strict=True):
        torch.testing.assert_close(got, want)
    assert block.router.weight.grad.abs().sum() > 0


def test_layouts_an_moe_model_is_refused_in():
    moe = llama_spec(PRESETS["moe-tiny"]).skeleton(64)
    dense = llama_spec(PRESETS["tiny"]).skeleton(64)

    def layout(**dims) -> Layout:
        return Layout(ParallelDims(world_size=dims.pop("world"), **dims), 3, 1, 1)

    check_moe_layout(moe, "moe-tiny", layout(world=4, dp_shard=4, ep=2))
    with pytest.raises(ValueError, match=r"^parallel\.ep: 3 does not divide model\.n_experts=4"):
        check_moe_layout(moe, "moe-tiny", layout(world=3, dp_shard=3, ep=3))
    with pytest.raises(ValueError, match=r"^parallel\.ep: model 'tiny' has no experts"):
        check_moe_layout(dense, "tiny", layout(world=2, dp_shard=2, ep=2))
    check_moe_layout(moe, "moe-tiny", layout(world=2, pp=2))
    with pytest.raises(ValueError, match=r"^parallel\.tp: "):
        check_moe_layout(moe, "moe-tiny", layout(world=2, tp=2))
    check_moe_layout(moe, "moe-tiny", layout(world=2, cp=2))


def test_router_stats_reach_the_metrics_record_only_for_moe_models():
    from raytrain_dt.engines.base import RouterStats
    from raytrain_dt.worker.reports import StepMetrics, StepReport

    def record(router) -> dict:
        router = None if router is None else router.as_record()
        metrics = StepMetrics(1.0, 1e-3, 0.5, 1.0, 0.0, 100.0, router=router)
        return StepReport(step=1, consumed_samples=8, finished_at=0.0, metrics=metrics).as_record()

    moe = record(RouterStats(tokens_per_expert=[3, 1, 0, 4], dropped=2))
    assert moe["router"] == {"tokens_per_expert": [3, 1, 0, 4], "dropped": 2, "drop_rate": 0.2}
    assert "router" not in record(None)
    from raytrain_dt.observe.trackers import step_values

    assert step_values(moe)["moe/drop_rate"] == 0.2
    assert "moe/drop_rate" not in step_values(record(None))


@pytest.mark.parametrize(
    ("model_type", "overrides", "expected"),
    [
        (
            "mixtral",
            {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 96},
            (8, 2, 96, 0),
        ),
        (
            "qwen2_moe",
            {
                "num_experts": 6,
                "num_experts_per_tok": 4,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 128,
            },
            (6, 4, 32, 128),
        ),
    ],
)
def test_hf_moe_configs_give_the_planner_their_experts(model_type, overrides, expected):
    pytest.importorskip("transformers")
    from raytrain_dt.models.hf_config import load_config, shape_of

    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    base["num_key_value_heads"] = 2
    shape = shape_of(load_config(model_type, {**base, **overrides}))
    got = (shape.n_experts, shape.experts_per_token, shape.expert_hidden, shape.shared_ffn_hidden)
    assert got == expected
    assert shape.expert_params_per_layer == expected[0] * 3 * 64 * expected[2]


def test_an_moe_preset_is_not_exported_as_a_llama():
    from raytrain_dt.checkpoint.export import preset_format
    from raytrain_dt.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model\.preset: a mixture-of-experts preset"):
        preset_format(PRESETS["moe-tiny"], 64)


def test_deepspeed_refuses_moe_models(tmp_path):
    from conftest import REPO

    from raytrain_dt.config import load_config
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.factory import build_engine

    cfg = load_config(
        REPO / "conf" / "test.yaml",
        [f"run.dir={tmp_path}", "model.preset=moe-tiny", "engine.name=deepspeed"],
    )
    layout = Layout(ParallelDims(world_size=2, dp_shard=2), 1, 1, 1)
    build = EngineBuild(llama_spec(PRESETS["moe-tiny"]), cfg, layout, mesh=None, device=None)
    with pytest.raises(ValueError, match=r"^engine\.name: deepspeed does not train mixture"):
        build_engine(build)
