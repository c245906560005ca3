"""A reused rank actor frees its layout's process groups when it leaves the layout (no Ray).

Two spawned processes each make a `RankWorker`, and on its torch thread, as the actor does,
build the FSDP2 engine over a dp_shard=2 x dp_replicate=1 mesh and train one step. Then rank
0's loop fails (its input raises) while rank 1 waits in a collective with it on one of the
mesh's groups, as a survivor of a rank death does. Every group the mesh created must be gone
on both: on rank 0 as soon as its loop has failed, with no teardown (the driver's comes later),
and on rank 1 after the actor's own `_release_layout` and collection. A group kept alive keeps
its gloo connections open: a peer blocked in a collective with a failed rank waits until that
rank's teardown (or the collective timeout) instead of failing at once, and every
re-formation leaks sockets and threads (DTensor's redistribute-planner cache held the meshes
until `forget_layout_caches` cleared it). And a rank still mid-step when told to leave is kept
when given its step to return, not given up as stuck after a fixed grace.
"""

from __future__ import annotations

import pytest
from harness import join_served_group, rank_process_context, settle_rank_process

# The layout's collective timeout: rank 1's wait ends by then even if rank 0 holds its groups.
PG_TIMEOUT_S = 30


def _rank(
    rank: int, port: int, cfg, run_dir: str, out, peer_waiting, peer_returned, fails_in: str
) -> None:
    settle_rank_process()
    try:
        leave = _leave_after_a_step if fails_in == "input" else _fail_in_backward
        out.put(leave(rank, port, cfg, run_dir, peer_waiting, peer_returned))
    except BaseException:
        import traceback

        out.put((rank, traceback.format_exc()))


def _worker(rank: int, run_dir: str):
    from raytrain_dt.accel.device import select_device
    from raytrain_dt.worker.rank_actor import RankWorker

    return RankWorker(run_dir, rank), select_device("fp32")


def _build_and_step(worker, device, rank: int, port: int, cfg) -> tuple[list, object]:
    """On the worker's torch thread, as the actor does: the process group, the mesh, the
    engine and checkpointer, one step trained together; weak references to every group the
    layout made, and the mesh's dp_shard group."""
    import weakref

    import torch
    import torch.distributed.distributed_c10d as c10d

    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.factory import build_engine
    from raytrain_dt.models.model_spec import model_spec
    from raytrain_dt.parallel.device_mesh import build_mesh
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims
    from raytrain_dt.worker.checkpointing import RankCheckpointer, side_groups
    from raytrain_dt.worker.layout_release import layout_process_groups

    # ZeRO-3, micro-batch 2; an MoE model's experts split over both ranks where ep is set
    layout = Layout(ParallelDims(world_size=2, dp_shard=2, ep=cfg.parallel.ep or 1), 3, 2, 1)
    join_served_group(rank, 2, port, PG_TIMEOUT_S)
    mesh = build_mesh(layout.dims, "cpu")
    worker.engine = build_engine(EngineBuild(model_spec(cfg), cfg, layout, mesh, device))
    worker._device = device
    worker.checkpointer = RankCheckpointer(
        worker.engine, rank, lambda _: None, False, device, groups=side_groups()
    )
    worker.engine.train_step([_tokens(cfg)], 0, [torch.ones(2, dtype=torch.bool)])
    worker._layout_groups = layout_process_groups()  # as `RankWorker._build` ends
    default = c10d._get_default_group()
    groups = [weakref.ref(pg) for pg in c10d._world.pg_map if pg is not default]
    return groups, mesh["dp_shard"].get_group()


def _tokens(cfg):
    import torch

    return torch.randint(0, 256, (2, cfg.data.seq_len))  # any ids the vocabulary has


def _fail_in_backward(rank: int, port: int, cfg, run_dir: str, peer_waiting, peer_returned):
    """Both ranks train a step in their loops; on rank 0 the second reduce-scatter of its
    backward fails (as one with a lost peer does) while rank 1 waits for rank 0 in it."""
    import time

    import torch
    import torch.distributed as dist

    from raytrain_dt.worker.train_loop import LoopSpec

    worker, device = _worker(rank, run_dir)
    groups, shard_group = worker._torch_thread.submit(
        _build_and_step, worker, device, rank, port, cfg
    ).result()
    del shard_group
    batch = {"tokens": _tokens(cfg), "real": torch.ones(2, dtype=torch.bool)}
    worker._batches = (b for b in [batch])  # closable, as the actor's input stream is
    worker._chaos = lambda step: None
    if rank == 0:
        reduce_scatter, calls = dist.reduce_scatter_single, []

        def lost_peer(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("Connection reset by peer (injected)")
            return reduce_scatter(*args, **kwargs)

        dist.reduce_scatter_single = lost_peer
    loop = LoopSpec(0, 1, 0, 2, 1, cfg.data.seq_len, 0, False, False)
    started = time.perf_counter()
    worker._torch_thread.submit(worker._run, loop).result()
    loop_s = time.perf_counter() - started
    worker._torch_thread.submit(lambda: None).result()  # the collection `_run` queued
    alive = sum(ref() is not None for ref in groups)
    error = (worker._error or "").strip().splitlines()[-1]
    if rank == 0:
        # Alive until the peer has returned: only what the failed loop let go may have
        # closed its connections.
        returned = peer_returned.wait(PG_TIMEOUT_S + 30)
        return {"rank": 0, "alive": alive, "error": error, "peer_returned": returned}
    peer_returned.set()
    return {"rank": 1, "alive": alive, "error": error, "loop_s": loop_s}


def _leave_after_a_step(
    rank: int, port: int, cfg, run_dir: str, peer_waiting, peer_returned
) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from raytrain_dt.worker.train_loop import LoopSpec

    worker, device = _worker(rank, run_dir)
    groups, shard_group = worker._torch_thread.submit(
        _build_and_step, worker, device, rank, port, cfg
    ).result()
    if rank == 0:

        def input_lost():
            raise OSError("input shard unreadable")
            yield

        worker._batches = input_lost()
        worker._chaos = lambda step: None
        # Rank 1 is about to wait in its collective: the loop fails once it is in it.
        assert peer_waiting.wait(PG_TIMEOUT_S), "rank 1 never reached its collective"
        time.sleep(0.5)
        loop = LoopSpec(0, 1, 0, 2, 1, cfg.data.seq_len, 0, False, False)
        del shard_group
        worker._torch_thread.submit(worker._run, loop).result()
        worker._torch_thread.submit(lambda: None).result()  # the collection `_run` queued
        alive = sum(ref() is not None for ref in groups)
        # This process, and the worker with whatever it still holds, live until the peer has
        # returned: only what the failed loop let go may have closed its connections.
        returned = peer_returned.wait(PG_TIMEOUT_S + 30)
        return {
            "rank": 0,
            "created": len(groups),
            "alive": alive,
            "peer_returned": returned,
            "failed": worker._error is not None,
        }
    peer_waiting.set()
    started = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(4), group=shard_group)
        error = "returned"
    except Exception as exc:
        error = str(exc).splitlines()[0]
    waited_s = time.perf_counter() - started
    peer_returned.set()
    del shard_group
    worker._torch_thread.submit(worker._release_layout).result()
    # `teardown` queues the collection on the torch thread after answering (as here).
    worker._torch_thread.submit(worker._free_old_layout).result()
    alive = sum(ref() is not None for ref in groups)
    return {"rank": 1, "created": len(groups), "alive": alive, "waited_s": waited_s, "error": error}


def _two_ranks(
    fails_in: str, token_data, tmp_path, model: tuple[str, ...] = ("model.n_layers=2",)
) -> tuple[dict, dict]:
    """The failed rank's result and its peer's, `fails_in` "input" or "backward"; `model`:
    the config's overrides for the model and its layout."""
    from conftest import REPO

    from raytrain_dt.config import load_config

    cfg = load_config(
        REPO / "conf" / "test.yaml",
        [f"data.path={token_data}", f"run.dir={tmp_path}", *model],
    )
    ctx = rank_process_context()
    out = ctx.Queue()
    peer_waiting, peer_returned = ctx.Event(), ctx.Event()
    from raytrain_dt.worker.rendezvous import serve_store

    store = serve_store("127.0.0.1")
    args = (store.port, cfg, str(tmp_path), out, peer_waiting, peer_returned, fails_in)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=150) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    errors = [r for r in results if isinstance(r, tuple)]
    assert not errors, errors
    failed, peer = sorted(results, key=lambda r: r["rank"])
    return failed, peer


@pytest.mark.timeout(180)
def test_a_failed_loop_frees_its_groups_and_releases_a_blocked_peer(token_data, tmp_path):
    failed, peer = _two_ranks("input", token_data, tmp_path)
    for result in (failed, peer):
        # The mesh's dimension and flattened groups, and the checkpointer's two.
        assert result["created"] >= 5, result
        assert result["alive"] == 0, (
            f"{result['alive']} process groups outlived the layout: {result}"
        )
    assert failed["failed"] and failed["peer_returned"], failed
    # Released by the failed rank's own collection (its connection closed), not by the
    # collective's timeout, which holding the groups until a teardown would have come to.
    assert peer["error"] != "returned" and "Timed out" not in peer["error"], peer
    assert peer["waited_s"] < PG_TIMEOUT_S / 2, peer


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "model",
    [
        pytest.param(("model.n_layers=2",), id="dense"),
        # The expert-parallel layout of a CI failure: a survivor blocked on its failed peer
        # waited out the 10 s grace and was replaced, and the run re-formed on one rank. The
        # failed graph held the meshes from C++ until the first collection, so a second one
        # was needed (`collect_until_nothing_is_freed`); without it the peer waited for the
        # collective's time-out.
        pytest.param(
            ("model.preset=moe-tiny", "model.capacity_factor=1.0", "parallel.ep=2"), id="moe-ep2"
        ),
    ],
)
def test_a_loop_failed_in_backward_releases_the_peer_in_its_reduce_scatter(
    model, token_data, tmp_path
):
    """As after a node loss in a gate: a rank's backward fails in a reduce-scatter (raised by
    gloo from inside FSDP's post-backward hook) while its peer waits for it in the next one.
    The failed rank's layout is let go all the same, so the peer's wait fails at once.
    (What a failed backward leaves in its thread's autograd queue, which the release drops,
    is tested in tests/unit/test_failed_backward.py; the dense two-layer model leaves no
    group held there.)"""
    failed, peer = _two_ranks("backward", token_data, tmp_path, model)
    assert failed["error"] == "RuntimeError: Connection reset by peer (injected)", failed
    assert failed["alive"] == 0 and failed["peer_returned"], failed
    # The peer's loop failed at once, its connection to the failed rank closed; not at the
    # collective's timeout.
    assert "Timed out" not in peer["error"] and peer["loop_s"] < PG_TIMEOUT_S / 2, peer
    assert peer["alive"] == 0, peer


STEP_S = 5.0  # a step still computing when its rank is told to leave (well past the floor)


def _leave_mid_step(run_dir: str, out) -> None:
    settle_rank_process()
    try:
        import time

        import torch

        from raytrain_dt.accel.device import DeviceSpec
        from raytrain_dt.worker.layout_release import (
            ABORTED_COLLECTIVE_GRACE_S,
            GLOO_ABORTED_COLLECTIVE_GRACE_S,
        )
        from raytrain_dt.worker.rank_actor import RankWorker

        # A slow wake-up stays within each bound.
        assert ABORTED_COLLECTIVE_GRACE_S + 2.5 < STEP_S < GLOO_ABORTED_COLLECTIVE_GRACE_S - 2.5
        worker = RankWorker(run_dir, 0)
        worker._torch_thread.submit(lambda: None).result()  # its lazy imports done
        gloo = DeviceSpec("cpu", "gloo", torch.float32, torch.float32)
        answers = []
        # The floor alone; a measured step; the floor on gloo, whose abort releases no peer.
        for device, return_s in ((None, 0.0), (None, 2 * STEP_S), (gloo, 0.0)):
            worker._device = device
            worker._training = worker._torch_thread.submit(time.sleep, STEP_S)
            answers.append(worker.teardown(grace_s=0.2, return_s=return_s))
            worker._training.result()  # a step given up on still ends; the next case starts idle
            worker._stop.clear()
        out.put(answers)
    except BaseException:
        import traceback

        out.put(traceback.format_exc())


@pytest.mark.timeout(120)
def test_a_rank_mid_step_is_kept_when_its_step_is_given(tmp_path):
    """`RankWorker.teardown` gives a loop still running after `grace_s` (aborted: no process
    group here) `return_s` to return: a rank whose step runs 5 s is given up as stuck with the
    2 s floor alone, and kept (its actor reusable) when given the measured step, as the
    coordinator gives it (`Deadlines.leave_bound`), or on gloo, whose abort releases no peer
    (a peer's collection does, seconds later on a loaded host). In a process of its own: the actor
    installs a SIGTERM route and a log handler."""
    ctx = rank_process_context()
    out = ctx.Queue()
    proc = ctx.Process(target=_leave_mid_step, args=(str(tmp_path), out))
    proc.start()
    answers = out.get(timeout=100)
    proc.join(timeout=30)
    assert answers == [False, True, True], answers
