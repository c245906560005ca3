"""Model specs and Hugging Face models (`model.hf`), without processes or Ray.

- transformers stays unimported unless a config asks for it (checked in a fresh interpreter);
- a spec is picklable and builds the same weights from the same seed;
- our `ckpt consolidate` output, loaded back as `model.hf=<dir>`, gives our model's logits;
- the TP plan comes from transformers' `base_model_tp_plan`; bad sources are one-line errors.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.model_spec import llama_spec
from raytrain_dt.models.presets import PRESETS

REPO = Path(__file__).resolve().parents[2]
SMALL_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def test_the_core_and_our_preset_never_import_transformers():
    script = """
import sys
import raytrain_dt.cli, raytrain_dt.control.coordinator, raytrain_dt.worker.rank_actor
import raytrain_dt.engines.fsdp2, raytrain_dt.data.user_data
from raytrain_dt.config import load_config
from raytrain_dt.models.model_spec import model_spec
import torch
spec = model_spec(load_config("conf/test.yaml"))
model = spec.build(16, seed=0)
tokens = torch.randint(0, 256, (2, 16))
spec.loss_fn()(model(tokens), tokens).backward()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "datasets")))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.stdout.strip() == "[]"


def test_spec_pickles_and_builds_the_same_weights_from_a_seed():
    spec = pickle.loads(pickle.dumps(llama_spec(PRESETS["tiny"])))
    a, b = spec.build(16, seed=3).state_dict(), spec.build(16, seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["output.weight"], spec.build(16, seed=4).state_dict()["output.weight"])
    meta = spec.build(16, seed=3, device="meta")
    assert next(meta.parameters()).device.type == "meta"


def test_hf_spec_from_a_model_type_has_the_planner_facts():
    pytest.importorskip("transformers")
    from raytrain_dt.models.hf import hf_spec

    spec = pickle.loads(pickle.dumps(hf_spec("llama", SMALL_LLAMA)))
    assert (spec.shape.dim, spec.shape.n_layers, spec.shape.n_heads, spec.shape.n_kv_heads) == (
        32,
        2,
        4,
        2,
    )
    model = spec.build(16, seed=0)
    assert list(spec.blocks(model)) == ["0", "1"]
    assert "model.layers.1.mlp.down_proj.weight" in model.state_dict()


def test_consolidated_checkpoint_fine_tunes_with_our_logits_at_step_0(tmp_path):
    pytest.importorskip("transformers")
    from raytrain_dt.checkpoint.export import consolidate
    from raytrain_dt.models.hf import hf_spec

    shape = PRESETS["tiny"]
    ours = llama_spec(shape).build(32, seed=7).eval()
    dcp.save({"model": ours.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    consolidate(str(tmp_path / "ckpt"), tmp_path / "hf", shape, 32)

    spec = hf_spec(str(tmp_path / "hf"))  # weights present: loaded, not initialised
    assert spec.weights_dir == str(tmp_path / "hf") and spec.shape == shape
    theirs = spec.build(32, seed=0).eval()
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens), ours(tokens), atol=1e-5, rtol=1e-5)
    random = hf_spec(str(tmp_path / "hf"), init="random").build(32, seed=0)
    assert not torch.equal(random.lm_head.weight, theirs.lm_head.weight)


def test_tp_plan_comes_from_transformers_and_unknown_styles_are_named():
    transformers = pytest.importorskip("transformers")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from raytrain_dt.parallel.hf_tensor_parallel import LLAMA_FAMILY_PLAN, block_plan

    config = transformers.LlamaConfig(**SMALL_LLAMA)
    plan = block_plan(config.base_model_tp_plan)
    assert isinstance(plan["self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["mlp.down_proj"], RowwiseParallel)
    assert block_plan(None).keys() == block_plan(LLAMA_FAMILY_PLAN).keys() == plan.keys()
    with pytest.raises(ValueError, match="style 'packed_colwise' for layers.*.mlp.gate_up"):
        block_plan({"layers.*.mlp.gate_up": "packed_colwise"})


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{tmp}", "model.hf: {tmp} has no config.json"),
        ("org/some-model", "model.hf: org/some-model is not a local directory"),
        ("not_a_model_type", "model.hf: 'not_a_model_type' is not a known model type"),
    ],
)
def test_bad_hf_sources_are_one_line_errors(tmp_path, source, message):
    pytest.importorskip("transformers")
    from raytrain_dt.models.hf import hf_spec

    with pytest.raises(ConfigError, match="^" + message.format(tmp=tmp_path)):
        hf_spec(source.format(tmp=tmp_path))
