"""The planner side of context (cp) and expert (ep) parallelism: the memory and step-time terms
against hand-computed numbers, the planner's choices for a long sequence and a MoE shape, the
one-line refusals (exit code 2 through both CLIs), layout records, and elastic re-planning of
a pinned ep on fewer ranks."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

from raytrain_dt.cli import main
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.errors import ConfigError
from raytrain_dt.models.presets import PRESETS
from raytrain_dt.sim.costs import Costs
from raytrain_dt.sim.runner import Setup, scale_config
from raytrain_dt.sim.sim_planner import SimPlanner
from raytrain_dt.sim.strategies import _replica_dims
from raytrain_dt.sim.trace import DOWN, UP, Trace
from raytrain_dt.topology.calibration import INTER_NODE_BUS_EFFICIENCY, INTRA_NODE_BUS_EFFICIENCY
from raytrain_dt.topology.cost import (
    attention_share,
    estimate_step_time,
    expert_all_to_all_s,
    ring_attention_s,
)
from raytrain_dt.topology.degree_grid import cp_degrees
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.memory import (
    activation_bytes,
    korthikanti_layer_bytes,
    model_state_bytes,
    ring_buffer_bytes,
    shape_for_params,
    working_state_bytes,
)
from raytrain_dt.topology.nodes import NodeInfo
from raytrain_dt.topology.parallel_dims import ParallelDims
from raytrain_dt.topology.pins import LayoutPins, engine_refusal
from raytrain_dt.topology.plan_cli import add_plan_arguments, run_plan
from raytrain_dt.topology.planner import plan
from raytrain_dt.topology.run_plan import check_parallel_pins, plan_for_nodes

L7, MIXTRAL, MOE_TINY = PRESETS["llama-7b"], PRESETS["mixtral-8x7b"], PRESETS["moe-tiny"]


def _layout(world=1, *, zero=1, mb=1, ga=1, ac=False, **dims) -> Layout:
    return Layout(ParallelDims(world_size=world, **dims), zero, mb, ga, ac)


# --- memory ------------------------------------------------------------------------------------
def test_cp_halves_activations_exactly_plus_the_ring_buffers() -> None:
    # llama-7b, one 8192-token sequence, no TP: 32 layers x 34sbh + fp32 logits.
    whole = activation_bytes(L7, seq_len=8192, micro_batch=1)
    assert whole == 32 * 34 * 8192 * 4096 + 8192 * 32000 * 4 == 37_555_798_016
    # cp=2: each rank holds 4096 tokens, plus the ring's K/V in flight (send and receive, and
    # dK/dV in backward): 4 x K and V of its 4096 tokens x 32 heads x 128 x 2 bytes.
    ring = ring_buffer_bytes(L7, seq_len=8192, micro_batch=1, cp=2)
    assert ring == 4 * 2 * 4096 * 32 * 128 * 2 == 268_435_456
    half = activation_bytes(L7, seq_len=8192, micro_batch=1, cp=2)
    assert half == whole / 2 + ring == 19_046_334_464
    # The same with checkpointing, TP + SP and a pipeline: everything stored is linear in tokens.
    kw = {"micro_batch": 2, "tp": 2, "sequence_parallel": True, "pp": 4, "grad_accum": 8}
    for ac in (False, True):
        one = activation_bytes(L7, seq_len=8192, activation_checkpointing=ac, **kw)
        four = activation_bytes(L7, seq_len=8192, activation_checkpointing=ac, cp=4, **kw)
        ring4 = ring_buffer_bytes(L7, seq_len=8192, micro_batch=2, cp=4, tp=2)
        assert four - ring4 == pytest.approx(one / 4, rel=1e-12)


def test_cp_shards_the_fsdp2_states_over_dp_shard_times_cp() -> None:
    assert model_state_bytes(L7, shard=4, zero_stage=3, cp=2) == model_state_bytes(
        L7, shard=8, zero_stage=3
    )
    # Zero 0 with cp: FSDP2's shard mesh is dp_shard x cp = cp.
    p, g, o = model_state_bytes(L7, shard=1, zero_stage=0, cp=4)
    assert (p, g, o) == (L7.num_params * 4 / 4, L7.num_params * 4 / 4, L7.num_params * 8 / 4)


def test_expert_states_divide_by_ep() -> None:
    experts = MIXTRAL.expert_params  # 32 x 8 x 3 x 4096 x 14336
    assert experts == 45_097_156_608
    dense = MIXTRAL.num_params - experts
    # dp_shard = ep = 8: a rank holds 1/ep of the experts, unsharded by FSDP (dp_shard/ep = 1);
    # FSDP2 keeps fp32 params, grads and Adam (4 + 4 + 8 bytes).
    p, g, o = model_state_bytes(MIXTRAL, shard=8, zero_stage=1, ep=8)
    assert (p, g, o) == pytest.approx(tuple(x * (dense / 8 + experts / 8) for x in (4, 4, 8)))
    # Resident states are 1/dp_shard of the experts with or without ep (FSDP shards them over
    # dp_shard instead): at dp_shard=16, ep=2 they are the same as ep=8 over 16 ranks.
    assert model_state_bytes(MIXTRAL, shard=16, zero_stage=1, ep=2) == pytest.approx(
        model_state_bytes(MIXTRAL, shard=16, zero_stage=1, ep=8)
    )
    # With cp, FSDP2 shards the non-expert states over dp_shard x cp, but the experts only
    # over dp_shard/ep: the cp ranks hold the same expert shards (`expert_fsdp_mesh`).
    assert model_state_bytes(MIXTRAL, shard=8, zero_stage=1, ep=8, cp=2) == pytest.approx(
        tuple(x * (dense / 16 + experts / 8) for x in (4, 4, 8))
    )
    # What ep cuts is the unsharded copy a rank gathers (zero 1/2 keep every block's) and the
    # gradients it holds before reducing them: 1/ep of the experts.
    full, _ = working_state_bytes(MIXTRAL, shard=8, zero_stage=1, ep=1)
    split, _ = working_state_bytes(MIXTRAL, shard=8, zero_stage=1, ep=8)
    assert full == MIXTRAL.num_params * 2
    assert split == pytest.approx((dense + experts / 8) * 2)
    # Zero 3 gathers the root and two blocks at a time: each block's experts / ep.
    z3, _ = working_state_bytes(MIXTRAL, shard=8, zero_stage=3, ep=4)
    block = MIXTRAL.params_per_layer - MIXTRAL.expert_params_per_layer * 3 / 4
    root = MIXTRAL.num_params - MIXTRAL.n_layers * MIXTRAL.params_per_layer
    assert z3 == pytest.approx((root + 2 * block) * 2)


def test_moe_blocks_store_k_routed_copies_of_the_mlp_activations() -> None:
    # Mixtral routes each token through 2 experts of ffn_hidden: the MLP's 19sbh twice over.
    sbh = 4096 * 1 * 4096
    assert (
        activation_bytes(MIXTRAL, seq_len=4096, micro_batch=1)
        == 32 * sbh * (34 + 19) + 4096 * 32000 * 4
    )
    assert korthikanti_layer_bytes(4096, 1, 4096, 32, mlp_scale=2.0) == sbh * 53


# --- step time ---------------------------------------------------------------------------------
def test_all_to_all_time_grows_when_the_ep_group_crosses_nodes() -> None:
    lay = _layout(8, dp_shard=8, ep=8, mb=2, ga=4)
    one_node, four_nodes = Topology(1, 8), Topology(4, 2)
    kw = {"seq_len": 4096, "precision": "bf16"}
    intra = expert_all_to_all_s(MIXTRAL, lay, one_node, **kw)
    inter = expert_all_to_all_s(MIXTRAL, lay, four_nodes, **kw)
    # 2 + 2 all-to-alls per block, 32 blocks, 4 micro-batches; each moves 7/8 of the rank's
    # 2 x 4096 tokens x top-2 x 4096 dims x 2 bytes, with 7 latency steps.
    msg = 2 * 4096 * 2 * 4096 * 2
    bw_in = one_node.intra_node_bandwidth * INTRA_NODE_BUS_EFFICIENCY
    bw_out = four_nodes.inter_node_bandwidth * INTER_NODE_BUS_EFFICIENCY
    assert intra == pytest.approx(4 * 32 * 4 * (7 / 8 * msg / bw_in + 7 * 5e-6))
    assert inter == pytest.approx(4 * 32 * 4 * (7 / 8 * msg / bw_out + 7 * 20e-6))
    assert inter > 8 * intra
    # In the step: on the critical path, in full; checkpointing repeats the forward two.
    t = estimate_step_time(MIXTRAL, lay, one_node, **kw)
    assert t.ep_comm_s == intra
    ac = dataclasses.replace(lay, activation_checkpointing=True)
    assert expert_all_to_all_s(MIXTRAL, ac, one_node, **kw) == pytest.approx(intra * 6 / 4)
    assert expert_all_to_all_s(MIXTRAL, _layout(8, dp_shard=8), one_node, **kw) == 0.0


def test_ring_attention_hides_behind_attention_and_cp_splits_the_compute() -> None:
    topo, kw = Topology(1, 8), {"seq_len": 131072, "precision": "bf16"}
    base = estimate_step_time(L7, _layout(1, zero=0), topo, **kw)
    lay = _layout(4, cp=4, zero=0)
    t = estimate_step_time(L7, lay, topo, **kw)
    assert t.compute_s == pytest.approx(base.compute_s / 4)
    # 3 passes (K/V forward; K/V and dK/dV backward) x 3 hops x 32 layers, of a rank's
    # 32768 tokens' K and V (32 heads x 128, bf16), on NVLink.
    chunk = 2 * 32768 * 32 * 128 * 2
    bw = topo.intra_node_bandwidth * INTRA_NODE_BUS_EFFICIENCY
    ring = 3 * 3 * 32 * (5e-6 + chunk / bw)
    assert ring_attention_s(L7, lay, topo, **kw) == pytest.approx(ring)
    # At 131072 tokens attention is most of the compute: the ring hides behind it, taxed.
    assert attention_share(L7, 131072) > 0.8
    assert t.cp_hidden_s == pytest.approx(ring) and t.cp_comm_s == pytest.approx(0.1 * ring)


# --- the planner's choices ---------------------------------------------------------------------
def test_cp_is_a_candidate_only_where_a_long_sequence_demands_it() -> None:
    topo, pins = Topology(8, 8), LayoutPins()
    assert cp_degrees(L7, topo, pins, 4096, "bf16") == [1]
    assert cp_degrees(PRESETS["llama-70b"], topo, pins, 8192, "bf16") == [1]
    assert cp_degrees(L7, topo, pins, 131072, "bf16") == [1, 2, 4, 8, 16, 32, 64]
    assert cp_degrees(L7, topo, LayoutPins(cp=2), 4096, "bf16") == [2]


def test_long_sequence_plan_picks_cp_and_says_why() -> None:
    shape = shape_for_params(8e9)
    p = plan(shape, Topology(8, 8), global_batch=32, seq_len=131072)
    d = p.best.layout.dims
    assert d.cp > 1 and d.world_size == 64
    assert f"cp={d.cp} cuts them to" in p.best.reason
    assert "131072-token sequence(s) need" in p.best.reason
    assert "cp=1 layout is" in p.best.reason  # the cp=1 alternative and how much slower it is


def test_moe_plan_picks_ep_and_says_why() -> None:
    p = plan(MIXTRAL, Topology(8, 8), global_batch=1024, seq_len=4096)
    d = p.best.layout.dims
    assert d.ep > 1 and d.dp_shard % d.ep == 0 and MIXTRAL.n_experts % d.ep == 0
    assert f"ep={d.ep} splits each block's 8 experts" in p.best.reason
    assert p.best.step_time.ep_comm_s > 0
    # No tensor parallelism for MoE blocks (not built): no candidate has it.
    assert all(c.layout.dims.tp == 1 for c in [p.best, *p.alternatives])
    # DeepSpeed-MoE is not wired in: a MoE model under DeepSpeed is refused, ep or not.
    with pytest.raises(ConfigError, match=r"^engine\.name: deepspeed does not train mixture"):
        plan(MIXTRAL, Topology(8, 8), global_batch=1024, seq_len=4096, engine="deepspeed")


def test_pinned_cp_and_ep_give_layouts_with_those_degrees() -> None:
    cpu = Topology(1, 4, memory_per_accelerator=8e9)
    two = Topology(1, 2, memory_per_accelerator=8e9)
    best = plan(PRESETS["tiny"], two, global_batch=8, seq_len=64, pins=LayoutPins(cp=2)).best
    assert best.layout.dims == ParallelDims(world_size=2, cp=2)
    best = plan(MOE_TINY, cpu, global_batch=8, seq_len=64, pins=LayoutPins(ep=2)).best
    d = best.layout.dims
    assert d.ep == 2 and d.dp_shard % 2 == 0 and best.layout.zero_stage >= 1
    # From a config, as training plans it.
    cfg = TrainConfig()
    cfg.parallel.ep, cfg.parallel.cp = 2, 2
    pins = LayoutPins.from_config(cfg)
    assert (pins.cp, pins.ep) == (2, 2)
    best = plan(MOE_TINY, cpu, global_batch=8, seq_len=64, pins=pins).best
    assert (best.layout.dims.cp, best.layout.dims.ep, best.layout.dims.dp_shard) == (2, 2, 2)


def test_layout_records_carry_cp_and_ep_and_read_back_equal() -> None:
    lay = _layout(16, dp_shard=4, cp=2, tp=2, ep=4, zero=3, mb=2, ga=3)
    assert "cp=2" in lay.describe() and "ep=4" in lay.describe()
    record = json.loads(json.dumps(lay.as_dict()))
    assert record["dims"]["cp"] == 2 and record["dims"]["ep"] == 4
    assert Layout.from_dict(record) == lay
    best = plan(MOE_TINY, Topology(1, 4), global_batch=8, seq_len=64, pins=LayoutPins(ep=2)).best
    assert best.layout.dims.ep == 2
    j = plan(MOE_TINY, Topology(1, 4), global_batch=8, seq_len=64, pins=LayoutPins(ep=2))
    assert j.to_json()["layout"]["ep"] == 2 and j.to_json()["layout"]["cp"] == 1


# --- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "pins", "kw", "message"),
    [
        (MOE_TINY, LayoutPins(ep=3), {}, "parallel.ep: 3 does not divide model.n_experts=4"),
        (
            MOE_TINY,
            LayoutPins(tp=2),
            {},
            "parallel.tp: 2 is not built for mixture-of-experts blocks (model.n_experts=4): "
            "their experts are split by parallel.ep; use parallel.tp=1",
        ),
        (
            PRESETS["tiny"],
            LayoutPins(ep=2),
            {},
            "parallel.ep: 2 needs a mixture-of-experts model; model.n_experts is 0",
        ),
        (
            PRESETS["tiny"],
            LayoutPins(cp=3),
            {},
            "parallel.cp: 3 does not split data.seq_len=64 into 2 x cp = 6 equal chunks",
        ),
        (
            MOE_TINY,
            LayoutPins(ep=4, dp_shard=2),
            {},
            "parallel.ep: 4 does not divide parallel.dp_shard (2): expert parallelism splits "
            "the experts over dp_shard ranks",
        ),
        (
            MOE_TINY,
            LayoutPins(ep=4, tp=2),
            {},
            "parallel.ep: 4 exceeds the 2 dp_shard ranks the cluster's 4 accelerators leave "
            "beside the other degrees",
        ),
        (
            PRESETS["tiny"],
            LayoutPins(cp=4, tp=2),
            {},
            "parallel.cp: tp(2) x cp(4) = 8 exceeds the cluster's 4 accelerators",
        ),
        (
            PRESETS["tiny"],
            LayoutPins(cp=2),
            {"cp_attention": False},
            "parallel.cp: 2 needs context-parallel attention, which model.hf models do not have "
            "(only the built-in Llama decoder splits a sequence over cp ranks); use parallel.cp=1",
        ),
        (
            PRESETS["tiny"],
            LayoutPins(cp=2),
            {"engine": "deepspeed", "precision": "fp32"},
            "parallel.cp: 2 is not supported with engine.name=deepspeed (DeepSpeed's own Ulysses "
            "sequence parallelism is not wired into this project); use engine.name=fsdp2 or "
            "parallel.cp=1",
        ),
        (
            MOE_TINY,
            LayoutPins(ep=2),
            {"engine": "deepspeed", "precision": "fp32"},
            "engine.name: deepspeed does not train mixture-of-experts models in this project "
            "(DeepSpeed-MoE is not wired in); use engine.name=fsdp2",
        ),
    ],
)
def test_bad_cp_and_ep_are_one_line_naming_the_key(shape, pins, kw, message) -> None:
    with pytest.raises(ConfigError) as info:
        plan(shape, Topology(1, 4), global_batch=8, seq_len=64, pins=pins, **kw)
    assert str(info.value) == message


def test_deepspeed_refuses_cp_and_ep() -> None:
    assert engine_refusal("deepspeed", 1, 1, 1, cp=2).startswith("parallel.cp: 2 ")
    assert engine_refusal("deepspeed", 1, 1, 1, ep=2).startswith("parallel.ep: 2 ")
    assert engine_refusal("fsdp2", 1, 1, 1, cp=2, ep=2) is None


def _plan_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["--model", "moe-tiny", "--gpus", "4", "--ep", "3"], "parallel.ep: 3 does not divide"),
        (["--model", "tiny", "--gpus", "4", "--ep", "2"], "parallel.ep: 2 needs a mixture"),
        (["--model", "tiny", "--gpus", "4", "--seq-len", "64", "--cp", "3"], "parallel.cp: 3"),
        (
            [
                "--model",
                "tiny",
                "--gpus",
                "4",
                "--seq-len",
                "64",
                "--cp",
                "2",
                "--engine",
                "deepspeed",
                "--precision",
                "fp32",
            ],
            "parallel.cp: 2 is not supported with engine.name=deepspeed",
        ),
        (["--params", "1e9", "--gpus", "8", "--active-experts", "2"], "--active-experts:"),
        (["--model", "llama-7b", "--gpus", "8", "--experts", "8"], "--experts/--active-experts:"),
        (["--params", "1e9", "--gpus", "8", "--experts", "4", "--active-experts", "5"], "--act"),
    ],
)
def test_plan_cli_refusals_exit_2_with_one_line(argv, start, capsys) -> None:
    assert _plan_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {start}")


def test_plan_cli_moe_params_and_long_sequence(capsys) -> None:
    argv = ["--params", "47e9", "--experts", "8", "--active-experts", "2", "--nodes", "8"]
    assert _plan_cli([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["layout"]["ep"] > 1 and "ep=" in record["reason"]
    assert _plan_cli(["--params", "8e9", "--nodes", "8", "--seq-len", "131072"]) == 0
    out = capsys.readouterr().out
    assert "cuts them to" in out and "ring K/V traffic behind attention" in out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["parallel.ep=2"],
            "parallel.ep: 2 needs a mixture-of-experts model; model.n_experts is 0",
        ),
        (
            ["model.preset=moe-tiny", "parallel.ep=3"],
            "parallel.ep: 3 does not divide model.n_experts=4",
        ),
        (
            ["engine.name=deepspeed", "parallel.cp=2"],
            "parallel.cp: 2 is not supported with engine.name=deepspeed (DeepSpeed's own Ulysses "
            "sequence parallelism is not wired into this project); use engine.name=fsdp2 or "
            "parallel.cp=1",
        ),
    ],
)
def test_train_cli_refuses_bad_cp_and_ep_before_any_actor_starts(
    overrides, message, capsys, tmp_path
) -> None:
    code = main(["train", "conf/tiny.yaml", *overrides, f"run.dir={tmp_path}/r"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "r").exists()


def test_cp_with_a_hugging_face_model_is_refused_before_planning() -> None:
    cfg = TrainConfig()
    cfg.model.hf, cfg.parallel.cp = "/models/some-llama", 2
    with pytest.raises(ConfigError, match=r"^parallel\.cp: 2 needs context-parallel attention"):
        check_parallel_pins(cfg, PRESETS["tiny"])
    cfg.parallel.cp = None
    check_parallel_pins(cfg, PRESETS["tiny"])


# --- elasticity --------------------------------------------------------------------------------
def test_elastic_replan_keeps_a_pinned_ep_as_an_upper_bound() -> None:
    """moe-tiny pinned at ep=4 on 4 ranks; the re-plans on 2 and 1 ranks run at the largest ep
    they can hold (2, then 1), and the pin returns with the ranks."""
    cfg = TrainConfig()
    cfg.model.preset, cfg.parallel.ep = "moe-tiny", 4
    cfg.trainer.global_batch, cfg.data.seq_len = 8, 64
    cfg.cluster.memory_per_accelerator_gb = 8.0

    def ep_on(ranks: int) -> int:
        nodes = tuple(NodeInfo(f"n{i}", 1, 16e9) for i in range(ranks))
        planned = plan_for_nodes(cfg, MOE_TINY, "GPU", nodes)
        assert planned is not None
        d = planned.best.layout.dims
        assert d.world_size <= ranks and d.dp_shard % d.ep == 0
        return d.ep

    assert [ep_on(4), ep_on(2), ep_on(1), ep_on(4)] == [4, 2, 1, 4]
    # A pin the config itself breaks is no reason to relax: it stays the one-line error.
    cfg.parallel.ep = 3
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 3 does not divide model\.n_experts"):
        plan_for_nodes(cfg, MOE_TINY, "GPU", (NodeInfo("n0", 4, 16e9),))


def test_simulated_shrink_replans_a_pinned_ep_and_grows_back() -> None:
    """The simulator plans through the coordinator's `plan_for_nodes`: moe-tiny pinned at ep=4
    on 2 nodes x 2 GPUs runs at ep=2 on the node left after a loss, and at ep=4 once it is
    back; every formation's layout record reads back equal."""
    cfg = scale_config("moe-tiny", 2, 64, 8)
    cfg.parallel.ep = 4
    costs = Costs(
        detection_s=10,
        replan_s=0,
        reform_s=20,
        actor_start_s=30,
        first_step_extra_s=0,
        ckpt_save_s=0,
        ckpt_load_s=5,
        ckpt_stall_s=0,
        step_s_by_world={4: 1.0, 2: 2.0},
    )
    setup = Setup(SimPlanner(cfg), costs, 2, 2, cfg.elastic, 0)
    trace = Trace(2, 2000.0, np.array([100.5, 300.0]), np.array([DOWN, UP]), np.array([1, 1]))
    result = setup.run("ours", trace, ckpt_every=30)
    eps = [(f["world"], f["layout"]["dims"]["ep"]) for f in result.formations]
    assert eps == [(4, 4), (2, 2), (4, 4)]
    for f in result.formations:
        assert Layout.from_dict(json.loads(json.dumps(f["layout"]))).as_dict() == f["layout"]


def test_dp_only_baseline_keeps_the_full_layouts_cp_and_what_ep_its_shards_hold() -> None:
    full = ParallelDims(16, dp_shard=4, cp=2, tp=2, ep=4)
    assert _replica_dims(full, 8, 3) == ParallelDims(
        24, dp_replicate=3, dp_shard=2, cp=2, tp=2, ep=2
    )
    assert _replica_dims(full, 16, 1) == full
