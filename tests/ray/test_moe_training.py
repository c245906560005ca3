"""A mixture-of-experts model (moe-tiny) trained by the real driver on the shared local Ray
cluster: 2 ranks (dp_shard=2), capacity_factor 1 so experts drop tokens. The run equals the
single-process reference (losses, weights, samples), and every metrics.jsonl line carries the
step's router statistics over the global batch: token copies each expert accepted and those
dropped, equal to the reference's, and the drop rate."""

from __future__ import annotations

import pytest
from reference import check_run_matches_reference, reference_run

from raytrain_dt.control.coordinator import train

pytestmark = pytest.mark.usefixtures("ray_cluster")

STEPS = 3


def test_moe_run_reports_router_stats_in_metrics(make_config):
    cfg = make_config(
        "model.preset=moe-tiny",
        "model.capacity_factor=1.0",
        "parallel.dp_shard=2",
        f"trainer.steps={STEPS}",
        f"checkpoint.every_steps={STEPS}",
    )
    result = train(cfg, show_progress=False)
    assert result.layout.dims.dp_shard == 2
    metrics = check_run_matches_reference(cfg, result, STEPS, atol=1e-5)
    ref_router: list = []
    reference_run(cfg, STEPS, router_stats=ref_router)
    router = [m["router"] for m in metrics]
    assert [[*r["tokens_per_expert"], r["dropped"]] for r in router] == ref_router
    for r in router:
        assert len(r["tokens_per_expert"]) == 4 and r["dropped"] > 0
        routed = sum(r["tokens_per_expert"]) + r["dropped"]
        assert r["drop_rate"] == pytest.approx(r["dropped"] / routed)
