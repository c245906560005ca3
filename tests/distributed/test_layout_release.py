"""A reused rank actor frees its layout's process groups when it leaves the layout (no Ray).

Two spawned processes each make a `RankWorker`, and on its torch thread, as the actor does,
build the FSDP2 engine over a dp_shard=2 x dp_replicate=1 mesh, train one step, then run the
actor's own `_release_layout`. Every group the mesh created must then be gone: a group kept alive
keeps its gloo connections open, so a peer blocked in a collective with a failed rank waits out
the collective timeout instead of failing at once, and every re-formation leaks sockets and
threads (DTensor's redistribute-planner cache held the meshes until `forget_layout_caches`
cleared it). And a rank still mid-step when told to leave is kept when given its step to
return, not given up as stuck after a fixed grace.
"""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp
from harness import settle_rank_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, cfg, run_dir: str, out) -> None:
    settle_rank_process()
    try:
        out.put(_release_after_a_step(rank, port, cfg, run_dir))
    except BaseException:
        import traceback

        out.put((rank, traceback.format_exc()))


def _release_after_a_step(rank: int, port: int, cfg, run_dir: str) -> tuple[int, int, int]:
    import datetime
    import weakref

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from raytrain_dt.accel.device import select_device
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.factory import build_engine
    from raytrain_dt.models.model_spec import model_spec
    from raytrain_dt.parallel.device_mesh import build_mesh
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims
    from raytrain_dt.worker.rank_actor import RankWorker

    worker = RankWorker(run_dir, rank)
    layout = Layout(ParallelDims(world_size=2, dp_shard=2), 3, 2, 1)

    def build_and_step() -> list:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        mesh = build_mesh(layout.dims, "cpu")
        worker.engine = build_engine(
            EngineBuild(model_spec(cfg), cfg, layout, mesh, select_device("fp32"))
        )
        tokens = torch.randint(0, 256, (2, cfg.data.seq_len))  # any ids the vocabulary has
        worker.engine.train_step([tokens], 0, [torch.ones(2, dtype=torch.bool)])
        default = c10d._get_default_group()
        return [weakref.ref(pg) for pg in c10d._world.pg_map if pg is not default]

    groups = worker._torch_thread.submit(build_and_step).result()
    worker._torch_thread.submit(worker._release_layout).result()
    # `teardown` queues the collection on the torch thread after answering (as here).
    worker._torch_thread.submit(worker._free_old_layout).result()
    return rank, len(groups), sum(ref() is not None for ref in groups)


@pytest.mark.timeout(180)
def test_release_frees_the_layouts_process_groups(token_data, tmp_path):
    from conftest import REPO

    from raytrain_dt.config import load_config

    cfg = load_config(
        REPO / "conf" / "test.yaml",
        [f"data.path={token_data}", f"run.dir={tmp_path}", "model.n_layers=2"],
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, cfg, str(tmp_path), out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=150) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    errors = [r for r in results if len(r) == 2]
    assert not errors, errors
    for rank, created, alive in results:
        assert created >= 3, (rank, created)  # the mesh's dimension and flattened groups
        assert alive == 0, f"rank {rank}: {alive} of {created} process groups outlived teardown"


STEP_S = 5.0  # a step still computing when its rank is told to leave (well past the floor)


def _leave_mid_step(run_dir: str, out) -> None:
    settle_rank_process()
    try:
        import time

        import torch

        from raytrain_dt.accel.device import DeviceSpec
        from raytrain_dt.worker.rank_actor import (
            ABORTED_COLLECTIVE_GRACE_S,
            GLOO_ABORTED_COLLECTIVE_GRACE_S,
            RankWorker,
        )

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
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_leave_mid_step, args=(str(tmp_path), out))
    proc.start()
    answers = out.get(timeout=100)
    proc.join(timeout=30)
    assert answers == [False, True, True], answers
