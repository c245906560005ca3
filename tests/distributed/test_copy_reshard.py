"""In-memory copies (`worker/peer_copies.py`) restore exactly what a durable checkpoint does.

Four FSDP2 ranks train 3 steps, then each takes its own in-memory copy (no collective: a DCP
checkpoint of its shards alone) and the group also saves a durable DCP checkpoint. Another
layout then loads either the durable checkpoint or the union of the four copies
(`checkpoint/memory_files.CopyReader`) and trains the last 2 steps: the losses and parameters
are identical bit for bit, and equal the single-process reference.
"""

from __future__ import annotations

import pytest
import torch
from matrix import GLOBAL_BATCH, cfg, pool, reference

from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.parallel_dims import ParallelDims

GRAD_ACCUM = 2


def _layout(padded: bool = False, **degrees) -> Layout:
    world = 1
    for degree in degrees.values():
        world *= degree
    dims = ParallelDims(world_size=world, **degrees)
    per_rank = -(-GLOBAL_BATCH // dims.dp)
    micro = -(-per_rank // GRAD_ACCUM)
    return Layout(dims, 3, micro, GRAD_ACCUM, real_global_batch=GLOBAL_BATCH if padded else 0)


SAVED = _layout(dp_shard=4)
TARGETS = {
    "dp4-to-dp3-padded": _layout(padded=True, dp_shard=3),
    "dp4-to-dp2xtp2": _layout(dp_shard=2, tp=2),
}


@pytest.fixture(scope="module")
def saved(pool, cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("copies")
    first = pool.run(
        cfg,
        SAVED,
        3,
        checkpoint_dir=str(root / "durable"),
        memory_copy_dir=str(root / "memory"),
    )
    return root, first


@pytest.mark.parametrize("name", list(TARGETS))
def test_copies_load_into_another_layout_as_the_durable_checkpoint(
    pool, cfg, reference, saved, name
):
    ref_losses, ref_params = reference
    root, first = saved
    layout = TARGETS[name]
    durable = pool.run(cfg, layout, 2, load_dir=str(root / "durable"), start_step=3)
    memory = pool.run(
        cfg,
        layout,
        2,
        load_copies_dir=str(root / "memory"),
        load_copies_of=SAVED.dims.world_size,
        start_step=3,
    )
    assert memory.losses == durable.losses  # the same state: the same floats
    assert memory.params.keys() == durable.params.keys()
    for key, value in durable.params.items():
        assert torch.equal(memory.params[key], value), key
    assert first.losses + memory.losses == pytest.approx(ref_losses, abs=1e-5)
    for key, value in ref_params.items():
        torch.testing.assert_close(memory.params[key], value, atol=1e-5, rtol=0, msg=key)
