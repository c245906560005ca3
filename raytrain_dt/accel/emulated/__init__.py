"""The emulated accelerator: a torch device type of its own ("emu") whose memory lives in host
RAM, and a collective backend ("emuccl") bound to it that, like NCCL, refuses tensors of any
other device.

On a machine without a GPU this is what stands in for CUDA + NCCL in tests: every path that
would hand a host tensor to a GPU collective fails here the way it fails on NCCL, and every
path that moves state between host and accelerator (pinned staging, offload, RNG, memory
stats, teardown) runs with two distinct device types. Compute runs on torch's CPU kernels, so a
run on it gives exactly the CPU run's numbers.

`enable()` loads the compiled device (building it once if needed), names it, and registers the
device module and the collective backend; it is idempotent and per process.
"""

from __future__ import annotations

import threading

DEVICE_TYPE = "emu"
BACKEND = "emuccl"

_lock = threading.Lock()
_enabled = False


class EmulatedDeviceUnavailable(RuntimeError):
    """The emulated device could not be built or loaded here (the message says why)."""


def enable() -> None:
    """Make `torch.device("emu")` and the `emuccl` backend usable in this process."""
    global _enabled
    with _lock:
        if _enabled:
            return
        import torch
        import torch.distributed as dist

        from raytrain_dt.accel.emulated.build import load_library
        from raytrain_dt.accel.emulated.collectives import EmulatedCollectives
        from raytrain_dt.accel.emulated.device_module import device_module

        load_library()
        torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        torch._register_device_module(DEVICE_TYPE, device_module())
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        dist.Backend.register_backend(BACKEND, EmulatedCollectives.create, devices=[DEVICE_TYPE])
        _enabled = True


def is_enabled() -> bool:
    return _enabled
