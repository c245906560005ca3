"""Leaving a layout inside a rank actor: abort process groups stuck in a collective, say where
the training thread is stuck, and drop the per-thread DTensor caches that would tie a reused
actor to the old layout's meshes and process groups (`RankWorker.teardown`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback

import torch.distributed as dist

log = logging.getLogger("raytrain_dt.rank")


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
    caches = [propagator.propagate_op_sharding, propagator._propagate_tensor_meta_cached]
    for name, module in _snapshot(sys.modules):
        if name.startswith("torch.distributed.tensor") and module is not None:
            for _, value in _snapshot(vars(module)):
                caches.append(value)
                if isinstance(value, type):  # cached static methods, e.g. MeshTopoInfo's
                    caches.extend(getattr(value, attr, None) for attr, _ in _snapshot(vars(value)))
    for cached in caches:
        clear = getattr(cached, "cache_clear", None)
        if callable(clear) and not isinstance(cached, type):
            with contextlib.suppress(TypeError):  # a per-instance cache seen on its class
                clear()


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
