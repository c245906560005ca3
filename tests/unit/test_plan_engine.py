"""`raytrain-dt plan --engine`: the memory and step-time answers follow the engine, as a run's
own planning does (`run_plan.choose_layout`), and `--json` states what the figures assume."""

from __future__ import annotations

import argparse
import json

import pytest

from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.calibration import CALIBRATION
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.memory import GB, estimate_memory
from raytrain_dt.topology.parallel_dims import ParallelDims
from raytrain_dt.topology.plan_cli import add_plan_arguments, run_plan

SEVEN_B = ["--model", "llama-7b", "--nodes", "1", "--global-batch", "64", "--json"]


def _json(argv: list[str], capsys) -> dict:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    assert run_plan(parser.parse_args(argv)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_json_states_engine_precision_and_calibration(engine, capsys) -> None:
    record = _json([*SEVEN_B, "--engine", engine], capsys)
    assert record["assumes"] == {
        "engine": engine,
        "precision": "bf16",
        "gpu": "h100-sxm",
        "compute_efficiency": "calibrated",
        "calibration": CALIBRATION,
    }


def test_deepspeed_memory_is_deepspeeds_and_differs_from_fsdp2(capsys) -> None:
    pins = ["--tp", "1", "--pp", "1", "--zero-stage", "1", "--micro-batch", "1"]
    ds = _json([*SEVEN_B, *pins, "--engine", "deepspeed"], capsys)
    fsdp = _json([*SEVEN_B, *pins, "--engine", "fsdp2"], capsys)
    # DeepSpeed's replicated bf16 module and fp32 gradient partitions leave no room for the
    # activations FSDP2 keeps: the same pins plan with checkpointing there.
    assert (
        ds["layout"]["activation_checkpointing"] and not fsdp["layout"]["activation_checkpointing"]
    )
    dims = ParallelDims(world_size=8, pp=1, dp_replicate=1, dp_shard=8, tp=1)
    for record, engine in ((ds, "deepspeed"), (fsdp, "fsdp2")):
        ac = record["layout"]["activation_checkpointing"]
        layout = Layout(dims, 1, 1, 8, activation_checkpointing=ac)
        mem = estimate_memory(PRESETS["llama-7b"], layout, seq_len=4096, engine=engine)
        assert record["memory_gb_per_rank"]["total"] == pytest.approx(mem.total / GB, abs=1e-3)
    # ZeRO-1 under DeepSpeed keeps the bf16 module replicated: 2 bytes/param of params per
    # rank. FSDP2 holds a 4-byte fp32 shard over 8 ranks (0.5 byte/param) plus, at grad-op,
    # the all-gathered bf16 compute copy from forward to backward (2 bytes/param).
    params = PRESETS["llama-7b"].num_params
    assert ds["memory_gb_per_rank"]["params"] == pytest.approx(2 * params / GB, abs=1e-3)
    assert fsdp["memory_gb_per_rank"]["params"] == pytest.approx(
        (4 / 8 + 2) * params / GB, abs=1e-3
    )
    assert ds["model_state_gb_per_rank"] != fsdp["model_state_gb_per_rank"]


def test_deepspeed_plans_no_tensor_parallelism_and_no_unasked_pipeline(capsys) -> None:
    record = _json(
        ["--model", "llama-70b", "--nodes", "8", "--engine", "deepspeed", "--json"], capsys
    )
    layouts = [record["layout"]] + [a["layout"] for a in record["alternatives"]]
    assert all(lay["tp"] == 1 and lay["pp"] == 1 for lay in layouts)
    fsdp = _json(["--model", "llama-70b", "--nodes", "8", "--json"], capsys)
    assert (
        fsdp["layout"]["tp"] > 1
    )  # the same job under FSDP2 uses TP: the answer follows the engine


def test_pinned_plan_says_how_the_free_pick_differs(capsys) -> None:
    job = ["--model", "llama-405b", "--nodes", "1024", "--global-batch", "2048"]
    job += ["--seq-len", "8192", "--json"]
    pinned = _json([*job, "--tp", "8", "--pp", "14"], capsys)
    free = _json(job, capsys)
    assert "unpinned" not in free
    unpinned = pinned["unpinned"]
    assert unpinned["step_time_s"] == free["step_time_s"] < pinned["step_time_s"]
    why = unpinned["versus_pinned"]
    assert why.startswith(f"free pick {unpinned['layout']} at ")
    assert "faster than the pinned layout" in why and "vs 14 (v=1): bubble" in why


def test_deepspeed_in_bf16_never_plans_zero_0() -> None:
    """DeepSpeed accumulates bf16 gradients in fp32 only in its ZeRO optimizer (without ZeRO it
    raises `unsupported mix of model_dtype=torch.bfloat16 and grad_accum_dtype=torch.float32`,
    found on an H200): in bf16 the planner gives it ZeRO-1, on one rank too, and a pinned 0 is
    refused naming the key. fp32 (the CPU's) still plans and runs ZeRO-0."""
    from raytrain_dt.errors import ConfigError
    from raytrain_dt.topology.layout import Topology
    from raytrain_dt.topology.pins import LayoutPins
    from raytrain_dt.topology.planner import plan

    small = PRESETS["small"]
    for gpus in (1, 4):
        topo = Topology(num_nodes=1, accelerators_per_node=gpus)
        chosen = plan(small, topo, global_batch=8, seq_len=512, engine="deepspeed")
        layouts = [chosen.best.layout, *(c.layout for c in chosen.alternatives)]
        assert all(lay.zero_stage >= 1 for lay in layouts), [lay.describe() for lay in layouts]
        fp32 = plan(small, topo, global_batch=8, seq_len=512, engine="deepspeed", precision="fp32")
        assert fp32.best.layout.zero_stage == 0
    with pytest.raises(ConfigError, match=r"^engine.zero_stage: 0 is not supported"):
        plan(
            small,
            topo,
            global_batch=8,
            seq_len=512,
            engine="deepspeed",
            pins=LayoutPins(zero_stage=0),
        )
