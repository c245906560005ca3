"""Pipeline parallelism end to end through Ray: pp=2 on the shared cluster equals the reference.

Both ranks hold DP coordinate 0, so they read identical batches: the first stage feeds the
tokens in and the last stage uses them as targets. Rank 0 (first stage) reports the loss that
the last stage computed.
"""

from __future__ import annotations

import pytest
import torch
from reference import load_checkpoint_params, reference_run

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.topology.parallel_dims import ParallelDims

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_pp2_equals_single_process(make_config):
    cfg = make_config(
        "parallel.pp=2",
        "cluster.num_ranks=2",
        "trainer.grad_accum=2",
        "checkpoint.every_steps=5",
    )
    result = train(cfg, show_progress=False)
    assert result.layout.dims == ParallelDims(world_size=2, pp=2)
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    ref_losses, ref_params = reference_run(cfg, cfg.trainer.steps)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
    # The checkpoint holds the whole model under its unsplit names.
    params = load_checkpoint_params(result.latest_checkpoint)
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0)
