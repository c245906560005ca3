"""Context parallelism trains like the single-process reference.

Each layout splits every sequence across 2 cp ranks (load-balanced chunks, ring attention) and
composes cp with FSDP's data sharding, TP with sequence parallelism and pipeline stages; the 5
steps' losses and the final full parameters must equal `reference_run` within 1e-5 (fp32, CPU),
as in the engine matrix. cp ranks share their DP coordinate, so they read the same rows (the
harness cuts rows by `coords.dp`, as `worker/rank_actor.py` does). A checkpoint saved under cp=2
resumes under cp=1 (dp_shard=2), and cp=2 runs on the emulated accelerator, whose collectives
refuse host tensors as NCCL does, so every tensor entering the ring is on the device.
"""

from __future__ import annotations

import pytest
import torch
from matrix import GLOBAL_BATCH, STEPS, cfg, pool, reference
from test_engine_matrix import GRAD_ACCUM, LAYOUTS, _assert_equals_reference, _layout

from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.parallel_dims import ParallelDims

CP_LAYOUTS = {
    "cp2": _layout(cp=2),
    "cp2xdp2": _layout(dp_shard=2, cp=2),
    "cp2xtp2+sp": _layout(cp=2, tp=2, sequence_parallel=True),
    "cp2xpp2": _layout(pp=2, cp=2, pp_schedule="1f1b"),
    # Activation checkpointing recomputes each block's forward, ring included, in backward.
    "cp2+ac": _layout(cp=2, activation_checkpointing=True),
    # 10 slots for 8 samples (as the matrix's tp2+sp-padded): per-row losses over cp shards.
    "cp2-padded": Layout(
        ParallelDims(world_size=2, cp=2), 3, 5, GRAD_ACCUM, real_global_batch=GLOBAL_BATCH
    ),
}


def test_cp_on_the_emulated_accelerator_equals_reference(pool, cfg, reference):
    # First in the module: a worker's autograd engine sizes its device queues at its first
    # backward, so the emulated device must exist before any CPU layout trains in that pool.
    result = pool.run(cfg, CP_LAYOUTS["cp2"], STEPS, device="emulated")
    assert result.param_device == "emu"
    _assert_equals_reference(result, reference)


@pytest.mark.parametrize("name", list(CP_LAYOUTS))
def test_cp_layout_equals_single_process(pool, cfg, reference, name):
    _assert_equals_reference(pool.run(cfg, CP_LAYOUTS[name], STEPS), reference)


def test_cp_checkpoint_resumes_without_cp(pool, cfg, reference, tmp_path):
    """3 steps at cp=2, saved; steps 4-5 at dp_shard=2 from that checkpoint: the reference."""
    first = pool.run(cfg, CP_LAYOUTS["cp2"], 3, checkpoint_dir=str(tmp_path / "ckpt"))
    second = pool.run(cfg, LAYOUTS["fsdp2-full"], 2, load_dir=str(tmp_path / "ckpt"), start_step=3)
    assert first.losses == pytest.approx(reference[0][:3], abs=1e-5)
    assert second.losses == pytest.approx(reference[0][3:], abs=1e-5)
    for key, value in reference[1].items():
        torch.testing.assert_close(second.params[key], value, atol=1e-5, rtol=0, msg=key)
