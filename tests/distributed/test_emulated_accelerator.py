"""The GPU path on the emulated accelerator: host memory behind a device type of its own, and
a collective backend that refuses host tensors as NCCL does (`raytrain_dt.accel.emulated`).

Each layout trains 5 steps on the emulated device, and its losses and final parameters must
equal the single-process reference within 1e-5, as the same layouts on the CPU do
(`test_engine_matrix.py`; DeepSpeed's ZeRO stages in `tests/ray/test_deepspeed_training.py`).
The harness must bite: an engine that sums its loss in a host tensor, as the engines once did,
trains on the CPU but fails on the emulated device exactly where it would fail on NCCL.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from matrix import STEPS, cfg, pool, reference
from test_engine_matrix import DEEPSPEED_PIPELINE_LAYOUTS, LAYOUTS, _layout

# (engine, layout). DeepSpeed runs through its accelerator abstraction
# (`accel/emulated/deepspeed_accelerator.py`): ZeRO's flat buffers and partitions on the
# emulated device, its collectives through emuccl.
EMULATED = {
    "ddp": ("fsdp2", LAYOUTS["ddp"]),
    "fsdp2-full": ("fsdp2", LAYOUTS["fsdp2-full"]),
    "hsdp-2x2": ("fsdp2", LAYOUTS["hsdp-2x2"]),
    "dp2xtp2+sp": ("fsdp2", LAYOUTS["dp2xtp2+sp"]),
    "pp2-1f1b": ("fsdp2", LAYOUTS["pp2-1f1b"]),
    "ds-zero1": ("deepspeed", _layout(zero=1, dp_shard=2)),
    "ds-zero2": ("deepspeed", _layout(zero=2, dp_shard=2)),
    "ds-zero3": ("deepspeed", _layout(zero=3, dp_shard=2)),
    "ds-zero1-pp2-1f1b": ("deepspeed", DEEPSPEED_PIPELINE_LAYOUTS["ds-zero1-pp2-1f1b"]),
}


@pytest.mark.parametrize("name", list(EMULATED))
def test_emulated_run_equals_single_process(pool, cfg, reference, name):
    engine, layout = EMULATED[name]
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, name=engine))
    emulated = pool.run(cfg, layout, STEPS, device="emulated")
    assert emulated.param_device == "emu"
    assert emulated.losses == pytest.approx(reference[0], abs=1e-5)
    for key, value in reference[1].items():
        torch.testing.assert_close(emulated.params[key], value, atol=1e-5, rtol=0, msg=key)


def test_async_save_stages_through_pinned_memory_and_resumes(pool, cfg, reference, tmp_path):
    """An async save after step 3 (copied into pinned host buffers while steps 4-5 train), then
    a fresh layout that loads it and trains steps 4-5 again: the reference's losses."""
    first = pool.run(
        cfg,
        LAYOUTS["fsdp2-full"],
        STEPS,
        device="emulated",
        async_save_dir=str(tmp_path / "ckpt"),
        async_save_after=3,
    )
    assert first.staged_pinned is True
    second = pool.run(
        cfg,
        LAYOUTS["hsdp-2x2"],
        2,
        device="emulated",
        load_dir=str(tmp_path / "ckpt"),
        start_step=3,
    )
    assert first.losses == pytest.approx(reference[0], abs=1e-5)
    assert second.losses == pytest.approx(reference[0][3:], abs=1e-5)
    for key, value in reference[1].items():
        torch.testing.assert_close(second.params[key], value, atol=1e-5, rtol=0, msg=key)


def test_a_host_tensor_in_a_collective_fails_as_on_nccl(pool, cfg):
    """The engines' old bug (the loss summed in a host tensor, then all-reduced over the DP
    group) goes unnoticed on the CPU and fails on the emulated device, naming the backend."""
    cpu = pool.run(cfg, LAYOUTS["fsdp2-full"], 1, device="cpu", host_loss=True)
    assert len(cpu.losses) == 1
    with pytest.raises(RuntimeError, match=r"emuccl: allreduce got a tensor on cpu"):
        pool.run(cfg, LAYOUTS["fsdp2-full"], 1, device="emulated", host_loss=True)
