"""Compiling and loading the emulated device's C++ source (`csrc/emulated_device.cpp`).

torch's JIT extension builder compiles it once per torch version and source (about 15 s on
2 cores) into torch's extension cache, under a file lock, so concurrent rank processes build it
once. `make install` runs `python -m raytrain_dt.accel.emulated.build` so that tests never pay
for it; later loads only check the source hash and open the library.
"""

from __future__ import annotations

import sys
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "emulated_device.cpp"
LIBRARY_NAME = "raytrain_emulated_device"


def load_library(verbose: bool = False) -> str:
    """Build (if the source or torch changed) and load the device library; returns its path."""
    from raytrain_dt.accel.emulated import EmulatedDeviceUnavailable

    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name=LIBRARY_NAME,
            sources=[str(SOURCE)],
            extra_cflags=["-O2"],
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as exc:  # no compiler, no ninja, a torch without headers, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EmulatedDeviceUnavailable(
            f"the emulated device could not be built ({first}); it needs a C++ compiler and "
            "ninja: run `make install` (or `python -m raytrain_dt.accel.emulated.build`)"
        ) from exc


if __name__ == "__main__":
    print(load_library(verbose="-v" in sys.argv))
