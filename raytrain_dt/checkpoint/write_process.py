"""An async save's write in a process of its own: DCP's file writes for a rank, outside the rank.

Why a process: on a host whose cores the training ranks keep busy, an async save's write
(torch.save's framing and CRC-32, SHA-256 of every byte, the page-cache copies) competes with
training for the cores and, as a thread, for the rank's GIL: each op the training thread
dispatches takes the GIL back from the writer, and a writer thread at a low priority holds the
GIL while it waits for a core, so lowering it gained nothing. In a process of its own the write
holds no lock training needs, runs at the lowest priority (SCHED_IDLE: it takes the cycles
that training leaves idle while it waits in collectives) and does less per byte: no CRC-32 in
torch.save's zip records, a process-wide switch set here only (the SHA-256 covers every byte,
and `torch.load` reads records without one).

How: `ProcessWriter` is DCP's usual writer (`storage.dcp_writer`, hashing its own files), with
only the shard files' writes handed to the rank's `WriterProcess`: planning, collectives and
`.metadata` stay in the rank. The staged buffers move into shared memory on their first save
(one copy; later saves reuse them, `staging.ReusableStager`): the process maps each buffer once,
and per save receives only which item goes where. It writes the same bytes as DCP's
FileSystemWriter (DCP's own `_write_item`, each item a torch.save record), hashes each file on
the way out and returns DCP's write results with the files' sizes and SHA-256s, which the rank
records like the rest (`digests.FileDigests`): the coordinator still reads no checkpoint byte.
Local paths and `s3://` alike: the process opens files through the same writer class.
Buffers that cannot be shared (pinned host memory: shards staged from an accelerator) are
written by the rank as before. The shared buffers cost one file descriptor each in the rank and
in the process (one per staged tensor).
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
from typing import Any

import torch
import torch.multiprocessing  # registers the pickling of tensors through shared memory
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.planner import WriteItemType

from raytrain_dt.checkpoint.digests import FileDigests, HashingStream
from raytrain_dt.checkpoint.idle_priority import run_at_idle_priority
from raytrain_dt.checkpoint.storage import dcp_writer

log = logging.getLogger(__name__)


class WriterProcess:
    """This rank's writer process, started on the first write and restarted if it died.
    One write at a time; `write` blocks its caller (DCP's background thread) without the GIL."""

    def __init__(self) -> None:
        self._process = None
        self._conn = None
        # Shared buffers the process has mapped: id -> storage (kept alive: the id is only
        # valid while the storage cannot be freed and its address reused).
        self._mapped: dict[int, torch.UntypedStorage] = {}
        self._ids: dict[tuple[int, int], int] = {}  # (data_ptr, nbytes) -> id
        self._next_id = 0

    def start(self) -> bool:
        """Start the process unless it runs; True if it started, knowing no buffers yet.

        A plain subprocess rather than multiprocessing's: a rank may itself be a daemonic
        multiprocessing process, which may not have multiprocessing children, and spawn would
        re-run the rank's main module. The pipe is a socket pair; tensors in shared memory
        travel over it as file descriptors, fetched from this process's resource sharer, which
        admits the process by this process's authkey."""
        if self._process is not None and self._process.poll() is None:
            return False
        if self._conn is not None:
            self._conn.close()  # a process that died: its pipe
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            stdin=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self._process.stdin.write(bytes(multiprocessing.current_process().authkey))
        self._process.stdin.close()
        self._conn = multiprocessing.connection.Connection(ours.detach())
        self._mapped, self._ids = {}, {}
        log.info("checkpoint writer process %d started", self._process.pid)
        return True

    @property
    def pid(self) -> int | None:
        """The process's pid while it runs (benchmarks read its CPU time)."""
        running = self._process is not None and self._process.poll() is None
        return self._process.pid if running else None

    def buffer_ref(self, storage: torch.UntypedStorage, new: dict) -> int:
        """The process's id of `storage` (shared memory), adding it to `new` the first time."""
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._ids:
            self._ids[key] = self._next_id
            self._mapped[self._next_id] = storage
            new[self._next_id] = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._next_id += 1
        return self._ids[key]

    def write(self, request: dict) -> list[tuple[str, list, int, str]]:
        """Write `request` (see `_serve`); per file (name, write results, size, sha256)."""
        try:
            self._conn.send(request)
            reply = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._process.kill()  # if only its pipe broke; the next write starts another
            self._process.wait(timeout=30)
            raise RuntimeError(f"the checkpoint writer process died: {exc}") from exc
        if isinstance(reply, str):
            raise OSError(reply)
        return reply

    def forget_except(self, live: set[int]) -> None:
        """Drop buffers no longer staged (a resize reallocated them): the next request tells
        the process the same, so both sides release them."""
        for buffer_id in [i for i in self._mapped if i not in live]:
            storage = self._mapped.pop(buffer_id)
            self._ids.pop((storage.data_ptr(), storage.nbytes()), None)


_WRITER = WriterProcess()
_WRITER_LOCK = threading.Lock()


def writer_pid() -> int | None:
    """This rank's writer process's pid while it runs."""
    return _WRITER.pid


class ProcessWriter:
    """`storage.dcp_writer(uri, digests)` whose shard files are written by the rank's
    `WriterProcess`; everything else (planning, `.metadata`) is that writer's own."""

    def __init__(self, uri: str, digests: FileDigests | None) -> None:
        self._inner = dcp_writer(uri, digests)
        self._uri = uri
        self._digests = digests
        self._in_rank = self._inner._write_data  # the rank's own writes: the fallback
        # DCP's write_data names the files and groups the items, then calls `_write_data`.
        self._inner._write_data = self._write_data

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def _write_data(self, planner, file_queue):
        queued = []
        while not file_queue.empty():
            queued.append(file_queue.get_nowait())
        with _WRITER_LOCK:
            request = _request(self._uri, self._inner.sync_files, planner, queued)
            if request is None:  # a buffer that cannot be shared: written here, as before
                _WRITER.forget_except(set())  # ids handed out for this request were never sent
                for entry in queued:
                    file_queue.put(entry)
                return self._in_rank(planner, file_queue)
            if _WRITER.start():  # a new process: the request again, every buffer sent anew
                request = _request(self._uri, self._inner.sync_files, planner, queued)
            replies = _WRITER.write(request)
        results = []
        for file_name, write_results, size, sha256 in replies:
            if self._digests is not None:
                self._digests.add(file_name, size, sha256)
            results += write_results
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(results)
        return future


def _request(uri: str, sync_files: bool, planner, queued: list) -> dict | None:
    """What the process needs for `queued` (DCP's (path, file name, items) per file): each
    item's bytes or its place in a shared buffer. None if a buffer cannot be shared."""
    new: dict[int, torch.Tensor] = {}
    live: set[int] = set()
    files = []
    for _path, file_name, items in queued:
        payloads = []
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                payloads.append((item, data.getvalue()))
                continue
            tensor = data.detach()
            # Pinned buffers (shards staged from an accelerator) would lose their pinning in
            # shared memory, and with it the staging copy's speed: those the rank writes.
            if tensor.device.type != "cpu" or tensor.is_pinned():
                return None
            storage = tensor.untyped_storage()
            if not storage.is_shared():
                try:
                    storage.share_memory_()  # once: the stager reuses its buffers
                except RuntimeError:
                    return None
            buffer_id = _WRITER.buffer_ref(storage, new)
            live.add(buffer_id)
            place = (tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
            payloads.append((item, (buffer_id, *place)))
        files.append((file_name, payloads))
    _WRITER.forget_except(live)
    return {"uri": uri, "sync": sync_files, "new": new, "live": live, "files": files}


def _main() -> None:
    """The writer process's entry: the rank's authkey on stdin, the pipe's descriptor."""
    multiprocessing.current_process().authkey = sys.stdin.buffer.read()
    _serve(multiprocessing.connection.Connection(int(sys.argv[1])))


def _serve(conn) -> None:
    """The writer process: one request at a time until the rank's end of the pipe closes."""
    run_at_idle_priority()
    torch.set_num_threads(1)
    torch.serialization.set_crc32_options(False)
    buffers: dict[int, torch.Tensor] = {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the rank is gone
        buffers.update(request["new"])
        for buffer_id in [i for i in buffers if i not in request["live"]]:
            del buffers[buffer_id]
        try:
            reply = [_write_file(request, buffers, name, items) for name, items in request["files"]]
        except Exception as exc:  # this save fails, not the process
            reply = f"{type(exc).__name__}: {exc}"
        conn.send(reply)


def _write_file(request: dict, buffers: dict, file_name: str, items: list):
    writer = dcp_writer(request["uri"])
    path = writer.fs.concat_path(writer.path, file_name)
    transforms = dcp_fs._StorageWriterTransforms(None)
    results = []
    with writer.fs.create_stream(path, "wb") as raw:
        stream = HashingStream(raw)
        # Bytes first, then tensors: DCP's order (`_write_files_from_queue`).
        ordered = sorted(items, key=lambda entry: not isinstance(entry[1], bytes))
        for item, payload in ordered:
            data: Any
            if isinstance(payload, bytes):
                data = io.BytesIO(payload)
            else:
                buffer_id, dtype, offset, shape, stride = payload
                storage = buffers[buffer_id].untyped_storage()
                data = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
                if data.untyped_storage().nbytes() != data.nbytes:
                    data = data.clone()  # torch.save would write the whole buffer (DCP's rule)
            results.append(
                dcp_fs._write_item(
                    transforms,
                    stream,
                    data,
                    item,
                    file_name,
                    dcp_fs.SerializationFormat.TORCH_SAVE,
                )
            )
        if request["sync"]:
            try:
                os.fsync(raw.fileno())
            except (AttributeError, io.UnsupportedOperation):
                os.sync()
    return file_name, results, stream.size, stream.hexdigest()


if __name__ == "__main__":
    _main()
