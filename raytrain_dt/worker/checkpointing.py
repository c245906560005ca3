"""A rank's side of checkpointing: save at step boundaries (async where the engine can),
agree with the other ranks on requested saves, restore RNG, and report what happened.

The rank never decides that a checkpoint exists: it reports `saved` (or `save_failed`) and
the coordinator commits once every rank has saved. The `saved` report lists the files this rank
wrote with their sizes and SHA-256s, hashed as they were written (`checkpoint/digests.py`), so
the coordinator commits without reading them. A failed write fails that save, not the run.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future

import torch
import torch.distributed as dist

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.checkpoint.digests import FileDigests
from raytrain_dt.checkpoint.record import RNG_DIR
from raytrain_dt.checkpoint.storage import Location
from raytrain_dt.engines.base import Engine
from raytrain_dt.worker.rank_chaos import DieAfterWriting
from raytrain_dt.worker.reports import (
    CheckpointStagedReport,
    RankReport,
    SavedReport,
    SaveFailedReport,
)

log = logging.getLogger(__name__)


def side_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The background writes' and the save agreement's gloo groups (`RankCheckpointer`).

    Created with the mesh, right after every peer has joined (`worker/rendezvous.py`): a
    group's formation waits for every peer's address in the layout's store, which a teardown
    interrupts (`LeavableStore`), but a peer lost later would be waited for in the set-up's
    collectives instead, which only a closed connection or an abort ends."""
    return dist.new_group(backend="gloo"), dist.new_group(backend="gloo")


class RankCheckpointer:
    def __init__(
        self,
        engine: Engine,
        rank: int,
        report: Callable[[RankReport], None],
        use_async: bool,
        device: DeviceSpec,
        die_while_saving: Collection[int] = (),
        groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
    ):
        """`device`: whose RNG is saved beside the CPU's. `die_while_saving`: steps whose save
        this rank dies in the middle of (chaos `kill_rank_mid_save`, for tests). `groups`:
        `side_groups()` made earlier (a rank actor's set-up makes them with the mesh)."""
        self.engine = engine
        self.device = device
        self.die_while_saving = frozenset(die_while_saving)
        self.rank = rank
        self.report = report
        self.use_async = use_async and engine.supports_async_save
        # Background writes and the save agreement each get their own gloo group: collectives
        # from two threads on one group can interleave and deadlock, and neither may touch the
        # training group (nccl on GPU) from outside the train step.
        self.write_group, self.agree_group = groups or side_groups()
        self.requested = threading.Event()
        self.stop_requested = threading.Event()
        # A drain whose state stays in host memory (`peer_copies`): the agreed save is an
        # in-memory copy, not a write to storage. Set by `agree_requested`, on every rank alike.
        self.memory_requested = threading.Event()
        self.memory_only = False
        # Whether this rank's in-memory copy is still in flight (`peer_copies`), and whether
        # every rank's is done at this boundary: copies are taken by all ranks at the same
        # steps or by none, or no step would have a complete set.
        self.copy_busy: Callable[[], bool] = lambda: False
        self.copy_free = True
        # The save in flight: its write, and an event set once its outcome is reported.
        self._pending: tuple[Future, threading.Event] | None = None

    # --- requests ----------------------------------------------------------------------------
    def request(self, stop: bool = False, memory_only: bool = False) -> None:
        """Ask for a save at the next step boundary (preemption notice, resize), and with
        `stop` for the loop to end right after it; with `memory_only` the save is an in-memory
        copy (a planned resize whose state stays in host memory)."""
        if memory_only:
            self.memory_requested.set()
        if stop:
            self.stop_requested.set()
        self.requested.set()

    def agree_requested(self) -> tuple[bool, bool]:
        """(save, stop), the same on every rank: if any rank was asked, all ranks act at this
        very step boundary, so the save's collectives line up. Also agrees `memory_only` and
        `copy_free` (in-memory copies), in the same all-reduce."""
        local = [
            self.requested.is_set(),
            self.stop_requested.is_set(),
            self.memory_requested.is_set(),
            self.copy_busy(),
        ]
        flags = torch.tensor([int(f) for f in local], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.agree_group)
        save, stop = bool(flags[0]), bool(flags[1])
        self.memory_only = save and bool(flags[2])
        self.copy_free = not bool(flags[3])
        if save:
            self.requested.clear()
            self.memory_requested.clear()
        if stop:
            self.stop_requested.clear()
        return save, stop

    # --- saving ------------------------------------------------------------------------------
    def save(self, uri: str, step: int) -> None:
        self.wait()  # one save in flight: staging buffers and the writer are reused
        started = time.perf_counter()
        written = FileDigests()  # what this rank writes for this save, hashed as it goes
        try:
            self._save_rng(uri, written)
            fault = {"wrap_writer": DieAfterWriting} if step in self.die_while_saving else {}
            if self.use_async:
                future = self.engine.save_async(uri, self.write_group, digests=written, **fault)
                reported = threading.Event()
                self._pending = (future, reported)
                future.add_done_callback(
                    lambda f, s=step, u=uri: self._finished(s, u, f, reported, written)
                )
            else:
                self.engine.save(uri, digests=written, **fault)
                self._saved(step, uri, written)
        except Exception as exc:  # permission denied, disk full, ...: this save fails, not the run
            self._failed(step, uri, exc)
        self.report(CheckpointStagedReport(step, stall_s=time.perf_counter() - started))

    def _finished(
        self, step: int, uri: str, future: Future, reported: threading.Event, written: FileDigests
    ) -> None:
        exc = future.exception()
        if exc is None:
            self._saved(step, uri, written)
        else:
            self._failed(step, uri, exc)
        reported.set()

    def _saved(self, step: int, uri: str, written: FileDigests) -> None:
        self.report(SavedReport(step, self.rank, path=uri, files=written.manifest()))

    def _failed(self, step: int, uri: str, exc: BaseException) -> None:
        message = f"{uri}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.error("checkpoint step %d failed on rank %d: %s", step, self.rank, message)
        self.report(SaveFailedReport(step, self.rank, error=message))

    def abandon(self) -> None:
        """Leave the layout without the save in flight: its outcome is never reported, so it
        is never committed (its files stay, uncommitted, as a crashed save's). For a failure
        whose resume comes from newer in-memory copies (`RankWorker.teardown`)."""
        self.report = lambda _report: None
        self._pending = None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the in-flight save (if any) is written or has failed, and its outcome
        is reported; False if it is still in flight after `timeout_s`."""
        if self._pending is None:
            return True
        if not self._pending[1].wait(timeout_s):
            return False
        self._pending = None
        return True

    # --- RNG ---------------------------------------------------------------------------------
    def _save_rng(self, uri: str, written: FileDigests) -> None:
        loc = Location.parse(uri).child(RNG_DIR)
        loc.makedirs()
        data = rng_state_bytes(self.device)
        name = f"rank_{self.rank}.pt"
        with loc.fs.open(loc.child(name).path, "wb") as f:
            f.write(data)
        written.add_bytes(f"{RNG_DIR}/{name}", data)

    def restore_rng(self, uri: str) -> None:
        loc = Location.parse(uri).child(RNG_DIR, f"rank_{self.rank}.pt")
        if loc.exists():
            with loc.fs.open(loc.path, "rb") as f:
                restore_rng_bytes(f.read(), self.device)


def rng_state_bytes(device: DeviceSpec) -> bytes:
    """This process's generators (the CPU's and `device`'s), as a checkpoint keeps them."""
    buffer = io.BytesIO()
    state = {"cpu": torch.get_rng_state()}
    if device.is_accelerator:  # dropout and friends draw from the device's generator
        state[device.device_type] = device.module.get_rng_state(device.index)
    torch.save(state, buffer)
    return buffer.getvalue()


def restore_rng_bytes(data: bytes, device: DeviceSpec) -> None:
    state = torch.load(io.BytesIO(data), weights_only=True)
    if isinstance(state, torch.Tensor):  # written before device states were kept
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    # A checkpoint from another device kind restores the CPU generator only.
    device_state = state.get(device.device_type)
    if device.is_accelerator and device_state is not None:
        device.module.set_rng_state(device_state, device.index)
