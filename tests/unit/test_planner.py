"""Planner: practitioners' regimes, exact global batch, pins, errors, determinism, CLI, speed.

Also the step-time model's orderings that the regimes rest on.
"""

from __future__ import annotations

import argparse
import json
import time

import pytest

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.errors import ConfigError, PlanningError
from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.cost import (
    all_gather_s,
    all_reduce_s,
    estimate_step_time,
    reduce_scatter_s,
)
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.parallel_dims import ParallelDims
from raytrain_dt.topology.pins import LayoutPins, engine_refusal
from raytrain_dt.topology.plan_cli import add_plan_arguments, run_plan
from raytrain_dt.topology.plan_result import Plan
from raytrain_dt.topology.planner import plan

H100 = 80e9


def _plan(model: str, nodes: int, per_node: int = 8, *, gb: int = 256, seq: int = 4096, **kw):
    topo = Topology(nodes, per_node, memory_per_accelerator=H100)
    return plan(PRESETS[model], topo, global_batch=gb, seq_len=seq, **kw)


# --- regimes -------------------------------------------------------------------------------
def test_small_model_gets_plain_data_parallel() -> None:
    best = _plan("llama-1b", 1).best
    lay, d = best.layout, best.layout.dims
    assert (d.tp, d.pp, d.dp, lay.zero_stage) == (1, 1, 8, 0)
    assert (d.dp_replicate, d.dp_shard) == (8, 1)
    assert "plain DP fits" in best.reason


def test_7b_on_one_node_needs_sharding_but_no_model_parallelism() -> None:
    best = _plan("llama-7b", 1).best
    d = best.layout.dims
    assert (d.tp, d.pp, d.dp) == (1, 1, 8)
    assert best.layout.zero_stage >= 1  # 16 B/param = 108 GB: plain DP cannot fit
    assert "zero>=1 needed" in best.reason


def test_13b_on_one_node_without_a_pipeline_gets_fsdp() -> None:
    # Free, the calibrated model puts pp=4 x ZeRO-1 2% ahead (512 micro-batches leave a 0.6%
    # bubble, FSDP's gathers at NCCL's bus bandwidth cost more overlap tax); without it, FSDP.
    best = _plan("llama-13b", 1, pins=LayoutPins(pp=1)).best
    d = best.layout.dims
    assert (d.tp, d.pp, d.dp_shard, best.layout.zero_stage) == (1, 1, 8, 3)


def test_7b_on_four_nodes_gets_hsdp() -> None:
    best = _plan("llama-7b", 4, gb=512).best
    d = best.layout.dims
    assert (d.tp, d.pp, best.layout.zero_stage) == (1, 1, 3)
    assert (d.dp_replicate, d.dp_shard) == (4, 8)  # shard on NVLink, replicate across nodes


def test_70b_gets_tp_within_node_and_pp_across_nodes() -> None:
    p = _plan("llama-70b", 8, gb=1024)
    d = p.best.layout.dims
    assert d.tp > 1 and d.pp > 1 and 8 % d.tp == 0
    assert (
        "within a node" in p.best.reason and "faster than data parallelism alone" in p.best.reason
    )
    assert p.best.layout.sequence_parallel
    assert p.best.memory.total <= H100


def test_405b_on_16_nodes_needs_model_parallelism_and_gets_uneven_stages() -> None:
    best = _plan("llama-405b", 16, gb=1024).best
    # 126 layers on 64 stages (1 or 2 blocks each, the end stages also carrying the embedding
    # and head): 1024 micro-batches leave a 6% bubble, less than tp=8's all-reduces cost.
    assert (best.layout.dims.tp, best.layout.dims.pp) == (2, 64)
    assert "no data-parallel-only layout fits" in best.reason


# --- invariants ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "nodes", "per_node", "gb"),
    [("llama-7b", 1, 8, 96), ("llama-70b", 4, 8, 768), ("tiny", 1, 4, 12), ("llama-1b", 2, 8, 48)],
)
def test_global_batch_is_kept_exactly(model, nodes, per_node, gb) -> None:
    p = _plan(model, nodes, per_node, gb=gb, seq=2048)
    for c in [p.best, *p.alternatives]:
        assert c.layout.global_batch == gb
        assert c.memory.total <= H100


def test_uneven_batch_on_all_accelerators_beats_a_smaller_exact_world() -> None:
    # 24 GPUs: dp is always 3 x 2^k for 32 layers and tp | 8, and 3 does not divide 64. Reading
    # 2 or 3 samples per rank (72 slots, 8 padded) beats 4 each on 16 GPUs.
    p = _plan("llama-7b", 3, gb=64)
    lay = p.best.layout
    assert lay.dims.world_size == 24 and lay.global_batch == 64
    assert lay.batch_slots == 72 and lay.padded_slots == 8
    assert "dp=24 reads 2 or 3 each of 64; 8 padded slots" in p.best.reason
    exact = _plan("llama-7b", 2, gb=64).best  # the best 16-GPU layout
    assert p.best.step_time.total_s < exact.step_time.total_s


def test_padding_is_priced_and_exact_layouts_win_when_as_fast() -> None:
    from raytrain_dt.topology.layout import CPU_PEAK_FLOPS

    def best(ranks, gb, **kw):
        topo = Topology(1, ranks, memory_per_accelerator=8e9, peak_flops=CPU_PEAK_FLOPS)
        return plan(PRESETS["tiny"], topo, global_batch=gb, seq_len=64, precision="fp32", **kw).best

    # 3 CPU ranks of global batch 16: 5/5/6 in 6 slots each beats 8 each on 2 ranks.
    three = best(3, 16)
    assert (three.layout.dims.dp, three.layout.batch_slots, three.layout.global_batch) == (
        3,
        18,
        16,
    )
    assert three.reason.endswith("dp=3 reads 5/5/6 of 16; 2 padded slots")
    assert three.step_time.total_s < best(2, 16).step_time.total_s
    # Where dp divides the batch nothing is padded, and pipeline stages never pad.
    assert best(4, 16).layout.padded_slots == 0
    assert best(3, 16, pins=LayoutPins(pp=2)).layout.dims.dp in (1, 2)
    assert best(3, 16, pins=LayoutPins(pp=2)).layout.padded_slots == 0
    # Both micro_batch and grad_accum pinned: exact only. One pinned: slots round up to it.
    assert best(3, 16, pins=LayoutPins(micro_batch=2, grad_accum=4)).layout.dims.dp == 2
    lay = best(3, 16, pins=LayoutPins(grad_accum=2)).layout
    assert (lay.dims.dp, lay.micro_batch, lay.grad_accum, lay.global_batch) == (3, 3, 2, 16)
    # grad_accum=4 rounds 6 slots up to 8, no faster than 8 each on 2 ranks: the exact 2 win.
    lay = best(3, 16, pins=LayoutPins(grad_accum=4)).layout
    assert (lay.dims.dp, lay.padded_slots) == (2, 0)


def test_layout_records_keep_the_real_batch_and_old_ones_load() -> None:
    dims = ParallelDims(world_size=3, dp_shard=3)
    padded = Layout(dims, 3, 3, 2, real_global_batch=16)
    assert (padded.global_batch, padded.batch_slots, padded.padded_slots) == (16, 18, 2)
    assert Layout.from_dict(padded.as_dict()) == padded
    old = Layout(ParallelDims(world_size=2, dp_shard=2), 3, 4, 2).as_dict()
    del old["real_global_batch"]  # written before uneven batches existed
    assert Layout.from_dict(old).global_batch == 16 and Layout.from_dict(old).padded_slots == 0
    # "Real batch = slots" is spelled 0, so equal layouts compare equal.
    assert Layout(dims, 3, 3, 2, real_global_batch=18) == Layout(dims, 3, 3, 2)
    with pytest.raises(ValueError, match="real_global_batch=19"):
        Layout(dims, 3, 3, 2, real_global_batch=19)
    with pytest.raises(ValueError, match="real_global_batch=2 "):  # a rank would read nothing
        Layout(dims, 3, 3, 2, real_global_batch=2)


def test_fewer_accelerators_win_a_throughput_tie() -> None:
    from raytrain_dt.topology.planner import THROUGHPUT_TIE

    # 1023 nodes for 1024 samples at 8 GPUs per sample: some rank must hold 2 samples, so
    # 512 nodes reach the same throughput (within the tie band) as all 1023.
    topo = Topology(1023, 8, memory_per_accelerator=H100)
    p = plan(
        PRESETS["llama-70b"], topo, global_batch=1024, seq_len=4096, pins=LayoutPins(tp=8, pp=1)
    )
    lay = p.best.layout
    assert lay.dims.world_size < topo.num_accelerators and lay.padded_slots == 0
    full = [c for c in [p.best, *p.alternatives] if c.layout.dims.world_size > lay.dims.world_size]
    for c in full:
        assert c.step_time.total_s > p.best.step_time.total_s * (1 - THROUGHPUT_TIE)
    assert p.best.reason.startswith(f"uses {lay.dims.world_size} of 8184 accelerators")


def test_dp_degrees_take_one_world_per_per_rank_share() -> None:
    from raytrain_dt.topology.degree_grid import dp_degrees

    dps = dp_degrees(1024, 8184, LayoutPins())
    shares = [-(-1024 // d) for d in dps]
    assert len(set(shares)) == len(shares) and len(dps) < 2 * 32 + 2  # O(sqrt(G))
    assert all(-(-1024 // (d - 1)) > s for d, s in zip(dps, shares, strict=True) if d > 1)
    assert {1, 2, 3, 512, 1024} <= set(dps) and max(dps) == 1024
    assert dp_degrees(16, 3, LayoutPins()) == [1, 2, 3]
    assert set(dp_degrees(16, 12, LayoutPins(dp_shard=2))) == {2, 4, 6, 8, 12}


def test_uses_every_accelerator_when_it_can() -> None:
    assert _plan("llama-7b", 2, gb=64).best.layout.dims.world_size == 16


def test_pins_are_honoured() -> None:
    pins = LayoutPins(tp=2, pp=2, zero_stage=1, micro_batch=2, activation_checkpointing=True)
    lay = _plan("llama-7b", 1, gb=64, pins=pins).best.layout
    assert (lay.dims.tp, lay.dims.pp, lay.zero_stage, lay.micro_batch) == (2, 2, 1, 2)
    assert lay.activation_checkpointing and lay.grad_accum == 16 and lay.dims.dp == 2


def test_grad_sync_is_deferred_where_the_unsharded_gradients_fit() -> None:
    """engine.grad_sync=auto: ZeRO-3 with accumulation reduces once per step when the full
    gradients fit beside everything else (7B over 32 GPUs), and every micro-step when they do
    not (13B on 8 GPUs would need 52 GB of fp32 gradients on top of its shards)."""
    roomy = _plan("llama-7b", 4, gb=512).best.layout
    assert roomy.zero_stage == 3 and roomy.grad_accum > 1 and roomy.defer_grad_sync
    tight = _plan("llama-13b", 1, pins=LayoutPins(pp=1)).best.layout
    assert tight.zero_stage == 3 and tight.grad_accum > 1 and not tight.defer_grad_sync
    # Each choice is priced: the deferred layout holds more gradient memory and moves less.
    every = _plan("llama-7b", 4, gb=512, pins=LayoutPins(grad_sync="every")).best
    assert not every.layout.defer_grad_sync
    deferred = _plan("llama-7b", 4, gb=512).best
    assert deferred.memory.grads > every.memory.grads
    assert deferred.step_time.total_s < every.step_time.total_s


def test_grad_sync_final_keeps_to_layouts_that_can_defer() -> None:
    # 13B on one node cannot defer at ZeRO-3; pinned to final, the planner finds a layout that
    # syncs once per step (ZeRO-1 over fewer DP ranks, with pipeline stages).
    lay = _plan("llama-13b", 1, pins=LayoutPins(grad_sync="final")).best.layout
    assert lay.grad_sync_deferred
    # DeepSpeed ZeRO-2/3 reduce every micro-step, so only ZeRO-0/1 layouts remain.
    ds = _plan("llama-1b", 1, pins=LayoutPins(grad_sync="final"), engine="deepspeed").best
    assert ds.layout.zero_stage <= 1


def test_pins_from_config() -> None:
    cfg = TrainConfig()
    cfg.parallel.tp, cfg.engine.zero_stage, cfg.trainer.micro_batch = 2, 3, 4
    cfg.trainer.activation_checkpointing = True
    pins = LayoutPins.from_config(cfg)
    assert (pins.tp, pins.pp, pins.zero_stage, pins.micro_batch) == (2, None, 3, 4)
    assert pins.activation_checkpointing is True
    assert pins.offload_optimizer is None  # False leaves the choice to the planner
    # Sequence parallel is pinned both ways: a layout claims it only where the engine applies it.
    assert pins.sequence_parallel is False


@pytest.mark.parametrize(
    ("pins", "message"),
    [
        (
            LayoutPins(tp=3),
            r"^parallel\.tp: 3 does not divide cluster accelerators per node \(8\)$",
        ),
        (
            LayoutPins(pp=33),
            r"^parallel\.pp: 33 x parallel\.virtual_stages 1 = 33 stages exceed model\.n_layers \(32\)",
        ),
        (
            LayoutPins(pp_layers=(8, 8, 8)),
            r"^parallel\.pp_layers: \[8, 8, 8\] sums to 24, not model\.n_layers=32$",
        ),
        (
            LayoutPins(pp=2, pp_layers=(8, 8, 16)),
            r"^parallel\.pp_layers: 3 stages, but parallel\.pp=2 x parallel\.virtual_stages=1 = 2$",
        ),
        (LayoutPins(tp=8, pp=4), r"^parallel\.pp: tp\(8\) x pp\(4\) = 32 exceeds"),
        (LayoutPins(zero_stage=0, dp_shard=8), r"^engine\.zero_stage: 0 \(plain DP\)"),
        (LayoutPins(zero_stage=5), r"^engine\.zero_stage"),
        (LayoutPins(micro_batch=3), r"^trainer\.micro_batch: 3 does not divide"),
        (LayoutPins(tp=0), r"^parallel\.tp: must be a positive int"),
        (LayoutPins(virtual_stages=2), r"^parallel\.virtual_stages"),
    ],
)
def test_invalid_pins_name_the_key(pins, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _plan("llama-7b", 1, gb=64, pins=pins)


def test_tp_must_divide_kv_heads() -> None:
    topo = Topology(1, 8)
    with pytest.raises(ConfigError, match=r"model\.n_kv_heads \(2\)"):
        plan(PRESETS["tiny"], topo, global_batch=8, seq_len=64, pins=LayoutPins(tp=4))


def test_nothing_fits_is_one_line_with_the_memory_needed() -> None:
    with pytest.raises(PlanningError) as err:
        _plan("llama-405b", 1, gb=64)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("nothing fits")
    # Offload is the last resort, so the leanest layout tried is an offloaded one.
    assert "GB per accelerator" in msg and "+offload" in msg


def test_deterministic() -> None:
    a = _plan("llama-70b", 8, gb=1024).to_json()
    b = _plan("llama-70b", 8, gb=1024).to_json()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_to_json_shape() -> None:
    record = _plan("llama-7b", 1).to_json()
    assert set(record["layout"]) >= {
        "pp",
        "dp",
        "tp",
        "dp_replicate",
        "dp_shard",
        "zero_stage",
        "micro_batch",
        "grad_accum",
        "activation_checkpointing",
    }
    assert set(record["memory_gb_per_rank"]) >= {
        "params",
        "grads",
        "optimizer",
        "activations",
        "total",
    }
    states = record["model_state_gb_per_rank"]
    # FSDP2 with accumulation: zero1 holds full gradients, zero2 its all-gathered parameters,
    # zero3 only the root (embedding, head) and two blocks in bf16 plus one block's fp32 grads.
    assert record["layout"]["grad_accum"] > 1
    assert states["ddp"] > states["zero1"] > states["zero2"] > states["zero3"]
    unsharded = (2 * 32000 * 4096 + 4096 + 2 * 202_383_360) * 2 + 202_383_360 * 4
    assert states["zero3"] == pytest.approx((6_738_415_616 * 16 / 8 + unsharded) / 1e9, rel=1e-3)
    assert record["step_time_s"] > 0 and record["reason"]
    assert record["alternatives"] and "alternatives" not in record["alternatives"][0]


def test_planning_405b_on_8192_gpus_is_fast() -> None:
    start = time.perf_counter()
    p = _plan("llama-405b", 1024, gb=2048)
    assert time.perf_counter() - start < 5.0  # loose; bench/bench_planner.py measures it
    assert p.best.layout.global_batch == 2048


# --- cost model orderings ------------------------------------------------------------------
def test_all_reduce_moves_what_reduce_scatter_plus_all_gather_move() -> None:
    args = (1e9, 8, 450e9, 5e-6)
    assert all_reduce_s(*args) == pytest.approx(reduce_scatter_s(*args) + all_gather_s(*args))
    assert all_reduce_s(1e9, 1, 450e9, 5e-6) == 0.0


def _time(zero: int, *, ac: bool = False, pp: int = 1, ga: int = 8):
    dp = 8 // pp
    dims = ParallelDims(
        8, pp=pp, dp_replicate=dp if zero == 0 else 1, dp_shard=1 if zero == 0 else dp
    )
    layout = Layout(dims, zero, 1, ga, activation_checkpointing=ac)
    return estimate_step_time(PRESETS["llama-7b"], layout, Topology(1, 8), seq_len=4096)


def test_more_dp_volume_is_slower_even_when_hidden() -> None:
    times = [_time(z).total_s for z in (0, 1, 2, 3)]
    assert times == sorted(times) and times[3] > times[2]


def test_checkpointing_adds_a_forward_and_pipelines_pay_a_bubble() -> None:
    assert _time(0, ac=True).compute_s == pytest.approx(_time(0).compute_s * 4 / 3)
    t = _time(0, pp=4, ga=16)
    assert t.bubble_s == pytest.approx((t.compute_s + t.tp_comm_s) * 3 / 16)
    assert t.pp_comm_s > 0 and t.total_s == pytest.approx(
        t.compute_s + t.dp_comm_s + t.tp_comm_s + t.pp_comm_s + t.bubble_s + t.offload_s
    )


# --- CLI -----------------------------------------------------------------------------------
def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


def test_cli_json(capsys) -> None:
    rc = _cli(
        [
            "--model",
            "llama-70b",
            "--nodes",
            "8",
            "--gpus-per-node",
            "8",
            "--gpu-mem-gb",
            "80",
            "--json",
        ]
    )
    assert rc == 0
    record = json.loads(capsys.readouterr().out)
    for key in (
        "layout",
        "memory_gb_per_rank",
        "model_state_gb_per_rank",
        "step_time_s",
        "reason",
        "alternatives",
    ):
        assert key in record
    assert record["layout"]["global_batch"] == 1024  # ~4M tokens at seq 4096


def test_cli_params_and_gpus_and_table(capsys) -> None:
    assert _cli(["--params", "7.5e9", "--gpus", "64", "--global-batch", "512"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank (GB)" in out and "step time (s)" in out and "alternatives" in out


def test_cli_errors_return_2_with_one_line(capsys) -> None:
    assert _cli(["--model", "llama-405b", "--nodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing fits" in err
    assert _cli(["--model", "llama-7b", "--nodes", "1", "--tp", "3"]) == 2
    assert "parallel.tp" in capsys.readouterr().err
    assert _cli(["--model", "llama-7b", "--params", "7e9", "--nodes", "1"]) == 2


# --- engine refusals ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tp", "pp", "zero", "key"),
    [
        (2, 1, 1, "parallel.tp"),
        (1, 2, 0, "engine.zero_stage"),
        (1, 2, 2, "engine.zero_stage"),
        (1, 4, 3, "engine.zero_stage"),
    ],
)
def test_deepspeed_refusals_are_one_line_naming_the_key(tp, pp, zero, key) -> None:
    message = engine_refusal("deepspeed", tp, pp, zero)
    assert message is not None and message.startswith(f"{key}: ") and "\n" not in message
    assert "engine.name=deepspeed" in message


def test_deepspeed_runs_pipelines_with_zero1() -> None:
    # ZeRO-1 with any pipeline degree, and an unpinned stage (the planner picks ZeRO-1 then).
    assert engine_refusal("deepspeed", 1, 2, 1) is None
    assert engine_refusal("deepspeed", None, 4, None) is None
    assert engine_refusal("fsdp2", 2, 2, 3) is None
    best = _plan("llama-7b", 1, gb=64, pins=LayoutPins(pp=2), engine="deepspeed").best
    assert (best.layout.dims.pp, best.layout.dims.tp, best.layout.zero_stage) == (2, 1, 1)


# --- batch tolerance ---------------------------------------------------------------------------
def _llama70b_on(nodes: int, global_batch: int, tolerance: float) -> Plan:
    topo = Topology(num_nodes=nodes, accelerators_per_node=8, memory_per_accelerator=80e9)
    return plan(
        PRESETS["llama-70b"],
        topo,
        global_batch=global_batch,
        seq_len=4096,
        batch_tolerance=tolerance,
    )


def test_batch_tolerance_keeps_1023_nodes_training_instead_of_512() -> None:
    """One node short of 1,024 x 8: the exact batch 1,024 halves the cluster (512 nodes); a 1%
    tolerance trains a batch within 1% of it on (nearly) every node, each sample faster. The
    full cluster keeps the exact batch."""
    exact = _llama70b_on(1023, 1024, 0.0).best
    lay = exact.layout
    assert (lay.global_batch, lay.dims.world_size, lay.padded_slots) == (1024, 4096, 0)
    tolerant = _llama70b_on(1023, 1024, 0.01).best
    lay = tolerant.layout
    assert 1014 <= lay.global_batch < 1024 and lay.padded_slots == 0
    assert lay.dims.world_size >= 1000 * 8  # not 512 nodes: all but a few of the 1,023
    per_sample = tolerant.step_time.total_s / lay.global_batch
    assert per_sample < exact.step_time.total_s / 1024
    assert f"trains global batch {lay.global_batch} of 1024" in tolerant.reason
    full = _llama70b_on(1024, 1024, 0.01).best.layout
    assert full == _llama70b_on(1024, 1024, 0.0).best.layout and full.global_batch == 1024


@pytest.mark.parametrize("nodes", [1000, 960, 900, 700])
def test_batch_tolerance_stays_within_its_bound_and_beats_the_exact_batch(nodes: int) -> None:
    """Whatever the node count, the real batch is within (1 - t) x G..G, and its time per G
    samples is never worse than the exact batch's best."""
    for batch in (1024, 1920):
        exact = _llama70b_on(nodes, batch, 0.0).best
        best = _llama70b_on(nodes, batch, 0.01).best
        assert 0.99 * batch <= best.layout.global_batch <= batch
        per_batch = best.step_time.total_s * batch / best.layout.global_batch
        assert per_batch <= exact.step_time.total_s * (1 + 1e-12)


def test_batch_tolerance_cli_names_the_real_batch_and_refuses_out_of_range(capsys) -> None:
    argv = ["--model", "llama-70b", "--nodes", "1023", "--global-batch", "1024"]
    assert _cli([*argv, "--batch-tolerance", "0.01"]) == 0
    real = _llama70b_on(1023, 1024, 0.01).best.layout.global_batch
    assert real < 1024 and f"global batch {real} of 1024 x 4096 tokens" in capsys.readouterr().out
    assert _cli(argv) == 0
    assert "global batch 1024 x 4096 tokens" in capsys.readouterr().out
    assert _cli([*argv, "--batch-tolerance", "1.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer.batch_tolerance: must be in [0, 1)" in err
