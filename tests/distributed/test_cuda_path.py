"""The CUDA path on a real GPU machine (`make gpu-check`; deselected elsewhere by the `gpu`
marker): the layouts the emulated accelerator checks in CI, on NCCL, against the
single-process reference.

fp32 on a GPU reduces in another order than on the CPU (and cuBLAS may pick other kernels), so
the bound is 1e-4 rather than the CPU's 1e-5; bf16 is held to its unit roundoff as on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from harness import WorkerPool
from matrix import STEPS, cfg, reference
from test_engine_matrix import LAYOUTS, _layout

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs(gpus: int):
    return pytest.mark.skipif(gpus > GPUS, reason=f"needs {gpus} GPUs, this machine has {GPUS}")


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(max(1, min(4, GPUS)))
    yield workers
    workers.close()


@_needs(2)
@pytest.mark.parametrize("name", ["ddp", "fsdp2-full", "dp2xtp2+sp", "pp2-1f1b"])
def test_cuda_fp32_run_equals_the_reference(pool, cfg, reference, name):
    result = pool.run(cfg, LAYOUTS[name], STEPS, device="cuda")
    assert result.param_device == "cuda"
    assert result.losses == pytest.approx(reference[0], abs=1e-4)
    for key, value in reference[1].items():
        torch.testing.assert_close(result.params[key], value, atol=1e-4, rtol=0, msg=key)


@_needs(2)
def test_cuda_bf16_tracks_the_fp32_reference(pool, cfg, reference):
    result = pool.run(cfg, LAYOUTS["fsdp2-full"], STEPS, device="cuda", precision="bf16")
    assert result.losses == pytest.approx(reference[0], rel=2**-9)


@_needs(2)
def test_cuda_async_save_stages_through_pinned_memory(pool, cfg, reference, tmp_path):
    result = pool.run(
        cfg,
        LAYOUTS["fsdp2-full"],
        STEPS,
        device="cuda",
        async_save_dir=str(tmp_path / "ckpt"),
        async_save_after=3,
    )
    assert result.staged_pinned is True


@_needs(1)
def test_one_gpu_step_runs_on_the_device(pool, cfg, reference):
    result = pool.run(cfg, _layout(zero=3, dp_shard=1), STEPS, device="cuda")
    assert result.param_device == "cuda"
    assert result.losses == pytest.approx(reference[0], abs=1e-4)


@_needs(1)
def test_a_staged_copy_reads_the_values_of_its_call_and_overlaps_later_compute():
    """`ReusableStager` on CUDA: the copy waits for the work queued before `stage` (it copies
    the values as of the call), and not for work queued after it: the next step's kernels on
    the compute stream run while it copies. Queued on the compute stream, or waiting for the
    whole device, the copy would resolve only after the later kernel."""
    from raytrain_dt.checkpoint.staging import ReusableStager

    cycles_per_ms = 1_500_000  # an H100/H200's clock is 1.5-2 GHz
    source = torch.zeros(64 << 20, device="cuda")  # 256 MB
    stager = ReusableStager(background=True)
    stager.stage({"x": source}).result()  # allocates the pinned buffer
    torch.cuda.synchronize()
    torch.cuda._sleep(200 * cycles_per_ms)  # work queued before the call ...
    source.add_(1.0)  # ... whose result the copy must hold
    staged = stager.stage({"x": source})
    torch.cuda._sleep(3000 * cycles_per_ms)  # the next step's work, queued after the call
    later_done = torch.cuda.Event()
    later_done.record()
    copied = staged.result(timeout=60)
    assert not later_done.query(), "the copy waited for compute queued after stage()"
    assert copied["x"].is_pinned()
    assert torch.equal(copied["x"], torch.ones(64 << 20)), "the copy read stale values"
    torch.cuda.synchronize()
    stager.close()
