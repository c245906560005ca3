"""In-memory copies of a rank's state, on its own actor and on a peer's (issue 19, item 3).

Every `checkpoint.memory_every_steps` steps, after the optimizer step, the rank copies its
shards into host buffers (the engine's `stage_copy`: a copy on a staging thread that the next
optimizer step waits for, as for an async save) and takes its RNG state. Those buffers are the
copy (`checkpoint/memory_files.py`: nothing is serialised, no collective): the copier rotates
`CopyStore.keep + 1` buffer sets, so the copies held (the newest `keep` steps) are never
written while a new one is staged. A background thread then keeps it in this actor's
`CopyStore`, sends it to its peer's actor (on another node where there is one) as byte arrays
that Ray moves out of band, which the peer copies into memory of its own, and reports a
`MemoryCopyReport`: which actors hold it. The driver never sees a byte. A copy still in flight
at the next boundary makes that step's copy skipped on every rank (they agree in the step's
existing all-reduce, `RankCheckpointer.agree_requested`), so every copied step has a complete
set, and the step does not wait.

A rank that resumes from copies reads each old rank's copy from its own store, or from the
actors that hold it (`read_copy` in the actor's copy concurrency group, so a holder busy in
its own set-up still answers), and DCP reshards them onto the new layout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.checkpoint.memory_files import (
    CopyReader,
    HeldCopy,
    WireLayout,
    capture_copy,
    copy_metadata,
    from_wire,
    to_wire,
)
from raytrain_dt.checkpoint.staging import ReusableStager
from raytrain_dt.engines.base import Engine
from raytrain_dt.worker.checkpointing import restore_rng_bytes, rng_state_bytes
from raytrain_dt.worker.reports import MemoryCopyReport, RankReport
from raytrain_dt.worker.spec import CopyPeer, MemoryResume

log = logging.getLogger(__name__)

# The rank actor's Ray concurrency group for holding and reading copies: these calls run on
# threads of their own, beside a set-up or a train loop.
COPY_GROUP = "memory_copies"
COPY_GROUP_THREADS = 2
# (generation, step, owner rank): one rank's copy of one step.
CopyKey = tuple[int, int, int]


class CopyStore:
    """The copies one actor holds, its own rank's and its peers', of the newest `keep`
    (generation, step) points: the newest may still be incomplete on other ranks, the one
    before is then the newest complete one. Thread-safe (copy threads put, readers get).

    A peer's copy that is let go gives its buffers to the next one received (`from_wire`'s
    `reuse`), unless it was ever handed out (`get`: a load or a reader may still view it), so
    that in steady state a copy step allocates nothing. Spares are kept for the newest
    generation's sizes only."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._copies: dict[CopyKey, HeldCopy] = {}
        self._lent: set[int] = set()  # id() of held copies handed out by `get`
        self._spares: dict[int, list] = {}  # nbytes -> flat buffers no held copy views
        self._spares_generation = -1
        # (generation, owner) -> the layout its copies were last sent with: a sender sends it
        # with its first copy to this holder only (`to_wire`'s `known`).
        self._layouts: dict[tuple[int, int], WireLayout] = {}
        self._lock = threading.Lock()

    def hold(self, key: CopyKey, wire: dict) -> None:
        """A peer's copy, as it came over the wire, copied into memory this actor owns (the
        sender's Ray object dies with the sender). Raises if it came without its layout and
        none was received from its owner in its generation (the sender then sends it again)."""
        generation, _, owner = key
        with self._lock:
            if wire["layout"] is not None:
                self._layouts[(generation, owner)] = wire["layout"]
            layout = self._layouts.get((generation, owner))
        self.put(tuple(key), from_wire(wire, reuse=self._spare, layout=layout))

    def _spare(self, nbytes: int):
        with self._lock:
            spares = self._spares.get(nbytes)
            return spares.pop() if spares else None

    def put(self, key: CopyKey, copy: HeldCopy) -> None:
        with self._lock:
            if key[0] > self._spares_generation:  # a new layout: its shards have new sizes
                self._spares, self._spares_generation = {}, key[0]
                self._layouts = {k: v for k, v in self._layouts.items() if k[0] >= key[0]}
            self._copies[key] = copy
            points = sorted({(g, s) for g, s, _ in self._copies})
            for old in points[: -self.keep]:
                for stale in [k for k in self._copies if k[:2] == old]:
                    self._let_go(self._copies.pop(stale))

    def _let_go(self, copy: HeldCopy) -> None:
        if id(copy) in self._lent:
            self._lent.discard(id(copy))
            return  # a load or a reader may still view it: its memory is freed with it
        for flat in copy.owned:
            spares = self._spares.setdefault(flat.numel(), [])
            if len(spares) < self.keep:
                spares.append(flat)

    def get(self, key: CopyKey) -> HeldCopy | None:
        with self._lock:
            copy = self._copies.get(tuple(key))
            if copy is not None:
                self._lent.add(id(copy))
            return copy

    def holds(self, key: CopyKey | None) -> bool:
        with self._lock:
            return key is not None and tuple(key) in self._copies

    def nbytes(self) -> int:
        with self._lock:
            return sum(copy.nbytes for copy in self._copies.values())


class PeerCopier:
    """One layout's copies of one rank (see the module's doc)."""

    def __init__(
        self,
        engine: Engine,
        device: DeviceSpec,
        rank: int,
        generation: int,
        actor_index: int,
        store: CopyStore,
        peer: CopyPeer | None,
        report: Callable[[RankReport], None],
        peer_timeout_s: float = 60.0,
    ):
        self.engine, self.device, self.rank = engine, device, rank
        self.generation, self.actor_index = generation, actor_index
        self.store, self.peer, self.report = store, peer, report
        self.peer_timeout_s = peer_timeout_s
        # The copies' own buffer sets (not the durable save's): the held copies and one more.
        self.stagers = [
            ReusableStager(background=True, one_allocation=True) for _ in range(store.keep + 1)
        ]
        self._staged_as: list[CopyKey | None] = [None] * len(self.stagers)
        # (the stagers' state signature, its DCP metadata): one object for every buffer set.
        self._metadata: tuple[object, object] | None = None
        self._peer_layout: WireLayout | None = None  # the layout the peer has been sent
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="memory-copy")
        self._in_flight: Future | None = None
        self._step_in_flight = -1
        self.skipped = 0  # boundaries whose copy was skipped: the previous one still in flight

    @property
    def busy(self) -> bool:
        """The last copy is still in flight: the ranks agree to skip this boundary's copy."""
        return self._in_flight is not None and not self._in_flight.done()

    def copy(self, step: int, train_state: dict | None) -> None:
        """At the step boundary after `step` (training thread): stage and hand off."""
        self.wait()  # the ranks agreed that every copy is done; a moment's wait at most
        started = time.perf_counter()
        buffers = self._free_buffers()
        self._staged_as[buffers] = (self.generation, step, self.rank)
        staged = self.engine.stage_copy(self.stagers[buffers])
        rng = rng_state_bytes(self.device)  # the generators as the next step will find them
        self._step_in_flight = step
        self._in_flight = self._executor.submit(
            self._finish, step, buffers, staged, rng, train_state, started
        )

    def _free_buffers(self) -> int:
        """A buffer set no held copy is: the store holds copies of at most `keep` steps, and
        no copy is in flight here, so one of the `keep + 1` sets is free."""
        free = [i for i, key in enumerate(self._staged_as) if not self.store.holds(key)]
        return free[0]

    def copy_now(self, step: int, train_state: dict | None) -> None:
        """A copy of `step`, held and reported before this returns (a drain's last state)."""
        if self._step_in_flight != step:
            self.wait()
            self.copy(step, train_state)
        self.wait()

    def _finish(
        self,
        step: int,
        buffers: int,
        staged: Future,
        rng: bytes,
        train_state: dict | None,
        started: float,
    ) -> None:
        try:
            state = staged.result()
            copy = capture_copy(state, self.rank, rng, self._layout_metadata(buffers, state))
            key = (self.generation, step, self.rank)
            self.store.put(key, copy)
            holders = [self.actor_index]
            if self.peer is not None and self._send(key, copy):
                holders.append(self.peer.actor_index)
            log.debug("rank %d: copy of step %d held by actors %s", self.rank, step, holders)
            self.report(
                MemoryCopyReport(
                    self.generation,
                    step,
                    self.rank,
                    tuple(holders),
                    copy.sizes(),
                    train_state,
                    time.perf_counter() - started,
                    self.skipped,
                )
            )
        except Exception:  # a failed copy costs this step's copy, never the run
            log.exception("rank %d: in-memory copy of step %d failed", self.rank, step)

    def _layout_metadata(self, buffers: int, state: dict):
        """The copy's DCP metadata, planned once per state layout: every buffer set of that
        layout shares the one object (so the peer is sent it once, see `_send`)."""
        signature = self.stagers[buffers].signature
        if self._metadata is None or self._metadata[0] != signature:
            self._metadata = (signature, copy_metadata(state, self.rank))
        return self._metadata[1]

    def _send(self, key: CopyKey, copy: HeldCopy) -> bool:
        import ray

        try:
            hold = self.peer.handle.hold_copy.options(concurrency_group=COPY_GROUP)
            wire = to_wire(copy, known=self._peer_layout)
            ray.get(hold.remote(key, wire), timeout=self.peer_timeout_s)
            self._peer_layout = wire["layout"] or self._peer_layout
            return True
        except Exception as exc:  # the peer died or is slow: the own copy still counts
            self._peer_layout = None  # whatever the peer kept, the next copy carries it again
            log.warning("rank %d: peer copy of step %d failed: %s", self.rank, key[1], exc)
            return False

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the copy in flight is held and reported; False if still in flight."""
        if self._in_flight is None:
            return True
        try:
            self._in_flight.result(timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Leave the layout: let a copy in flight finish for at most `timeout_s`."""
        self.wait(timeout_s)
        self._executor.shutdown(wait=False)


def load_from_copies(
    engine: Engine,
    device: DeviceSpec,
    rank: int,
    source: MemoryResume,
    store: CopyStore,
    actor_index: int,
    uri: str,
) -> dict[str, float]:
    """Load the state of `source` into this layout (each rank reads alone: no collective) and
    restore this rank's RNG from the old rank of the same number; bytes read per source."""
    fetched = {"local_bytes": 0.0, "peer_bytes": 0.0}

    def fetch(owner: int) -> HeldCopy:
        key = (source.generation, source.step, owner)
        copy = store.get(key)
        if copy is not None:
            fetched["local_bytes"] += copy.nbytes
            return copy
        copy = _read_from_holders(key, source.holders.get(owner, []), actor_index)
        fetched["peer_bytes"] += copy.nbytes
        return copy

    reader = CopyReader(list(range(source.owners)), fetch)
    engine.load(uri, storage_reader=reader)
    if rank < source.owners:  # as from a checkpoint: rank r takes old rank r's generators
        restore_rng_bytes(reader.rng_of(rank), device)
    return fetched


def _read_from_holders(
    key: CopyKey, holders: list[tuple[int, object]], actor_index: int
) -> HeldCopy:
    import ray

    problems = []
    for index, handle in holders:
        if index == actor_index:
            continue  # not in this actor's store (checked first)
        try:
            read = handle.read_copy.options(concurrency_group=COPY_GROUP)
            wire = ray.get(read.remote(key), timeout=60)
        except Exception as exc:
            problems.append(f"actor {index}: {type(exc).__name__}")
            continue
        if wire is not None:
            return from_wire(wire, own=False)  # read once, for this load
        problems.append(f"actor {index}: not held")
    raise RuntimeError(f"in-memory copy {key}: no holder answered ({problems})")
