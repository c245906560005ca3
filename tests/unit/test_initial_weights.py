"""Initial weights: the config.json mapping is the inverse of what consolidation writes, and a
Hugging Face-named safetensors directory loads into our model exactly (tied weights too)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from raytrain_dt.checkpoint.export import hf_config, hf_name
from raytrain_dt.checkpoint.initial import SHAPE_FIELDS, check_matches, model_overrides
from raytrain_dt.config import load_config
from raytrain_dt.control.run_setup import model_shape
from raytrain_dt.errors import ConfigError
from raytrain_dt.models.llama import build_model
from raytrain_dt.models.materialize import initial_weights
from raytrain_dt.models.model_spec import llama_spec
from raytrain_dt.models.presets import PRESETS


def _write_hf_dir(path, model, shape, seq_len):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config(shape, seq_len)))
    tensors = {hf_name(n): p.detach().clone() for n, p in model.named_parameters()}
    save_file(tensors, path / "model.safetensors")


def test_shape_mapping_inverts_the_exported_config():
    shape = PRESETS["llama-70b"]
    exported = hf_config(shape, 4096)
    assert {theirs: exported[theirs] for theirs in SHAPE_FIELDS} == {
        theirs: getattr(shape, ours) for theirs, ours in SHAPE_FIELDS.items()
    }


@pytest.mark.parametrize("tied", [False, True])
def test_a_hf_directory_loads_exactly_and_gives_the_shape(tmp_path, tied):
    cfg = load_config("conf/test.yaml", ["model.n_layers=2", f"model.tie_embeddings={tied}"])
    shape = model_shape(cfg)
    source = build_model(shape, 64, seed=7)
    _write_hf_dir(tmp_path / "hf", source, shape, 64)

    overrides = model_overrides(tmp_path / "hf")
    assert model_shape(load_config("conf/test.yaml", overrides)) == shape
    check_matches(tmp_path / "hf", shape)
    spec = llama_spec(shape)
    target = spec.build(64, seed=8, weights=initial_weights(spec, 8, str(tmp_path / "hf")))
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_a_different_preset_field_names_the_preset(tmp_path):
    shape = model_shape(load_config("conf/test.yaml"))
    _write_hf_dir(tmp_path / "hf", build_model(shape, 64, 1), shape, 64)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"rope_theta=500000.0 but .* 10000.0 \(model.preset\)"):
        check_matches(tmp_path / "hf", shape)
    with pytest.raises(ConfigError, match="model.init_from: .*config.json not found"):
        model_overrides(tmp_path / "missing")
