"""Mixture-of-experts training (moe-tiny, capacity_factor 1 so experts do drop tokens) equals
the single-process reference within 1e-5 under data parallelism (a padded dp=3 too), expert
parallelism (ep=2), ep with FSDP-sharded experts (dp_shard=4, ep=2), ep with replicated experts
(HSDP) and activation checkpointing, context parallelism (capacity and the load-balancing loss
counted over the cp ranks' chunks) with and without ep, pipeline stages with and without ep,
and ep on the emulated accelerator (its collectives refuse host tensors, as
NCCL's do: the dispatch's counts and tokens live on the device). The router statistics (tokens
per expert, dropped assignments) equal the reference's exactly: capacity is counted per
sequence, so the drops do not depend on the layout. A checkpoint written at ep=2 continues at
ep=1 and on a single rank (DCP reshards the experts' DTensors).

One pool of 4 spawned processes (no Ray), 5 steps of 2 micro-batches each.
"""

from __future__ import annotations

import pytest
import torch
from harness import WorkerPool
from reference import reference_run

from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.parallel_dims import ParallelDims

STEPS = 5
GLOBAL_BATCH = 8
GRAD_ACCUM = 2


def _layout(activation_checkpointing: bool = False, **degrees) -> Layout:
    world = 1
    for axis, value in degrees.items():
        world *= value if axis != "ep" else 1
    dims = ParallelDims(world_size=world, **degrees)
    return Layout(
        dims,
        zero_stage=3,
        micro_batch=GLOBAL_BATCH // (GRAD_ACCUM * dims.dp),
        grad_accum=GRAD_ACCUM,
        activation_checkpointing=activation_checkpointing,
    )


LAYOUTS = {
    "dp2": _layout(dp_shard=2),
    # dp=3 does not divide the batch of 8: padding rows weigh 0 in the load-balancing loss
    # and are not counted in the router statistics.
    "dp3-padded": Layout(
        ParallelDims(world_size=3, dp_shard=3), 3, 2, GRAD_ACCUM, real_global_batch=8
    ),
    "ep2": _layout(dp_shard=2, ep=2),
    # Each ep rank's two experts FSDP-sharded over the two ranks holding them.
    "ep2xdp_shard4": _layout(dp_shard=4, ep=2),
    # Expert replicas over dp_replicate; the forward recomputed in backward counts once.
    # Each sequence split over 2 ranks: capacity and the load-balancing loss count over both.
    "cp2": _layout(cp=2),
    "cp2xep2": _layout(dp_shard=2, ep=2, cp=2),
    # Pipeline stages hold different MoE layers: router statistics sum over pp too.
    "pp2-1f1b": _layout(pp=2),
    "pp2xep2": _layout(pp=2, dp_shard=2, ep=2),
    "ep2xdp_replicate2+ac": _layout(
        dp_replicate=2, dp_shard=2, ep=2, activation_checkpointing=True
    ),
}


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(4)
    yield workers
    workers.close()


@pytest.fixture(scope="module")
def cfg(token_data, tmp_path_factory):
    from conftest import REPO

    from raytrain_dt.config import load_config

    return load_config(
        REPO / "conf" / "test.yaml",
        [
            f"data.path={token_data}",
            f"run.dir={tmp_path_factory.mktemp('moe')}",
            "model.preset=moe-tiny",
            "model.capacity_factor=1.0",
            f"trainer.steps={STEPS}",
            f"trainer.global_batch={GLOBAL_BATCH}",
        ],
    )


@pytest.fixture(scope="module")
def reference(cfg):
    router: list = []
    losses, params = reference_run(cfg, STEPS, router_stats=router)
    return losses, params, router


def _assert_equals_reference(result, reference, start: int = 0) -> None:
    ref_losses, ref_params, ref_router = reference
    assert result.losses == pytest.approx(ref_losses[start:], abs=1e-5)
    assert result.params.keys() == ref_params.keys()
    for key, value in ref_params.items():
        torch.testing.assert_close(result.params[key], value, atol=1e-5, rtol=0, msg=key)
    router = [[*r.tokens_per_expert, r.dropped] for r in result.router]
    assert router == ref_router[start:]


def test_reference_drops_tokens(reference):
    dropped = [r[-1] for r in reference[2]]
    assert all(d > 0 for d in dropped), dropped


def test_expert_parallel_on_the_emulated_accelerator(pool, cfg, reference):
    # First in this module: autograd sizes its per-device queues at a process's first
    # backward, so the pool's processes must meet the emulated device before any CPU run.
    result = pool.run(cfg, LAYOUTS["ep2"], STEPS, device="emulated")
    assert result.param_device == "emu"
    _assert_equals_reference(result, reference)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_equals_single_process(pool, cfg, reference, name):
    _assert_equals_reference(pool.run(cfg, LAYOUTS[name], STEPS), reference)


def test_checkpoint_saved_at_ep2_continues_at_ep1_and_on_one_rank(pool, cfg, reference, tmp_path):
    """3 steps at ep=2 x dp_shard=4, a DCP checkpoint, the last 2 steps at ep=1 (dp_shard=2)
    and, from the same checkpoint, on a single rank: both the reference."""
    first = pool.run(cfg, LAYOUTS["ep2xdp_shard4"], 3, checkpoint_dir=str(tmp_path / "ep2"))
    assert first.losses == pytest.approx(reference[0][:3], abs=1e-5)
    for layout in (LAYOUTS["dp2"], _layout()):
        second = pool.run(cfg, layout, 2, load_dir=str(tmp_path / "ep2"), start_step=3)
        _assert_equals_reference(second, reference, start=3)
