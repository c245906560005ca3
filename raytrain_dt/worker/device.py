"""The one place that decides device, collective backend and dtypes.

CPU ranks use gloo and fp32. CUDA ranks use nccl, bf16 compute with fp32 master weights and fp32
gradient reduction, unless `engine.precision` pins fp32. Everything else asks this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSpec:
    device_type: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    param_dtype: torch.dtype  # compute dtype of parameters in forward/backward
    reduce_dtype: torch.dtype  # dtype of gradient reductions

    @property
    def mixed_precision(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def pin_memory(self) -> bool:
        """Whether host copies of offloaded states are pinned (page-locked) for fast DMA; only
        an accelerator can pin, a CPU-only torch refuses to."""
        return self.device_type == "cuda"

    def device(self, local_index: int = 0) -> torch.device:
        return (
            torch.device(self.device_type, local_index)
            if self.device_type == "cuda"
            else torch.device("cpu")
        )


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """'auto' -> bf16 on GPUs, fp32 on CPUs; an explicit 'fp32' or 'bf16' is honoured.

    The planner calls this on the driver (sizing memory), the ranks via `select_device`.
    """
    if precision != "auto":
        return precision
    return "bf16" if on_gpu else "fp32"


def select_device(precision: str = "auto") -> DeviceSpec:
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if resolve_precision(precision, on_gpu) == "bf16" else torch.float32
    if on_gpu:
        return DeviceSpec("cuda", "nccl", dtype, torch.float32)
    # bf16 on CPU is legal but slow and not what CPU tests compare against; honoured if pinned.
    return DeviceSpec("cpu", "gloo", dtype, torch.float32)


def accelerator_name(spec: DeviceSpec) -> str:
    """What MFU looks the peak FLOP/s up by: the CUDA device name, or "cpu"."""
    return torch.cuda.get_device_name() if spec.device_type == "cuda" else "cpu"


def memory_usage(spec: DeviceSpec) -> dict[str, int]:
    """This rank's memory in bytes: on CUDA the caching allocator's allocated and peak
    allocated bytes; on CPU, where tensors live in the process heap, the resident set size and
    its high-water mark (VmHWM). Both peaks cover the process's life, not one layout."""
    if spec.device_type == "cuda":
        return {
            "mem_allocated_bytes": torch.cuda.memory_allocated(),
            "mem_peak_bytes": torch.cuda.max_memory_allocated(),
        }
    import resource
    import sys

    import psutil

    rss = psutil.Process().memory_info().rss
    # ru_maxrss is the process's peak RSS: KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024
    return {"mem_allocated_bytes": int(rss), "mem_peak_bytes": int(max(rss, peak))}
