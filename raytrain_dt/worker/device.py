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
