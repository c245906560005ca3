"""Leaving a layout inside a rank actor: `LeavesLayouts`, the half of `RankWorker` that ends
its loop, lets a save in flight finish, aborts process groups stuck in a collective (saying
where the training thread is stuck), releases the layout (at the driver's teardown, or at once
when its loop failed) and collects it; and the per-thread DTensor caches that would tie a
reused actor to the old layout's meshes and process groups, and a failed backward's nodes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch.distributed as dist

from raytrain_dt.accel.device import (
    DeviceSpec,
    release_accelerator_memory,
    return_free_host_memory,
)
from raytrain_dt.checkpoint.write_process import release_write_arenas
from raytrain_dt.observe.phases import PhaseTimer

if TYPE_CHECKING:
    from raytrain_dt.engines.base import Engine
    from raytrain_dt.worker.checkpointing import RankCheckpointer
    from raytrain_dt.worker.input_stream import InputStream
    from raytrain_dt.worker.notices import NoticeBoard
    from raytrain_dt.worker.peer_copies import PeerCopier
    from raytrain_dt.worker.spec import RankSpec

log = logging.getLogger("raytrain_dt.rank")

# The least time an aborted collective may take to raise in the training thread and the
# thread to return before the actor is given up (the coordinator gives a step: `Deadlines.
# leave_bound`). A survivor given up takes its in-memory copies (its own and a peer's) with it,
# and a replacement costs a process start and a load: seconds; on a loaded host the abort
# alone takes over 0.2 s.
ABORTED_COLLECTIVE_GRACE_S = 2.0
# The same on gloo, whose abort releases no peer (`DeviceSpec.abort_releases_peers`): a
# collective blocked on a live peer whose own loop failed returns when that peer's old layout
# is collected after its teardown, which on a loaded host (CI's 2 cores, two runs) took over
# 2 s, and a healthy survivor was replaced. A collective blocked on a dead peer returns at
# once (its sockets closed with its process): only a stuck peer costs the whole grace.
GLOO_ABORTED_COLLECTIVE_GRACE_S = 10.0


def aborted_collective_grace_s(device: DeviceSpec | None) -> float:
    """The least time an aborted collective is given to return on this layout's device."""
    if device is not None and not device.abort_releases_peers:
        return GLOO_ABORTED_COLLECTIVE_GRACE_S
    return ABORTED_COLLECTIVE_GRACE_S


class LeavesLayouts:
    """Leaving a layout, for `RankWorker`, which sets these up (`RankWorker.__init__`) and
    builds them for each layout (`layout_join.JoinsLayouts._build`). The actor and its
    imported torch stay for the next layout."""

    spec: RankSpec | None
    actor_index: int
    engine: Engine | None
    checkpointer: RankCheckpointer | None
    notices: NoticeBoard | None
    _copier: PeerCopier | None  # with in-memory copies on
    _batches: InputStream | None
    _store: dist.Store | None  # the layout's (rank 0 serves it)
    _device: DeviceSpec | None
    _stop: threading.Event  # ends the loop, and a set-up's wait for its peers
    _training: Future | None  # the loop on the torch thread
    _setting_up: Future | None  # a set-up on the torch thread
    _torch_thread: ThreadPoolExecutor  # all of the actor's torch work, layout after layout
    _torch_thread_id: int
    _released_at_failure: bool  # the failed loop let its layout go (`teardown`)
    _layout_groups: list  # weak references to the layout's process groups (`_build`)
    _released_groups: list  # those of the layout released last, until they are collected

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._training is not None:
            wait([self._training], timeout=timeout_s)

    def teardown(
        self,
        grace_s: float = 2.0,
        keep_save: bool = True,
        return_s: float = ABORTED_COLLECTIVE_GRACE_S,
        save_grace_s: float = 5.0,
    ) -> bool:
        """Leave the current layout: end the loop (or a set-up still joining its peers), let a
        save in flight finish (for at most `save_grace_s`: its outcome stays queued for the
        coordinator's next poll, which decides whether that checkpoint commits; with
        `keep_save` False it is abandoned at once: the resume needs it not), free model
        and data, destroy the process group. The actor (and its imported torch) stays for the
        next layout. `return_s`: how long the torch thread may take to return once its
        communicators are aborted (the rest of its step: it raises at its next collective).
        Returns False when the torch thread is stuck (in a collective with a dead
        or hung peer): such an actor cannot be reused and the coordinator replaces it. An
        aborted collective is given at least `aborted_collective_grace_s` of this device.
        Runs in the control concurrency group, beside a set-up that may be waiting."""
        phases = PhaseTimer()
        self.stop(grace_s)  # `_stop` also ends a set-up's wait for its peers (`join_store`)
        phases.lap("loop")
        if self.checkpointer is not None and not keep_save:
            self.checkpointer.abandon()
        # A save runs in threads of its own, so it finishes even when the loop is stuck.
        if self.checkpointer is not None and not self.checkpointer.wait(save_grace_s):
            log.warning(
                "rank %s: a checkpoint save still in flight after %.0fs",
                self.spec.rank if self.spec else "?",
                save_grace_s,
            )
        phases.lap("save")
        if self._setting_up is not None and not self._setting_up.done():
            # Told to leave (`_stop`), a set-up still joining returns within a poll of its
            # join; the loop was given its grace by `stop`.
            wait([self._setting_up], timeout=grace_s)
        busy = [f for f in (self._training, self._setting_up) if f is not None and not f.done()]
        if busy:
            # Blocked in a collective with a dead or hung peer: abort the communicators (NCCL's
            # ncclCommAbort; the emulated backend's equivalent), which makes the collective
            # raise in the torch thread, as torchft does, and wait for the thread once more.
            where = where_thread_is(self._torch_thread_id)
            abort_process_groups()
            return_s = max(return_s, aborted_collective_grace_s(self._device))
            wait(busy, timeout=return_s)
            if any(not f.done() for f in busy):
                log.warning(
                    "rank %s: torch thread still busy %.1fs after aborting its "
                    "groups; not reusable. It is at:\n%s",
                    self.spec.rank if self.spec else "?",
                    return_s,
                    where,
                )
                return False
            log.info(
                "rank %s: aborted its process groups; the torch thread returned from:\n%s",
                self.spec.rank if self.spec else "?",
                where,
            )
        phases.lap("set-up and abort")
        if self.notices is not None:
            self.notices.release_sigterm()
        if not self._released_at_failure:
            self._torch_thread.submit(self._release_layout).result()
        phases.lap("release")
        log.info(
            "rank %s left its layout in %s",
            self.spec.rank if self.spec else "?",
            phases.describe(),
        )
        # It takes 0.1-0.3 s, so it runs after this call has answered, while the coordinator
        # re-plans and forms; the next set-up runs on the same thread after it, so the old
        # state is gone before the new one is built.
        if not self._released_at_failure:
            self._torch_thread.submit(self._free_old_layout)
        self._released_at_failure = False
        return True

    def park(self) -> bool:
        """Kept warm for the driver's next run (`RankGroup.shutdown`), after `teardown`: give
        the heap's freed pages back to the OS, so an actor waiting for a run does not hold its
        last model's memory. On the torch thread, after the old layout is freed."""
        return self._torch_thread.submit(return_free_host_memory).result()

    def _let_go_of_failed_layout(self) -> None:
        """A failed rank's layout is dead (its groups aborted), so it is released and collected
        now, not at the driver's teardown: a peer blocked with this rank in a gloo sub-group
        is released only when the group's last reference is gone, and the mesh holds its
        groups, while FSDP's state (in reference cycles) and every staged DTensor hold the
        mesh. In bench_elastic's rank death the blocked survivor failed 1.0 s after the dead
        rank, at the end of its peers' teardown; now at the end of their collection (0.2-0.4 s
        after on a quiet host, 0.6-0.8 s in the whole bench).

        Not while a save or an in-memory copy is in flight: it holds staged state (and so the
        mesh) itself, and its outcome must be reported before the coordinator picks what to
        resume from (`teardown` waits for it)."""
        copying = self._copier is not None and self._copier.busy
        saving = self.checkpointer is not None and not self.checkpointer.wait(0)
        if copying or saving:
            return
        started = time.perf_counter()
        self._release_layout()
        self._released_at_failure = True
        log.info(
            "rank %s let its failed layout go in %.3fs",
            self.spec.rank if self.spec else "?",
            time.perf_counter() - started,
        )
        # Next on this thread, after `_run` has returned: a teardown waiting for the loop to
        # end answers at once, and the driver re-plans meanwhile; the next set-up follows it.
        self._torch_thread.submit(self._free_old_layout)

    def _release_layout(self) -> None:
        if self._copier is not None:
            self._copier.close()  # a copy in flight is held and reported first
            self._copier = None
        self.engine = None
        self.checkpointer = None
        if self._batches is not None:
            self._batches.close()  # a pipeline still starting would go on for nobody
        self._batches = None
        self._setting_up = None
        # An abort has already dropped every group from torch's registry: those `_build` saw.
        self._released_groups = [*self._layout_groups, *layout_process_groups()]
        self._layout_groups = []
        if dist.is_initialized():  # not after an abort, which has already dropped every group
            dist.destroy_process_group()
        self._store = None  # rank 0's server closes with it
        forget_layout_caches()
        forget_failed_backward()

    def _free_old_layout(self) -> None:
        """The old layout's model and optimizer sit in reference cycles (modules and their
        hooks): a full collection frees them. Then hand the accelerator's cached blocks back
        and restart the peak statistic, so the next layout (or run: a warm actor) measures its
        own. The host heap keeps its freed pages: the next layout, built at once, reuses them
        instead of faulting in fresh ones (`park` returns them when no layout follows)."""
        started = time.perf_counter()
        groups, self._released_groups = self._released_groups, []
        freed, passes = collect_until_released(groups)
        log.info(
            "actor %d: old layout collected in %.3fs (%d objects, %d passes)",
            self.actor_index,
            time.perf_counter() - started,
            freed,
            passes,
        )
        release_write_arenas()  # the writer process's mappings of the old staging arena
        if self._device is not None:
            release_accelerator_memory(self._device)


# A collection frees what the one before it let go, so a layout's groups take two at most
# (measured); the passes stay bounded whatever holds them.
MAX_COLLECTIONS = 4


def layout_process_groups() -> list[weakref.ref]:
    """Weak references to every process group this process has registered (a layout's: its
    default group, its mesh's and its checkpointer's)."""
    if not dist.is_initialized():
        return []
    return [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map]


def collect_until_released(groups: list[weakref.ref]) -> tuple[int, int]:
    """Full collections until the released layout's process `groups` are gone (at most
    `MAX_COLLECTIONS`; one where none are known): the objects freed, and the passes. One is
    not always enough: after a failed expert-parallel backward, the meshes (a cycle, the root
    mesh and its slices) are held from C++ by what the failed graph left, which the first
    collection frees; they become garbage only then, and with them the groups, on which a
    peer blocked in a gloo collective waits until they are gone
    (tests/distributed/test_layout_release.py, moe). Collecting until a pass found nothing
    took 3-4 passes where 1 or 2 free the groups, on the path that releases blocked peers."""
    freed = passes = 0
    while passes < MAX_COLLECTIONS:
        freed, passes = freed + gc.collect(), passes + 1
        if not any(ref() is not None for ref in groups):
            break
    return freed, passes


def abort_process_groups() -> None:
    """Abort every process group of this process. On NCCL this is
    ncclCommAbort on each communicator; gloo cannot be interrupted (a gloo-only rank blocked on
    a hung peer stays blocked until `comm.timeout_s`), and its abort closes no connection
    itself: a group's close when the group is destroyed (the default group's at once, the abort
    dropping the last reference to it; a device mesh's sub-groups' when the layout is collected).
    """
    if not dist.is_initialized():
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # an abort must never fail a teardown
        log.exception("aborting the process groups failed")


def where_thread_is(thread_id: int, depth: int = 6) -> str:
    frame = sys._current_frames().get(thread_id)
    return "".join(traceback.format_stack(frame)[-depth:]) if frame else "(gone)"


def forget_failed_backward() -> None:
    """A backward that raised (a collective failing in FSDP's post-backward hook, as when a
    peer is lost) leaves the nodes it had not run in this thread's autograd ready queue, a
    thread-local of torch's engine that outlives the backward. Those nodes hold FSDP's param
    groups, and through them the mesh and its process groups: on gloo a peer blocked in a
    collective with this rank stays blocked until the groups are gone. (A candidate cause of a
    gate's survivor that waited 10 s in a reduce-scatter with a rank whose layout had been
    released and collected, and was replaced; on a host overloaded by other work, and not
    reproduced.) Running any backward on the thread drops every node of a finished graph left
    in its queue (tests/unit/test_failed_backward.py). On the actor's torch thread, the one
    that trained."""
    import torch

    with torch.enable_grad():
        torch.zeros(1, requires_grad=True).sum().backward()


def forget_layout_caches() -> None:
    """DTensor caches sharding and redistribution plans keyed by mesh *shape and names*, and
    the cached results hold the old mesh, whose process-group names the next layout's groups
    reuse. A reused actor must drop them all, or its collectives resolve to the wrong (or no)
    group ("Could not resolve the process group registered under the name N").

    These caches (and the C++ dispatch fast path's) are per thread: this runs on the actor's
    torch thread, the one that ran every DTensor op of the layout."""

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_fast_path_sharding_prop_cache

    _clear_fast_path_sharding_prop_cache()
    # Redistribution planners are kept in a dict keyed by a weak reference to their mesh, but
    # each planner holds the mesh itself: without this the old meshes, and through them the
    # old layout's process groups (open connections and threads), lived on after teardown.
    clear_redistribute_planner_cache()

    propagator = DTensor._op_dispatcher.sharding_propagator
    clears = _cache_clears(
        [propagator.propagate_op_sharding, propagator._propagate_tensor_meta_cached]
    )
    clears.extend(find_layout_caches())
    for clear in clears:
        with contextlib.suppress(TypeError):  # a per-instance cache seen on its class
            clear()


def find_layout_caches() -> list:
    """The `cache_clear` of every cached function in DTensor's modules, read once per module
    (`_MODULE_CLEARS`). A new actor calls it at its start, before it freezes the garbage
    collector's view, so its first release only clears. Only reads: with the clears called
    then too (`forget_layout_caches`, whose fast-path and redistribute-planner clears alone
    did it), four of a failed layout's groups outlived its release and collection
    (tests/distributed/test_layout_release.py, the backward failure); read only, none did."""
    clears = []
    for name, module in _snapshot(sys.modules):
        if name.startswith("torch.distributed.tensor") and module is not None:
            clears.extend(_module_cache_clears(name, module))
    return clears


# Per DTensor module: how many names it had when read, and the `cache_clear`s found in it.
# Reading every module's names and its classes' attributes took 5 ms on an idle process and
# 0.07-0.14 s in a failed rank's release on a busy host (other threads holding the GIL), on the
# path that frees the rank's process groups for its blocked peers; a module is read again
# only when its names change (a lazy import adds to its package).
_MODULE_CLEARS: dict[str, tuple[int, list]] = {}


def _module_cache_clears(name: str, module) -> list:
    names = _snapshot(vars(module))
    known = _MODULE_CLEARS.get(name)
    if known is None or known[0] != len(names):
        values = []
        for _, value in names:
            values.append(value)
            if isinstance(value, type):  # cached static methods, e.g. MeshTopoInfo's
                values.extend(getattr(value, attr, None) for attr, _ in _snapshot(vars(value)))
        known = _MODULE_CLEARS[name] = (len(names), _cache_clears(values))
    return known[1]


def _cache_clears(values: list) -> list:
    """The `cache_clear` of each cached function among `values` (functools' caches and
    DTensor's `LocalLRUCache`)."""
    clears = []
    for value in values:
        clear = getattr(value, "cache_clear", None)
        if callable(clear) and not isinstance(value, type):
            clears.append(clear)
    return clears


def _snapshot(mapping, attempts: int = 100) -> list[tuple]:
    """The items of a dict that other threads of the actor may change meanwhile: the data
    pipeline's start imports modules (adding to `sys.modules` and to their packages' dicts)
    while a teardown runs, and even a C-level copy can be interrupted by a garbage collection
    whose finalisers let that thread run ("dictionary changed size during iteration", which
    failed a survivor's teardown and had it replaced). A changed dict is read again."""
    for _ in range(attempts - 1):
        with contextlib.suppress(RuntimeError):
            return list(mapping.items())
    return list(mapping.items())
