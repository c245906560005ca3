"""The one place that decides device, collective backend and dtypes.

`cluster.device` picks the kind: `cuda` (nccl), `cpu` (gloo), `emulated` (the `emu` device and
its `emuccl` backend, `accel/emulated/`: host memory with NCCL's rules, for CPU CI) or `auto`
(cuda where torch sees one, else cpu). Accelerators compute in bf16 with fp32 master weights and
fp32 gradient reduction unless `engine.precision` pins fp32; the CPU computes in fp32 (bf16 if
pinned). Loss and gradient-norm arithmetic always run in fp32 on the compute device, because on
an accelerator every tensor that enters a collective must live there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raytrain_dt.errors import ConfigError
from raytrain_dt.topology.precision import resolve_precision

DEVICE_KINDS = ("auto", "cpu", "cuda", "emulated")
_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


class DeviceUnavailable(ConfigError):
    """`cluster.device` names a device this machine cannot provide (the message says why)."""


@dataclass(frozen=True)
class DeviceSpec:
    device_type: str  # "cuda", "emu" (emulated) or "cpu"
    backend: str  # "nccl", "emuccl" or "gloo"
    param_dtype: torch.dtype  # compute dtype of parameters in forward/backward
    reduce_dtype: torch.dtype  # dtype of gradient reductions
    index: int = 0  # this rank's accelerator among those visible to its process

    @property
    def is_accelerator(self) -> bool:
        return self.device_type != "cpu"

    @property
    def mixed_precision(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def pin_memory(self) -> bool:
        """Whether host copies of accelerator state are pinned (page-locked) for fast DMA; only
        an accelerator can pin, a CPU-only torch refuses to."""
        return self.is_accelerator

    @property
    def abort_releases_peers(self) -> bool:
        """Whether aborting this rank's communicators also releases peers blocked with it in a
        collective (NCCL's ncclCommAbort; the emulated backend's abort). Gloo's abort leaves a
        sub-group's connections open: a peer blocked on them returns only once this rank's
        process group objects are destroyed, when its old layout is collected."""
        return self.backend != "gloo"

    @property
    def premul_sum(self) -> bool:
        """Whether the backend reduces with a pre-multiplied sum (NCCL's PREMUL_SUM): FSDP uses
        it for a custom gradient divide factor; elsewhere it must sum, then divide."""
        return self.backend == "nccl"

    @property
    def torch_device(self) -> torch.device:
        return (
            torch.device(self.device_type, self.index)
            if self.is_accelerator
            else torch.device("cpu")
        )

    def device(self, local_index: int | None = None) -> torch.device:
        if not self.is_accelerator:
            return torch.device("cpu")
        return torch.device(self.device_type, self.index if local_index is None else local_index)

    @property
    def module(self):
        """torch's module for this device (`torch.cuda`, `torch.emu`); None on the CPU."""
        return torch.get_device_module(self.device_type) if self.is_accelerator else None

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.torch_device, non_blocking=True) if self.is_accelerator else tensor

    def scalar(self, value: float = 0.0) -> torch.Tensor:
        """An fp32 scalar on the compute device: what losses accumulate in and collectives sum."""
        return torch.tensor(value, dtype=torch.float32, device=self.torch_device)

    def activate(self) -> None:
        """Make this rank's accelerator the current one of its process."""
        if self.is_accelerator:
            self.module.set_device(self.index)


def pin_host_memory(tensor: torch.Tensor, device_type: str):
    """Page-lock host memory torch did not allocate (a shared staging arena,
    `checkpoint/write_process.py`) for fast DMA from `device_type`'s memory; returns the call
    that unpins it, or None where nothing was pinned (the CPU's). CUDA registers it
    (cudaHostRegister); the emulated device mimics that (`torch.emu.host_register`)."""
    if device_type == "cpu":
        return None
    address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    if device_type == "cuda":
        cudart = torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(address, nbytes, 1))  # cudaHostRegisterPortable
        if error:
            raise RuntimeError(f"cudaHostRegister of {nbytes} host bytes failed: cudaError {error}")
        return lambda: cudart.cudaHostUnregister(address)
    module = torch.get_device_module(device_type)
    module.host_register(address, nbytes)
    return lambda: module.host_unregister(address)


def resolve_device_kind(kind: str) -> str:
    """`auto` -> `cuda` where torch sees a GPU, else `cpu`; any other kind unchanged."""
    if kind not in DEVICE_KINDS:
        raise DeviceUnavailable(f"cluster.device: {kind!r} is not one of {', '.join(DEVICE_KINDS)}")
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def select_device(precision: str = "auto", kind: str = "auto", index: int = 0) -> DeviceSpec:
    """The device, backend and dtypes of a rank on `kind` (`cluster.device`)."""
    kind = resolve_device_kind(kind)
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(
            "cluster.device=cuda: torch sees no CUDA device here "
            f"(torch {torch.__version__}); use cluster.device=auto, cpu or emulated"
        )
    if kind == "emulated":
        from raytrain_dt.accel import emulated

        try:
            emulated.enable()
        except emulated.EmulatedDeviceUnavailable as exc:
            raise DeviceUnavailable(f"cluster.device=emulated: {exc}") from exc
        device_type, backend = emulated.DEVICE_TYPE, emulated.BACKEND
    else:
        device_type, backend = kind, _BACKENDS[kind]
    # The emulated accelerator keeps the CPU's fp32 unless bf16 is pinned: it exists to check
    # device discipline, and its runs are compared with CPU runs.
    on_gpu = kind == "cuda"
    dtype = torch.bfloat16 if resolve_precision(precision, on_gpu) == "bf16" else torch.float32
    return DeviceSpec(device_type, backend, dtype, torch.float32, index if kind != "cpu" else 0)


def local_accelerator_index(assigned_ids: Sequence[str], visible: str | None = None) -> int:
    """This actor's device index from the accelerator ids Ray assigned it.

    Ray sets CUDA_VISIBLE_DEVICES to the assigned ids, so the device is found by its position
    among the visible ones (0 for one accelerator per actor). Where the visible list does not
    name it (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, or no list), the id is the index.
    """
    if not assigned_ids:
        return 0
    chosen = str(assigned_ids[0])
    visible_ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if chosen in visible_ids:
        return visible_ids.index(chosen)
    return int(chosen) if chosen.isdigit() else 0


def _ray_gpu_ids() -> list[str]:
    """The GPU ids Ray assigned the calling actor (none outside Ray or without GPUs)."""
    try:
        import ray

        if not ray.is_initialized():  # the runtime context would start (or join) a Ray
            return []
        return list(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))
    except Exception:  # not inside a Ray worker
        return []


def ray_accelerator_index() -> int:
    """`local_accelerator_index` for the calling Ray actor (0 outside Ray or without GPUs)."""
    return local_accelerator_index(_ray_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def ray_device_kind(kind: str, assigned_gpus: Sequence[str] | None = None) -> str:
    """`cluster.device` for a rank actor: `auto` is CUDA only where Ray gave the actor a GPU
    (`assigned_gpus`, by default the calling actor's). A rank on a simulated accelerator
    (`cluster.local_nodes`) or on a CPU-only node still sees a machine's GPUs, but every such
    rank would take the same one, which NCCL refuses ("Duplicate GPU detected", seen on a
    one-GPU H200 machine): it runs on the CPU. A kind named explicitly is kept."""
    if kind != "auto":
        return kind
    gpus = _ray_gpu_ids() if assigned_gpus is None else assigned_gpus
    return resolve_device_kind(kind) if gpus else "cpu"


def accelerator_name(spec: DeviceSpec) -> str:
    """What MFU looks the peak FLOP/s up by: the accelerator's own name, or "cpu"."""
    return spec.module.get_device_name(spec.index) if spec.is_accelerator else "cpu"


def release_accelerator_memory(spec: DeviceSpec) -> None:
    """Between layouts: wait for the device, return cached blocks, restart the peak statistic,
    so the next layout's memory figures are its own."""
    if spec.is_accelerator:
        module = spec.module
        module.synchronize()
        module.empty_cache()
        module.reset_peak_memory_stats()


def memory_usage(spec: DeviceSpec) -> dict[str, int]:
    """This rank's memory in bytes: on an accelerator the allocator's allocated and peak
    allocated bytes (peak since the layout began: `release_accelerator_memory`); on the CPU,
    where tensors live in the process heap, the resident set size and its high-water mark.
    `host_rss_peak_bytes` is always the host's high-water mark (`host_memory`)."""
    host = host_memory()
    if spec.is_accelerator:
        module = spec.module
        return {
            "mem_allocated_bytes": int(module.memory_allocated()),
            "mem_peak_bytes": int(module.max_memory_allocated()),
            "host_rss_peak_bytes": host["host_rss_peak_bytes"],
        }
    return {
        "mem_allocated_bytes": host["host_rss_bytes"],
        "mem_peak_bytes": host["host_rss_peak_bytes"],
        "host_rss_peak_bytes": host["host_rss_peak_bytes"],
    }


def host_memory() -> dict[str, int]:
    """This process's resident set size in host memory and its high-water mark (since the
    process started, or since the last `reset_host_peak`), in bytes."""
    import resource
    import sys

    import psutil

    rss = psutil.Process().memory_info().rss
    # ru_maxrss is the process's peak RSS: KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024
    return {"host_rss_bytes": int(rss), "host_rss_peak_bytes": int(max(rss, peak))}


def return_free_host_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc's malloc_trim): after a layout's model
    and optimizer are freed, a CPU rank's heap otherwise keeps their pages resident, so an
    actor waiting for its next layout (or run) would hold the old one's memory. False where
    there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    trim(0)
    return True


def reset_host_peak() -> bool:
    """Restart the host high-water mark at the current RSS, so that what follows (a layout's
    build and steps) measures its own peak, not an earlier layout's. Linux only (writing 5 to
    /proc/self/clear_refs, which ru_maxrss follows); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
