"""DeepSpeed's view of the emulated device: its CPU accelerator, renamed to the `emu` device and
the `emuccl` backend.

DeepSpeed asks its accelerator object where tensors go (`current_device_name`), which backend
its groups use, and how to pin memory. Its CPU accelerator already behaves as a synchronous
device without streams, which the emulated device is; only the names change, so that ZeRO's
flat buffers and partitions live on the emulated device and its collectives go through the
NCCL-like backend, as they do on CUDA.
"""

from __future__ import annotations

import torch
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from raytrain_dt.accel.emulated import BACKEND, DEVICE_TYPE


class EmulatedAccelerator(CPU_Accelerator):
    def __init__(self) -> None:
        super().__init__()
        self._name = DEVICE_TYPE
        self._communication_backend_name = BACKEND

    def device_name(self, device_index=None) -> str:
        return DEVICE_TYPE if device_index is None else f"{DEVICE_TYPE}:{device_index}"

    def current_device(self) -> int:
        return torch.accelerator.current_device_index()

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def device(self, device_index=None) -> torch.device:
        return torch.device(
            DEVICE_TYPE, self.current_device() if device_index is None else device_index
        )

    def set_device(self, device_index) -> None:
        torch.accelerator.set_device_index(device_index)

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory()

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == DEVICE_TYPE


def use_emulated_accelerator(enabled: bool = True) -> None:
    """Make DeepSpeed place its state on, and talk through, the emulated device; with
    `enabled=False`, give a CPU rank DeepSpeed's CPU accelerator back (one process may run
    layouts of both kinds, as the test pool's workers do)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    current = get_accelerator()
    if enabled and not isinstance(current, EmulatedAccelerator):
        set_accelerator(EmulatedAccelerator())
    elif not enabled and isinstance(current, EmulatedAccelerator):
        set_accelerator(CPU_Accelerator())
