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


def select_device(precision: str = "auto") -> DeviceSpec:
    if torch.cuda.is_available():
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        return DeviceSpec("cuda", "nccl", dtype, torch.float32)
    if precision == "bf16":
        # bf16 on CPU is legal but slow and not what CPU tests compare against; honour the pin.
        return DeviceSpec("cpu", "gloo", torch.bfloat16, torch.float32)
    return DeviceSpec("cpu", "gloo", torch.float32, torch.float32)
