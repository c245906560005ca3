"""The DeepSpeed config generated from ours: batch arithmetic, explicit clipping, ZeRO, dtypes."""

from __future__ import annotations

import pytest
import torch

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.engines.deepspeed_engine import deepspeed_config
from raytrain_dt.errors import ConfigError
from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.parallel_dims import ParallelDims
from raytrain_dt.topology.pins import LayoutPins
from raytrain_dt.topology.planner import plan

CPU = DeviceSpec("cpu", "gloo", torch.float32, torch.float32)
GPU_BF16 = DeviceSpec("cuda", "nccl", torch.bfloat16, torch.float32)


def layout(world=2, zero=1, micro_batch=2, grad_accum=2, replicate=1, **kw) -> Layout:
    dims = ParallelDims(world_size=world, dp_replicate=replicate, dp_shard=world // replicate)
    return Layout(dims, zero, micro_batch, grad_accum, **kw)


@pytest.mark.parametrize(
    ("world", "micro_batch", "grad_accum", "replicate"),
    [(1, 8, 1, 1), (2, 2, 2, 1), (4, 1, 2, 2), (8, 4, 3, 1)],
)
def test_batch_arithmetic(world, micro_batch, grad_accum, replicate):
    lay = layout(world, 1, micro_batch, grad_accum, replicate)
    ds = deepspeed_config(TrainConfig(), lay, CPU)
    assert ds["train_batch_size"] == lay.global_batch == micro_batch * grad_accum * world
    assert ds["train_micro_batch_size_per_gpu"] == micro_batch
    assert ds["gradient_accumulation_steps"] == grad_accum
    # DeepSpeed checks exactly this identity against the DP world size.
    assert ds["train_batch_size"] == (
        ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    )


@pytest.mark.parametrize("clip", [0.0, 0.5, 1.0])
def test_clipping_is_always_explicit(clip):
    cfg = TrainConfig()
    cfg.trainer.grad_clip = clip
    ds = deepspeed_config(cfg, layout(), CPU)
    assert "gradient_clipping" in ds and ds["gradient_clipping"] == clip


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stage_and_no_scheduler_or_optimizer_section(zero):
    ds = deepspeed_config(TrainConfig(), layout(zero=zero), CPU)
    assert ds["zero_optimization"]["stage"] == zero
    assert "offload_optimizer" not in ds["zero_optimization"]
    # We pass our own AdamW and set the lr every step: DeepSpeed must not build either.
    assert "scheduler" not in ds and "optimizer" not in ds
    assert ds["steps_per_print"] >= 2**31 - 1 and ds["wall_clock_breakdown"] is False
    # ZeRO-3 shards every parameter, as the planner's memory model assumes.
    assert ("stage3_param_persistence_threshold" in ds["zero_optimization"]) == (zero == 3)


def test_offload_optimizer():
    ds = deepspeed_config(TrainConfig(), layout(zero=2, offload_optimizer=True), CPU)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # Torch AdamW runs on the offloaded partitions; no JIT-built DeepSpeedCPUAdam.
    assert ds["zero_force_ds_cpu_optimizer"] is False


def test_bf16_only_with_mixed_precision():
    fp32 = deepspeed_config(TrainConfig(), layout(), CPU)
    assert fp32["bf16"]["enabled"] is False and fp32["fp16"]["enabled"] is False
    assert "communication_data_type" not in fp32
    bf16 = deepspeed_config(TrainConfig(), layout(), GPU_BF16)
    assert bf16["bf16"]["enabled"] is True
    # Gradients are reduced and accumulated in fp32 (DeviceSpec.reduce_dtype), as in FSDP2.
    assert bf16["communication_data_type"] == "fp32"
    assert bf16["data_types"]["grad_accum_dtype"] == "fp32"


@pytest.mark.parametrize(
    ("dims", "zero", "key"),
    [
        (ParallelDims(world_size=4, dp_shard=2, tp=2), 1, "parallel.tp"),
        (ParallelDims(world_size=4, dp_shard=2, pp=2), 0, "engine.zero_stage"),
        (ParallelDims(world_size=4, dp_shard=2, pp=2), 2, "engine.zero_stage"),
        (ParallelDims(world_size=4, dp_shard=2, pp=2), 3, "engine.zero_stage"),
        (ParallelDims(world_size=4, dp_shard=2, cp=2), 1, "parallel.cp"),
    ],
)
def test_unsupported_layouts_name_the_key(dims, zero, key):
    with pytest.raises(ConfigError, match=f"^{key}: ") as err:
        deepspeed_config(TrainConfig(), Layout(dims, zero, 1, 1), CPU)
    assert "\n" not in str(err.value)


def test_zero1_pipeline_is_one_deepspeed_micro_batch_per_step():
    """Under a pipeline the schedule runs the micro-batches; DeepSpeed sees one per step."""
    from raytrain_dt.engines.deepspeed_pipeline import pipeline_deepspeed_config

    dims = ParallelDims(world_size=4, dp_shard=2, pp=2)
    lay = Layout(dims, 1, micro_batch=2, grad_accum=3, pp_schedule="gpipe")
    ds = pipeline_deepspeed_config(TrainConfig(), lay, CPU)
    assert ds["zero_optimization"]["stage"] == 1
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (6, 1)
    # DeepSpeed's identity, against the DP size of a stage (not the world size).
    assert ds["train_batch_size"] == lay.global_batch == 6 * dims.dp


@pytest.mark.parametrize(
    ("pins", "key"),
    [
        (LayoutPins(tp=2), "parallel.tp"),
        (LayoutPins(pp=2, zero_stage=0), "engine.zero_stage"),
        (LayoutPins(pp=2, zero_stage=2), "engine.zero_stage"),
        (LayoutPins(pp=2, zero_stage=3), "engine.zero_stage"),
    ],
)
def test_invalid_deepspeed_pins_are_refused_at_plan_time(pins, key):
    """The planner refuses what the engine would, before any worker starts."""
    topology = Topology(1, 4, memory_per_accelerator=80e9)
    with pytest.raises(ConfigError, match=f"^{key}: .*engine.name=deepspeed"):
        plan(PRESETS["tiny"], topology, global_batch=8, seq_len=64, pins=pins, engine="deepspeed")


def test_deepspeed_plans_no_tp_and_pipelines_only_with_zero1():
    # 70B on 8 x 8: FSDP2 would use TP or PP; DeepSpeed gets no TP, and PP only with ZeRO-1.
    topology = Topology(8, 8, memory_per_accelerator=80e9)
    result = plan(
        PRESETS["llama-70b"], topology, global_batch=512, seq_len=4096, engine="deepspeed"
    )
    for candidate in (result.best, *result.alternatives):
        lay = candidate.layout
        assert lay.dims.tp == 1
        assert lay.dims.pp == 1 or lay.zero_stage == 1, lay.describe()


def test_deepspeed_zero1_pipeline_is_planned_when_pinned():
    topology = Topology(1, 4, memory_per_accelerator=80e9)
    pins = LayoutPins(pp=2, pp_schedule="interleaved", virtual_stages=2)
    best = plan(
        PRESETS["tiny"], topology, global_batch=8, seq_len=64, pins=pins, engine="deepspeed"
    ).best
    assert (best.layout.dims.pp, best.layout.dims.dp, best.layout.zero_stage) == (2, 2, 1)
    assert best.layout.pp_schedule == "interleaved"
