"""Compiling and loading the emulated device's C++ source (`csrc/emulated_device.cpp`).

torch's JIT extension builder compiles it once per torch version and source (about 15 s on
2 cores) into torch's extension cache, under a file lock, so concurrent rank processes build it
once. `make install` runs `python -m raytrain_dt.accel.emulated.build` so that tests never pay
for it; later loads only check the source hash and open the library.

torch's lock is a bare file with no owner: a build killed mid-way leaves it behind, and every
later load would wait on it forever. A lock far older than any build is removed first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "emulated_device.cpp"
LIBRARY_NAME = "raytrain_emulated_device"
# A build takes ~15 s on 2 cores; a lock 40x older belongs to a build that was killed.
STALE_LOCK_S = 600.0

log = logging.getLogger(__name__)


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove torch's build lock in `build_dir` if it is older than STALE_LOCK_S; returns
    whether one was removed."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False  # a build may be running now
    log.warning("removing a stale build lock (%.0f s old, left by a killed build): %s", age, lock)
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)
    return True


def load_library(verbose: bool = False) -> str:
    """Build (if the source or torch changed) and load the device library; returns its path."""
    from raytrain_dt.accel.emulated import EmulatedDeviceUnavailable

    try:
        from torch.utils import cpp_extension

        # torch's own build directory (private, so looked up: a torch without it just builds).
        build_directory = getattr(cpp_extension, "_get_build_directory", None)
        if build_directory is not None:
            clear_stale_lock(Path(build_directory(LIBRARY_NAME, verbose)))
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
