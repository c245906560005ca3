"""DCP's cached save plans (`checkpoint/storage.py: save_planner`) across two formations of one
layout in the same processes, the second with a coordinator that has cached nothing (a fresh
actor): every formation plans its first save afresh, then reuses its own plans, and each save
reloads equal to the state it saved."""

from __future__ import annotations

import dataclasses
import traceback

import pytest
from harness import join_served_group, rank_process_context, settle_rank_process

WORLD = 2


def _engine(layout):
    from raytrain_dt.accel.device import select_device
    from raytrain_dt.config.schema import TrainConfig
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.fsdp2 import FSDP2Engine
    from raytrain_dt.models.model_spec import llama_spec
    from raytrain_dt.models.presets import ModelShape
    from raytrain_dt.parallel.device_mesh import build_mesh

    shape = ModelShape(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=64, ffn_hidden=64)
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=8))
    device = select_device("fp32", "cpu")
    mesh = build_mesh(layout.dims, device.device_type)
    return FSDP2Engine(EngineBuild(llama_spec(shape), cfg, layout, mesh, device))


def _rank(rank: int, port: int, root: str, errors) -> None:
    try:
        settle_rank_process()
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.planner import SavePlanner

        from raytrain_dt.topology.layout import Layout
        from raytrain_dt.topology.parallel_dims import ParallelDims

        join_served_group(rank, WORLD, port, timeout_s=60)
        layout = Layout(ParallelDims(world_size=WORLD, dp_shard=WORLD), 3, 1, 1)
        tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(rank))
        step = 0
        for formation in range(2):
            engine = _engine(layout)
            if formation == 1 and rank == 0:
                # The new formation's coordinator is a fresh actor: it has cached nothing.
                for name in ("_cached_all_plans", "_cached_global_plan", "_cached_metadata"):
                    getattr(SavePlanner, name).clear()
            for save in range(2):
                engine.train_step([tokens], step)
                step += 1
                path = f"{root}/f{formation}_s{save}"
                engine.save(path)
                saved = engine.full_state_dict()
                engine.train_step([tokens], step)  # the state moves on, then comes back
                step += 1
                engine.load(path)
                loaded = engine.full_state_dict()
                for key, value in saved.items():
                    assert torch.equal(loaded[key], value), (formation, save, key)
            del engine
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def test_a_new_formation_plans_its_saves_afresh(tmp_path):
    from raytrain_dt.worker.rendezvous import serve_store

    store = serve_store("127.0.0.1")
    ctx = rank_process_context()
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, store.port, str(tmp_path), errors)) for r in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, "\n".join(failures)
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    if any(proc.is_alive() for proc in procs):
        pytest.fail("a rank hung")
