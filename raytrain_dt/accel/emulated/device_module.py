"""`torch.emu`: the device module torch's generic code (FSDP2, DeviceMesh, DCP, autograd's
RNG forking) looks up by device type, as it looks up `torch.cuda`.

Execution on the emulated device is synchronous (`csrc/emulated_device.cpp`), so streams and
events are torch's generic ones over a single stream per device, and `synchronize` has nothing
to wait for. Kernels run on the host and draw random numbers from the CPU generator, so the
device's RNG state *is* the CPU generator's.
"""

from __future__ import annotations

import contextlib
import types

import torch

from raytrain_dt.accel.emulated import DEVICE_TYPE

NAME = "Emulated accelerator (host memory)"


def _ops():
    return torch.ops.raytrain_emu


def current_device() -> int:
    return int(_ops().current_device())


def set_device(device) -> None:
    _ops().set_device(device if isinstance(device, int) else torch.device(device).index or 0)


def device_count() -> int:
    return int(_ops().device_count())


def synchronize(device=None) -> None:
    """Nothing is ever in flight: kernels run when they are issued."""


def memory_allocated(device=None) -> int:
    return int(_ops().memory_allocated())


def max_memory_allocated(device=None) -> int:
    return int(_ops().max_memory_allocated())


def reset_peak_memory_stats(device=None) -> None:
    _ops().reset_peak_memory_stats()


def host_register(address: int, nbytes: int) -> None:
    """Page-lock host memory allocated elsewhere (CUDA's cudaHostRegister)."""
    _ops().host_register(address, nbytes)


def host_unregister(address: int) -> None:
    _ops().host_unregister(address)


def empty_cache() -> None:
    """Freed blocks go straight back to the host allocator: no cache to empty."""


def get_rng_state(device=None) -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    # The generator itself: `torch.manual_seed` calls this module's seeding in turn.
    torch.default_generator.manual_seed(seed)


def current_stream(device=None) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def Stream(device=None, priority: int = 0) -> torch.Stream:  # named as torch.cuda.Stream
    return torch.Stream(
        device=device or torch.device(DEVICE_TYPE, current_device()), priority=priority
    )


@contextlib.contextmanager
def stream(selected):
    if selected is None:
        yield
        return
    previous = torch.accelerator.current_stream(selected.device)
    torch.accelerator.set_stream(selected)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


def device_module() -> types.ModuleType:
    module = types.ModuleType(f"torch.{DEVICE_TYPE}", __doc__)
    functions = dict(
        is_available=lambda: True,
        is_initialized=lambda: True,
        _lazy_init=lambda: None,
        _is_in_bad_fork=lambda: False,
        is_bf16_supported=lambda including_emulation=True: True,
        get_amp_supported_dtype=lambda: [torch.bfloat16, torch.float16],
        get_device_name=lambda device=None: NAME,
        current_device=current_device,
        set_device=set_device,
        device_count=device_count,
        synchronize=synchronize,
        memory_allocated=memory_allocated,
        max_memory_allocated=max_memory_allocated,
        reset_peak_memory_stats=reset_peak_memory_stats,
        empty_cache=empty_cache,
        host_register=host_register,
        host_unregister=host_unregister,
        get_rng_state=get_rng_state,
        set_rng_state=set_rng_state,
        manual_seed=manual_seed,
        manual_seed_all=manual_seed,
        current_stream=current_stream,
        Stream=Stream,
        Event=torch.Event,
        stream=stream,
    )
    for name, value in functions.items():
        setattr(module, name, value)
    return module
