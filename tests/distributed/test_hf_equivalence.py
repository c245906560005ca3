"""A Hugging Face Llama (transformers, random init from a config) trains like the single-process
reference under FSDP2, TP2 and PP2, and a checkpoint written under TP2 continues under FSDP2.

The model is `model.hf=llama` with a small config (4 layers, hidden 64); its TP plan comes from
transformers' `base_model_tp_plan` and its pipeline stages from its decoder layers. Two spawned
processes (no Ray) run the layouts one after another; losses and final parameters must match
`reference_run` within 1e-5, as for our own decoder in test_engine_matrix.
"""

from __future__ import annotations

import pytest
import torch
from harness import WorkerPool
from reference import load_checkpoint_params, reference_run
from test_engine_matrix import LAYOUTS

pytest.importorskip("transformers")

STEPS = 5
HF_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(2)
    yield workers
    workers.close()


@pytest.fixture(scope="module")
def cfg(token_data, tmp_path_factory):
    from conftest import REPO

    from raytrain_dt.config import load_config

    overrides = [f"model.hf_config.{k}={v}" for k, v in HF_CONFIG.items()]
    return load_config(
        REPO / "conf" / "test.yaml",
        [
            f"data.path={token_data}",
            f"run.dir={tmp_path_factory.mktemp('hf')}",
            "model.hf=llama",
            *overrides,
            f"trainer.steps={STEPS}",
            "trainer.global_batch=8",
        ],
    )


@pytest.fixture(scope="module")
def reference(cfg):
    return reference_run(cfg, STEPS)


def _assert_params_equal(params: dict, ref_params: dict) -> None:
    assert params.keys() == ref_params.keys()
    for key, value in ref_params.items():
        torch.testing.assert_close(params[key], value, atol=1e-5, rtol=0, msg=key)


def test_reference_uses_the_hub_parameter_names(reference):
    _, ref_params = reference
    assert "model.layers.3.self_attn.q_proj.weight" in ref_params
    assert "lm_head.weight" in ref_params


@pytest.mark.parametrize("name", ["fsdp2-full", "tp2", "pp2-1f1b"])
def test_hf_llama_layout_equals_single_process(pool, cfg, reference, name):
    ref_losses, ref_params = reference
    result = pool.run(cfg, LAYOUTS[name], STEPS)
    assert result.losses == pytest.approx(ref_losses, abs=1e-5)
    _assert_params_equal(result.params, ref_params)


def test_hf_checkpoint_saved_under_tp2_continues_under_fsdp2(pool, cfg, reference, tmp_path):
    ref_losses, ref_params = reference
    first = pool.run(cfg, LAYOUTS["tp2"], 3, checkpoint_dir=str(tmp_path / "a"))
    second = pool.run(
        cfg,
        LAYOUTS["fsdp2-full"],
        2,
        load_dir=str(tmp_path / "a"),
        start_step=3,
        checkpoint_dir=str(tmp_path / "b"),
    )
    assert first.checkpoint_keys == second.checkpoint_keys
    assert first.losses + second.losses == pytest.approx(ref_losses, abs=1e-5)
    _assert_params_equal(second.params, ref_params)
    _assert_params_equal(load_checkpoint_params(str(tmp_path / "b")), ref_params)
