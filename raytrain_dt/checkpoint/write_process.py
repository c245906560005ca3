"""A rank's checkpoint writer process: where an async save's bytes are serialized, hashed and
written, so that the background write takes no GIL from the training thread.

Why a process. On a GPU host the training thread spends its step launching kernels in Python,
and every moment another thread of its process holds the GIL, no kernel is launched. A thread
that writes a checkpoint holds it for DCP's per-tensor serialization, the hashing and the file
objects' Python: measured by `bench/checkpoint_gil.py` (one rank's 703 MB), a writer thread
held it for 1.33 s of its 10.3 s write (13%), and the write itself crawled, waiting for the
GIL behind the busy thread at every turn. A process has a GIL of its own.

How:
- One per rank process (`write_process()`), forked early, while the process holds only what it
  imported (`start_write_process`, at a rank actor's start): a fork shares the parent's pages,
  and memory the parent frees after the fork stays held by the child. It lives across layouts:
  it has no process group. The save's collectives (plans, metadata) stay in DCP's writer
  thread of the rank, on its write group; only `write_data` (the bytes) moves here.
- The staged state lives in one shared arena per layout (`SharedHostBuffer`, a memfd: not
  bound by a container's small /dev/shm), which the stager fills and the child maps once (its
  descriptor passed over the pipe). A save sends its plan and, for each write item, where its
  bytes lie in the arena: no state byte crosses the pipe.
- The child builds the same DCP writer for the step directory (`dcp_writer`) and runs its
  `write_data`, so the files are exactly those a writer thread would write; the digests it
  records return with the write results.
- Descriptors the child inherits are pointed at /dev/null first: a forked copy of a gloo or Ray
  socket would keep a connection open after the rank closes it, and a peer blocked on it would
  never see the close (a layout's release depends on that close). They are not closed: a stale
  object of the parent collected in the child would then close whatever file reused the number.
- A child that dies fails the save in flight (its pipe closes) and the next save forks a new
  one; the child exits when its pipe closes (the rank died).
"""

from __future__ import annotations

import contextlib
import io
import logging
import mmap
import os
import signal
import socket
import threading
import uuid
import warnings
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from raytrain_dt.accel.device import pin_host_memory
from raytrain_dt.checkpoint.digests import DIGEST, FileDigests
from raytrain_dt.checkpoint.storage import dcp_writer

log = logging.getLogger(__name__)


class WriterProcessFailed(RuntimeError):
    """The writer process failed a write, or died during one (the message says which)."""


class SharedHostBuffer:
    """`nbytes` of host memory another process of this host can map (a memfd), as one uint8
    tensor (`flat`), page-locked where `pinned_for` names an accelerator that can pin it."""

    def __init__(self, nbytes: int, pinned_for: str = "cpu") -> None:
        self.nbytes = max(int(nbytes), 1)
        self.key = uuid.uuid4().hex
        self.fd = os.memfd_create("raytrain-dt-staging")
        os.ftruncate(self.fd, self.nbytes)
        mapping = mmap.mmap(self.fd, self.nbytes)
        self.flat = torch.frombuffer(mapping, dtype=torch.uint8)
        self.data_ptr = self.flat.data_ptr()
        unpin = pin_host_memory(self.flat, pinned_for)
        # The mapping lives while any view of `flat` does; the pin and the descriptor go with
        # this object (unpinned while the finalizer still holds the mapping).
        weakref.finalize(self, _release, mapping, self.fd, unpin)

    def holds(self, tensor: torch.Tensor) -> int | None:
        """`tensor`'s byte offset here if it is a contiguous run of this buffer, else None."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        offset = tensor.data_ptr() - self.data_ptr
        nbytes = tensor.numel() * tensor.element_size()
        return offset if offset >= 0 and offset + nbytes <= self.nbytes else None


def _release(mapping: mmap.mmap, fd: int, unpin) -> None:
    """Unpin and close the descriptor. `mapping` is passed only to outlive the unpinning; it is
    unmapped once the finalizer and the last tensor viewing it let it go."""
    if unpin is not None:
        unpin()
    os.close(fd)


@dataclass(frozen=True)
class _InArena:
    key: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Copied:  # a tensor outside any shared arena: its bytes travel (not an async save's)
    data: bytes
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Value:  # a plain value (a learning rate, a step count), serialized by the child
    value: Any


@dataclass(frozen=True)
class _WriteRequest:
    uri: str
    plan: SavePlan
    items: dict[MetadataIndex, Any]  # write item -> bytes, _Value, _InArena or _Copied
    arenas: tuple[str, ...]  # what the child must keep mapped; it drops the others


class WriteProcess:
    """The forked writer (see the module's doc) and the rank's end of its pipe."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        with warnings.catch_warnings():
            # Python 3.12+ warns on forking a process with threads (Ray's, torch's): the child
            # runs only this module's loop on its own pipe, with no CUDA and one intra-op
            # thread (`_serve`); Python re-creates its own locks at a fork.
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:  # the child
            code = 0
            try:
                ours.close()
                _serve(Connection(theirs.detach()))
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._mapped: tuple[str, ...] = ()
        self._lock = threading.Lock()
        self.alive = True

    def write(
        self, uri: str, plan: SavePlan, items: dict, arenas: list[SharedHostBuffer]
    ) -> tuple[list[WriteResult], dict[str, dict]]:
        """Write `plan` below `uri` in the child: (its write results, {file: size, digest})."""
        with self._lock:
            try:
                for arena in arenas:
                    if arena.key not in self._mapped:
                        self._conn.send(("map", arena.key, arena.nbytes))
                        send_handle(self._conn, arena.fd, self.pid)
                keys = tuple(arena.key for arena in arenas)
                self._conn.send(("write", _WriteRequest(uri, plan, items, keys)))
                self._mapped = keys
                answer = self._conn.recv()
            except (EOFError, OSError) as exc:
                self.alive = False
                raise WriterProcessFailed(
                    f"the checkpoint writer process (pid {self.pid}) died during the write "
                    f"of {uri} ({_exit_status(self.pid)})"
                ) from exc
        if answer[0] == "failed":
            raise WriterProcessFailed(f"{uri}: written by the writer process: {answer[1]}")
        return answer[1], answer[2]

    def drop_arenas(self) -> bool:
        """Unmap every arena in the child (a layout was released: its staging memory goes back
        to the host now, not at the next layout's first save). False, and nothing sent, while
        a write is in flight (an abandoned save's): the child keeps the arena it reads, and
        drops it at the next write."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._mapped:
                self._conn.send(("keep", ()))
                self._mapped = ()
            return True
        except OSError:
            self.alive = False
            return False
        finally:
            self._lock.release()

    def close(self) -> None:
        self.alive = False
        self._conn.close()  # the child sees the end of its pipe and exits
        _exit_status(self.pid, wait=True)


def _exit_status(pid: int, wait: bool = False) -> str:
    try:
        done, status = os.waitpid(pid, 0 if wait else os.WNOHANG)
    except ChildProcessError:  # reaped already, or SIGCHLD ignored
        return "exit status unknown"
    if done == 0:
        return "still running"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


_PROCESS: WriteProcess | None = None
_PROCESS_LOCK = threading.Lock()


def write_process() -> WriteProcess:
    """This process's writer process: forked now if none is alive."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None or not _PROCESS.alive:
            if _PROCESS is not None:
                _exit_status(_PROCESS.pid)  # reap the dead one
            _PROCESS = WriteProcess()
        return _PROCESS


def release_write_arenas() -> None:
    """After a layout's release: the writer process lets go of its staging arenas."""
    with _PROCESS_LOCK:
        process = _PROCESS
    if process is not None and process.alive:
        process.drop_arenas()


def start_write_process() -> None:
    """Fork the writer now, while this process holds only what it imported (a rank actor's
    start): later, the child would share, and keep alive, the memory of a layout the rank
    frees afterwards."""
    write_process()


class OffloadedWriter(StorageWriter):
    """A DCP storage writer for `uri` whose `write_data` runs in the writer process; the
    rest (plans, the coordinator's metadata) is DCP's own writer's, in the calling thread.
    `arena`: where the staged tensors lie (the stager's shared arena, read at each write)."""

    def __init__(self, uri: str, digests: FileDigests | None, arena) -> None:
        super().__init__()
        self.uri = uri
        self._inner = dcp_writer(uri, digests)
        self._digests = digests
        self._arena = arena  # () -> SharedHostBuffer | None

    # --- everything but the bytes: DCP's writer ------------------------------------------------
    def reset(self, checkpoint_id=None) -> None:
        self._inner.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self._inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self._inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self._inner.prepare_global_plan(plans)

    def finish(self, metadata, results) -> None:
        self._inner.finish(metadata, results)

    def storage_meta(self):
        return self._inner.storage_meta()

    @property
    def checkpoint_id(self):
        return self._inner.checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen by DCP for a bare checkpoint id

    # --- the bytes: the writer process ---------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        arena = self._arena()
        items = {item.index: _describe(item, planner, arena) for item in plan.items}
        results, files = write_process().write(
            self.uri, plan, items, [arena] if arena is not None else []
        )
        # This process's listings of the directory (fsspec caches them: S3) predate the
        # child's files; a load here must not trust them.
        listings = getattr(getattr(self._inner, "fs", None), "fs", None)
        if listings is not None:
            listings.invalidate_cache(self.uri)
        if self._digests is not None:
            for name, entry in files.items():
                self._digests.add(name, entry["size"], entry[DIGEST])
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


def _describe(item: WriteItem, planner: SavePlanner, arena: SharedHostBuffer | None):
    """What the child needs to produce `item`'s data: a tensor as its place in `arena` (or,
    outside it, its bytes); a plain value as itself, which the child serializes as DCP's
    default planner would (`torch.save`, thousands of times per save for an optimizer's
    per-parameter values: the bulk of the GIL a save took from the rank after its tensors)."""
    if item.type == WriteItemType.BYTE_IO:
        own = getattr(type(planner), "transform_object", None)
        if own is DefaultSavePlanner.transform_object:
            return _Value(planner.lookup_object(item.index))
        return planner.resolve_data(item).getvalue()  # a planner's own serialization
    tensor = planner.resolve_data(item).detach()
    offset = arena.holds(tensor) if arena is not None else None
    if offset is not None:
        return _InArena(arena.key, offset, tensor.dtype, tuple(tensor.shape))
    raw = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return _Copied(raw.numpy().tobytes(), tensor.dtype, tuple(tensor.shape))


# --- the child -------------------------------------------------------------------------------
def _serve(conn: Connection) -> None:
    _forget_inherited_descriptors(keep={0, 1, 2, conn.fileno()})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the rank's to handle
    # One thread: a forked process must not enter the OpenMP pool of its parent.
    torch.set_num_threads(1)
    mapped: dict[str, mmap.mmap] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the rank closed its end, or died
            return
        if message[0] == "map":
            _, key, nbytes = message
            fd = recv_handle(conn)
            mapped[key] = mmap.mmap(fd, nbytes)
            os.close(fd)
            continue
        if message[0] == "keep":  # only these arenas: the rank released the others
            for key in set(mapped) - set(message[1]):
                del mapped[key]
            continue
        request: _WriteRequest = message[1]
        for key in set(mapped) - set(request.arenas):  # a previous layout's
            del mapped[key]  # unmapped with the last tensor of the last write
        try:
            results, files = _write(request, mapped)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            conn.send(("failed", f"{type(exc).__name__}: {first}"))
            continue
        conn.send(("done", results, files))


def _write(request: _WriteRequest, mapped: dict[str, mmap.mmap]):
    data = {index: _materialize(item, mapped) for index, item in request.items.items()}
    digests = FileDigests()
    writer = dcp_writer(request.uri, digests)
    results = writer.write_data(request.plan, _Resolved(data)).wait()
    return results, digests.manifest()


def _materialize(item, mapped: dict[str, mmap.mmap]):
    if isinstance(item, bytes):
        return io.BytesIO(item)
    if isinstance(item, _Value):
        serialized = io.BytesIO()
        torch.save(item.value, serialized)
        return serialized
    numel = 1
    for size in item.shape:
        numel *= size
    if numel == 0:
        return torch.empty(item.shape, dtype=item.dtype)
    if isinstance(item, _Copied):
        return torch.frombuffer(bytearray(item.data), dtype=item.dtype).view(item.shape)
    # A tensor whose storage is exactly its own bytes in the arena: DCP's writer then writes
    # it without a copy (a view of a larger storage, it would clone it first).
    return torch.frombuffer(
        mapped[item.key], dtype=item.dtype, count=numel, offset=item.offset
    ).view(item.shape)


class _Resolved:
    """What DCP's `write_data` asks of its planner: each write item's data."""

    def __init__(self, data: dict) -> None:
        self._data = data

    def resolve_data(self, item):
        return self._data[item.index]


def _forget_inherited_descriptors(keep: set[int]) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep or fd == devnull:
            continue
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            os.dup2(devnull, fd)
    os.close(devnull)
