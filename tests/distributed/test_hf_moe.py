"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE; random init from a tiny config,
nothing downloaded) train under FSDP2 (dp_shard=2) and expert parallelism (ep=2: their fused
experts split over the ranks) like their single-process reference: losses and final parameters
within 1e-5, router statistics (tokens per expert) equal. Their load-balancing loss
(router_aux_loss_coef, transformers' formula per sequence) is in both.
"""

from __future__ import annotations

import pytest
import torch
from harness import WorkerPool
from reference import reference_run

from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.parallel_dims import ParallelDims

pytest.importorskip("transformers")

STEPS = 4
BASE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02,
}
MODELS = {
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {
        "num_experts": 4,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
    },
}
LAYOUTS = {
    "fsdp2": Layout(ParallelDims(world_size=2, dp_shard=2), 3, 2, 2),
    # transformers' fused experts split over the two ranks, tokens moved by all-to-all.
    "ep2": Layout(ParallelDims(world_size=2, dp_shard=2, ep=2), 3, 2, 2),
}


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(2)
    yield workers
    workers.close()


def _cfg(token_data, run_dir, model: str):
    from conftest import REPO

    from raytrain_dt.config import load_config

    overrides = [f"model.hf_config.{k}={v}" for k, v in {**BASE, **MODELS[model]}.items()]
    return load_config(
        REPO / "conf" / "test.yaml",
        [
            f"data.path={token_data}",
            f"run.dir={run_dir}",
            f"model.hf={model}",
            *overrides,
            f"trainer.steps={STEPS}",
            "trainer.global_batch=8",
        ],
    )


@pytest.fixture(scope="module")
def references(token_data, tmp_path_factory):
    """Per model: (config, losses, parameters, router statistics) of the single-process run."""
    out = {}
    for model in MODELS:
        cfg = _cfg(token_data, tmp_path_factory.mktemp(model), model)
        router: list = []
        losses, params = reference_run(cfg, STEPS, router_stats=router)
        out[model] = (cfg, losses, params, router)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_hf_moe_equals_single_process(pool, references, model, layout):
    cfg, ref_losses, ref_params, ref_router = references[model]
    assert any(".experts.gate_up_proj" in k for k in ref_params)
    result = pool.run(cfg, LAYOUTS[layout], STEPS)
    assert result.losses == pytest.approx(ref_losses, abs=1e-5)
    assert result.params.keys() == ref_params.keys()
    for key, value in ref_params.items():
        torch.testing.assert_close(result.params[key], value, atol=1e-5, rtol=0, msg=key)
    assert [[*r.tokens_per_expert, r.dropped] for r in result.router] == ref_router
