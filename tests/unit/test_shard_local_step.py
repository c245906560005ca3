"""The FSDP2 engine's optimizer step and gradient clipping on local shards (`ShardLocalAdamW` in
engines/optim.py, `clip_gradients` in engines/grad_norm.py) against torch's own AdamW and
clipping run on the same DTensors, in one process: identical parameters and state after several
steps, the step hooks once per step, the state created without a step. The sums across ranks
are checked end to end, in every layout, by tests/distributed/test_engine_matrix.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from raytrain_dt.accel.device import select_device
from raytrain_dt.engines.grad_norm import clip_gradients
from raytrain_dt.engines.optim import ShardLocalAdamW

SHAPES = [(8, 4), (4,), (6, 3)]


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _params(mesh, placements) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [
        nn.Parameter(distribute_tensor(torch.randn(shape, generator=generator), mesh, [p]))
        for shape, p in zip(SHAPES, placements, strict=True)
    ]


def _groups(params: list[nn.Parameter]) -> list[dict]:
    return [
        {"params": [params[0], params[2]], "weight_decay": 0.1},
        {"params": [params[1]], "weight_decay": 0.0},
    ]


def _set_grads(params, grads, mesh, placement) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = DTensor.from_local(grad.clone(), mesh, [placement], run_check=False)


def _sharding_propagations() -> tuple[int, int]:
    """DTensor's sharding-propagation lookups so far (hits, misses; its C++ fast path)."""
    from torch.distributed.tensor.debug import _get_fast_path_sharding_prop_cache_stats

    return tuple(_get_fast_path_sharding_prop_cache_stats())


@pytest.mark.parametrize("grad_placement", [Shard(0), Partial()], ids=["as-param", "partial"])
def test_steps_equal_torch_adamw(mesh, grad_placement):
    """As-param gradients take the local path; a `Partial` one makes the step torch's own."""
    ours_params = _params(mesh, [Shard(0)] * 3)
    torch_params = _params(mesh, [Shard(0)] * 3)
    ours = ShardLocalAdamW(_groups(ours_params), lr=1e-2, foreach=True)
    reference = torch.optim.AdamW(_groups(torch_params), lr=1e-2, foreach=True)
    hook_calls = []
    ours.register_step_pre_hook(lambda *_: hook_calls.append("pre"))
    ours.register_step_post_hook(lambda *_: hook_calls.append("post"))
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
        _set_grads(ours_params, grads, mesh, grad_placement)
        _set_grads(torch_params, grads, mesh, grad_placement)
        before = _sharding_propagations()
        ours.step()
        # The local path runs no DTensor op at all (no sharding propagation, cached or not).
        assert (_sharding_propagations() == before) == (grad_placement == Shard(0))
        reference.step()
    assert hook_calls == ["pre", "post"] * 4
    for mine, theirs in zip(ours_params, torch_params, strict=True):
        assert torch.equal(mine.full_tensor(), theirs.full_tensor())
        for key in ("exp_avg", "exp_avg_sq"):
            state, expected = ours.state[mine][key], reference.state[theirs][key]
            assert isinstance(state, DTensor) and state.placements == mine.placements
            assert torch.equal(state.full_tensor(), expected.full_tensor())
        assert float(ours.state[mine]["step"]) == float(reference.state[theirs]["step"]) == 4


def test_state_is_created_without_a_step(mesh):
    """`init_state` makes AdamW's zero state, as DTensors with the parameters' specs: DCP's
    `get_state_dict` then finds it and runs no zero-gradient step (its step count stays 0)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = nn.Linear(4, 8)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    model.bias = nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Replicate()]))
    before = [p.full_tensor().clone() for p in model.parameters()]
    optimizer = ShardLocalAdamW(model.parameters(), lr=1.0, foreach=True)
    optimizer.init_state()
    _, optim_sd = get_state_dict(model, optimizer)
    for state in optim_sd["state"].values():
        assert float(state["step"]) == 0
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor) and not state[key].full_tensor().any()
    after = [p.full_tensor() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("max_norm", [0.5, 0.0], ids=["clipped", "norm-only"])
def test_clip_equals_torch_on_dtensors(mesh, max_norm):
    """Sharded, replicated and partial gradients: the norm and the clipped gradients are those
    of torch's `clip_grad_norm_` on the DTensors."""
    placements = [Shard(0), Replicate(), Partial()]
    ours, theirs = _params(mesh, [Shard(0)] * 3), _params(mesh, [Shard(0)] * 3)
    generator = torch.Generator().manual_seed(2)
    for a, b, placement, shape in zip(ours, theirs, placements, SHAPES, strict=True):
        grad = torch.randn(shape, generator=generator)
        a.grad = DTensor.from_local(grad.clone(), mesh, [placement], run_check=False)
        b.grad = DTensor.from_local(grad.clone(), mesh, [placement], run_check=False)
    norm = clip_gradients(ours, max_norm, select_device("fp32"))
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm if max_norm > 0 else float("inf"))
    assert norm == pytest.approx(float(expected.full_tensor()), rel=1e-6)
    assert norm > max_norm  # the clipped case clips
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a.grad.full_tensor(), b.grad.full_tensor(), rtol=1e-6, atol=0)
