"""The device layer (`raytrain_dt.accel.device`) and the emulated accelerator under it: kinds,
the accelerator index Ray assigns, loss and norm arithmetic on the device, memory statistics
and their reset between layouts, pinned staging memory and the device's RNG state."""

from __future__ import annotations

import pytest
import torch

from raytrain_dt.accel.device import (
    DeviceUnavailable,
    accelerator_name,
    local_accelerator_index,
    memory_usage,
    ray_device_kind,
    release_accelerator_memory,
    resolve_device_kind,
    select_device,
)
from raytrain_dt.models.llama import next_token_loss
from raytrain_dt.observe.mfu import CPU_PEAK_FLOPS, peak_flops_per_accelerator


@pytest.fixture(scope="module")
def emu():
    return select_device("fp32", "emulated")


@pytest.mark.parametrize(
    ("assigned", "visible", "index"),
    [
        (["3"], "3", 0),  # Ray set CUDA_VISIBLE_DEVICES to the one assigned GPU
        (["5", "6"], "5,6", 0),  # two GPUs per actor: the first is the rank's
        (["6"], "4,5,6,7", 2),  # the assigned id among a wider visible list
        (["2"], None, 2),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the id is the index
        ([], "0", 0),  # no GPU assigned (CPU ranks)
    ],
)
def test_local_index_comes_from_the_ids_ray_assigned(assigned, visible, index):
    assert local_accelerator_index(assigned, visible) == index


def test_auto_is_the_cpu_on_a_rank_ray_gave_no_gpu(monkeypatch):
    """Simulated accelerators on a GPU machine: every rank sees the machine's GPU, and all of
    them taking it fails in NCCL ("Duplicate GPU detected", seen on a one-GPU H200): `auto`
    is CUDA only for a rank Ray assigned a GPU. Named kinds are kept."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    assert ray_device_kind("auto", assigned_gpus=[]) == "cpu"
    assert ray_device_kind("auto", assigned_gpus=["0"]) == "cuda"
    assert ray_device_kind("cuda", assigned_gpus=[]) == "cuda"
    assert ray_device_kind("emulated", assigned_gpus=[]) == "emulated"
    assert ray_device_kind("auto") == "cpu"  # outside Ray: no GPU assigned


def test_kinds_and_their_backends(emu):
    assert resolve_device_kind("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = select_device("auto", "cpu")
    assert (cpu.device_type, cpu.backend, cpu.param_dtype) == ("cpu", "gloo", torch.float32)
    assert (emu.device_type, emu.backend, emu.param_dtype) == ("emu", "emuccl", torch.float32)
    assert emu.is_accelerator and emu.pin_memory and not cpu.pin_memory
    # bf16 is honoured when pinned, as on a GPU; fp32 stays the emulated default.
    assert select_device("bf16", "emulated").param_dtype == torch.bfloat16
    with pytest.raises(DeviceUnavailable, match="cluster.device: 'tpu' is not one of"):
        resolve_device_kind("tpu")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_cuda_without_a_gpu_is_refused_naming_the_key():
    with pytest.raises(DeviceUnavailable, match=r"^cluster.device=cuda: torch sees no CUDA device"):
        select_device("auto", "cuda")


def test_scalars_live_on_the_compute_device_in_fp32(emu):
    total = emu.scalar()
    assert total.device.type == "emu" and total.dtype == torch.float32
    assert emu.to_device(torch.ones(2)).device.type == "emu"


def test_bf16_logits_give_an_fp32_loss(emu):
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16, device=emu.torch_device)
    tokens = torch.randint(0, 11, (2, 5), device=emu.torch_device)
    loss = next_token_loss(logits, tokens)
    assert loss.dtype == torch.float32 and loss.device.type == "emu"
    expected = next_token_loss(logits.float().cpu(), tokens.cpu())
    torch.testing.assert_close(loss.cpu(), expected)


def test_memory_statistics_follow_the_allocator_and_reset_between_layouts(emu):
    before = memory_usage(emu)["mem_allocated_bytes"]
    block = torch.empty(1 << 20, dtype=torch.uint8, device=emu.torch_device)
    during = memory_usage(emu)
    assert during["mem_allocated_bytes"] - before == 1 << 20
    assert during["mem_peak_bytes"] >= during["mem_allocated_bytes"]
    del block
    assert memory_usage(emu)["mem_allocated_bytes"] == before
    release_accelerator_memory(emu)  # what a reused actor does between layouts
    assert memory_usage(emu)["mem_peak_bytes"] == before


def test_pinned_host_memory_is_told_apart(emu):
    pinned = torch.empty(64, pin_memory=True)
    assert pinned.is_pinned() and pinned[8:].is_pinned()
    assert not torch.empty(64).is_pinned()
    assert pinned.device.type == "cpu"


def test_device_rng_state_round_trips(emu):
    state = emu.module.get_rng_state(emu.index)
    first = torch.randn(4, device=emu.torch_device).cpu()
    emu.module.set_rng_state(state, emu.index)
    torch.testing.assert_close(torch.randn(4, device=emu.torch_device).cpu(), first)


def test_mfu_peak_is_looked_up_by_the_device_name(emu):
    assert accelerator_name(emu).startswith("Emulated accelerator")
    # The emulated device computes with the host's kernels: the CPU's peak, not an H100's.
    assert peak_flops_per_accelerator(accelerator_name(emu), None) == CPU_PEAK_FLOPS
    assert peak_flops_per_accelerator("NVIDIA H100 80GB HBM3", None) == 989e12
    assert peak_flops_per_accelerator("NVIDIA A100-SXM4-40GB", None) == 312e12


def test_host_memory_peak_follows_the_rss_and_restarts_per_layout(emu):
    """The host's high-water mark, on the CPU and on an accelerator alike; `reset_host_peak`
    (each layout's build) restarts it at the current RSS."""
    from raytrain_dt.accel.device import host_memory, reset_host_peak

    assert reset_host_peak()
    before = host_memory()["host_rss_bytes"]
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert host_memory()["host_rss_bytes"] - before >= 60 << 20
    del block  # a large block goes back to the OS at once
    assert host_memory()["host_rss_bytes"] - before < 30 << 20
    # The kernel's counters lag by a few pages: 60 of the 64 MiB is the bar.
    assert host_memory()["host_rss_peak_bytes"] - before >= 60 << 20
    assert memory_usage(emu)["host_rss_peak_bytes"] - before >= 60 << 20
    assert reset_host_peak()
    assert host_memory()["host_rss_peak_bytes"] - before < 30 << 20


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path):
    import os

    from raytrain_dt.accel.emulated.build import STALE_LOCK_S, clear_stale_lock

    assert clear_stale_lock(tmp_path) is False  # no lock: nothing to do
    lock = tmp_path / "lock"
    lock.touch()
    made = lock.stat().st_mtime
    assert clear_stale_lock(tmp_path, now=made + 15) is False  # a build running now
    assert lock.exists()
    os.utime(lock, (made - STALE_LOCK_S - 1, made - STALE_LOCK_S - 1))
    assert clear_stale_lock(tmp_path, now=made) is True
    assert not lock.exists()
