"""Checkpoint files written around the page cache (`O_DIRECT`), for local and shared POSIX
filesystems.

A checkpoint's bytes are written once and, on the writing host, read again only after a
failure. Written through the page cache they cost the host's CPU twice over: the kernel copies
every byte into a cache page, and once the cache is full (a host that saves every few minutes
fills it within the hour) each new page must first be reclaimed from the old ones, in the
writer's own time. Measured here for 352 MB (one rank's share of `bench_checkpoint`'s model):
0.7-0.9 s of kernel CPU once the cache is full, against 0.03 s with `O_DIRECT` (the
ranks' write table of `bench/bench_checkpoint.py` has both, with free memory). On a training host that CPU is taken from the ranks; DeepSpeed's
FastPersist writes with `O_DIRECT` for the same reason.

`O_DIRECT` needs aligned memory, offsets and lengths. `DirectFile` gathers writes into one
page-aligned block and writes whole blocks; at close it writes the tail padded to the
alignment, truncates the file to its true length and syncs it (the data and the size). The
gathering copy runs without the GIL (`ctypes.memmove`): a write runs in the background beside
the training thread, and a copy under the GIL (a memoryview's slice assignment) would stall it
for every byte the checkpoint holds. Where
the filesystem refuses `O_DIRECT` (tmpfs before Linux 6.6, some FUSE mounts) the file is an
ordinary buffered one: the same bytes, at the page cache's cost. Reads are unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from torch.distributed.checkpoint.filesystem import FileSystem

ALIGN = 4096  # every device's logical block size divides it
BLOCK = 8 << 20  # bytes gathered per write: large writes keep the device busy
# Copies at least this long go through `ctypes.memmove`, which releases the GIL; shorter ones
# (DCP's headers and pickles) cost less than the call.
UNLOCKED_COPY_MIN = 64 << 10


class DirectFile:
    """A write-only file object over an `O_DIRECT` descriptor (see the module's doc)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._block = mmap.mmap(-1, BLOCK)  # anonymous mappings are page-aligned
        self._view = memoryview(self._block)
        self._address = np.frombuffer(self._view, dtype=np.uint8).ctypes.data
        self._filled = 0
        self._position = 0  # bytes written by the caller
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        taken = 0
        source = None
        while taken < len(view):
            count = min(BLOCK - self._filled, len(view) - taken)
            if count >= UNLOCKED_COPY_MIN:
                if source is None:  # a read-only buffer's address too (ctypes wants writable)
                    source = np.frombuffer(view, dtype=np.uint8).ctypes.data
                ctypes.memmove(self._address + self._filled, source + taken, count)
            else:
                self._view[self._filled : self._filled + count] = view[taken : taken + count]
            self._filled += count
            taken += count
            if self._filled == BLOCK:
                self._write_out(BLOCK)
        self._position += taken
        return taken

    def _write_out(self, length: int) -> None:
        done = 0
        while done < length:  # a short write leaves an aligned remainder (or raises)
            done += os.write(self._fd, self._view[done:length])
        self._filled = 0

    def tell(self) -> int:
        return self._position

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        """Nothing: a partial block can only be written at close (a caller's fsync before close
        is repeated by `close`, after the tail)."""

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._filled:
                padded = -(-self._filled // ALIGN) * ALIGN
                self._view[self._filled : padded] = bytes(padded - self._filled)
                self._write_out(padded)
                os.ftruncate(self._fd, self._position)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._view.release()
            self._block.close()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_for_writing(path: str | os.PathLike):
    """`path` opened to be written from the start: a `DirectFile` where the filesystem allows
    `O_DIRECT`, else an ordinary binary file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return DirectFile(os.open(path, flags | direct, 0o644))
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # no O_DIRECT here
                raise
    return open(path, "wb")  # the caller closes it


class DirectFileSystem(FileSystem):
    """DCP's local filesystem, writing its files with `open_for_writing`."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = open_for_writing(Path(path))
        try:
            yield stream
        finally:
            stream.close()
