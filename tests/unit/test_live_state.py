"""The copies' live state dicts (`engines/live_state.py`, used by `FSDP2Engine.stage_copy`)
equal torch's `get_state_dict` after every step, the scheduled lr included, and after a load
that replaced the optimizer's state; the staged copy of every step holds that step's values,
through the stager's reuse of its buffer pairs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raytrain_dt.accel.device import select_device
from raytrain_dt.checkpoint.staging import ReusableStager
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.engines.base import EngineBuild
from raytrain_dt.engines.fsdp2 import FSDP2Engine
from raytrain_dt.engines.live_state import LiveStateDicts, holds_the_parameters
from raytrain_dt.models.model_spec import llama_spec
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.parallel.device_mesh import build_mesh
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.parallel_dims import ParallelDims

SHAPE = ModelShape(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=64, ffn_hidden=64)
SEQ_LEN = 8


@pytest.fixture
def engine(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        cfg = TrainConfig()
        cfg = dataclasses.replace(
            cfg,
            data=dataclasses.replace(cfg.data, seq_len=SEQ_LEN),
            trainer=dataclasses.replace(cfg.trainer, warmup_steps=4),
        )
        device = select_device("fp32", "cpu")
        layout = Layout(ParallelDims(world_size=1, dp_shard=1), 3, 1, 1)
        mesh = build_mesh(layout.dims, device.device_type)
        yield FSDP2Engine(EngineBuild(llama_spec(SHAPE), cfg, layout, mesh, device))
    finally:
        dist.destroy_process_group()


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _assert_same(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys()
    for key, expected in reference.items():
        if isinstance(expected, torch.Tensor):
            assert torch.equal(_local(ours[key]), _local(expected)), key
        else:
            assert ours[key] == expected, key


def test_live_state_dicts_equal_get_state_dict_after_every_step(engine):
    generator = torch.Generator().manual_seed(0)
    engine.train_step([torch.randint(0, SHAPE.vocab_size, (1, SEQ_LEN), generator=generator)], 0)
    live = LiveStateDicts(engine.model, engine.optimizer, engine._state_dicts)
    assert live._sources, "every plain value placed: no fallback to get_state_dict"
    stager = ReusableStager(background=True, one_allocation=True)
    lrs = []
    for step in range(1, 4):
        if step == 2:  # a load replaces every optimizer state tensor: the dicts follow
            engine.optimizer.load_state_dict(engine.optimizer.state_dict())
        tokens = torch.randint(0, SHAPE.vocab_size, (1, SEQ_LEN), generator=generator)
        engine.train_step([tokens], step)
        model_sd, optim_sd = live()
        fresh_model, fresh_optim = engine._state_dicts()
        _assert_same(model_sd, fresh_model)
        _assert_same(optim_sd, fresh_optim)
        lrs.append(next(v for k, v in optim_sd.items() if k.endswith(".lr")))
        staged = engine.stage_copy(stager).result()
        _assert_same(staged["model"], fresh_model)
        _assert_same(staged["optim"], fresh_optim)
    assert len(set(lrs)) == 3, f"the schedule moved the lr each step: {lrs}"
    stager.close()


def test_a_load_in_place_restores_the_parameters_without_copying_them_again(engine, tmp_path):
    """`FSDP2Engine.load` reads into the sharded state dict's DTensors, which share the
    parameters' storage, so it skips loading the model a second time (`holds_the_parameters`)
    and loads only the optimizer: the parameters and optimizer state still return exactly to
    the saved ones. A state dict of copies is not taken for the parameters."""
    generator = torch.Generator().manual_seed(0)
    engine.train_step([torch.randint(0, SHAPE.vocab_size, (1, SEQ_LEN), generator=generator)], 0)
    model_sd, optim_sd = engine._state_dicts()
    assert holds_the_parameters(engine.model, model_sd)
    assert not holds_the_parameters(engine.model, {k: v.clone() for k, v in model_sd.items()})
    saved = {
        "model": {k: _local(v).clone() for k, v in model_sd.items()},
        "optim": {
            k: _local(v).clone() if isinstance(v, torch.Tensor) else v for k, v in optim_sd.items()
        },
    }
    engine.save(str(tmp_path / "ckpt"))
    engine.train_step([torch.randint(0, SHAPE.vocab_size, (1, SEQ_LEN), generator=generator)], 1)
    moved = engine._state_dicts()[0]
    assert any(not torch.equal(_local(moved[k]), v) for k, v in saved["model"].items())
    engine.load(str(tmp_path / "ckpt"))
    model_sd, optim_sd = engine._state_dicts()
    _assert_same(model_sd, saved["model"])
    _assert_same(optim_sd, saved["optim"])
