"""Meta-device construction and sharded materialization (`models.materialize`) in one process:
any region a rank reads from a weight source is exactly that region of the whole parameter
(random init and files alike), the skeleton holds no parameter memory, and the initial weights
follow each model's own init conventions. Across real layouts: tests/distributed."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import save_file

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.hf_weights import DirectoryWeights
from raytrain_dt.models.llama import rope_cache
from raytrain_dt.models.materialize import (
    ParamInit,
    RandomWeights,
    initial_weights,
    read_flat,
)
from raytrain_dt.models.model_spec import llama_spec
from raytrain_dt.models.presets import PRESETS, ModelShape

# 300 rows of 8192: 128 rows a random block, so regions below cross block boundaries.
SHAPE = (300, 8192)
REGIONS = [
    ((0, 1), (0, 8192)),
    ((100, 260), (0, 8192)),
    ((127, 129), (4000, 4100)),
    ((0, 300), (8191, 8192)),
    ((299, 300), (0, 3)),
]
FLAT_RANGES = [(0, 10), (8190, 8200), (5 * 8192 + 3, 140 * 8192 + 17), (299 * 8192, 300 * 8192)]


def _whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def test_a_random_region_is_that_region_of_the_whole_parameter():
    weights = RandomWeights(lambda name, module: ParamInit.normal(0.02), seed=5)
    whole = weights.read("w", None, SHAPE, _whole(SHAPE))
    assert whole.std().item() == pytest.approx(0.02, rel=0.01)
    for (r0, r1), (c0, c1) in REGIONS:
        region = weights.read("w", None, SHAPE, (slice(r0, r1), slice(c0, c1)))
        assert torch.equal(region, whole[r0:r1, c0:c1]), (r0, r1, c0, c1)
    for start, stop in FLAT_RANGES:  # ZeRO-3 partitions
        flat = read_flat(weights, "w", None, SHAPE, start, stop)
        assert torch.equal(flat, whole.reshape(-1)[start:stop]), (start, stop)
    # Another parameter name or run seed draws other values.
    assert not torch.equal(weights.read("v", None, SHAPE, _whole(SHAPE)), whole)
    other_seed = RandomWeights(lambda name, module: ParamInit.normal(0.02), seed=6)
    assert not torch.equal(other_seed.read("w", None, SHAPE, _whole(SHAPE)), whole)


def test_padding_rows_are_zero_in_every_region():
    weights = RandomWeights(lambda name, module: ParamInit.normal(1.0, zero_rows=(128,)), seed=0)
    whole = weights.read("e", None, SHAPE, _whole(SHAPE))
    assert not whole[128].any() and whole[127].all() and whole[129].all()
    assert torch.equal(
        weights.read("e", None, SHAPE, (slice(128, 130), slice(5, 9))), whole[128:130, 5:9]
    )


def test_the_skeleton_holds_no_parameter_memory_and_real_buffers():
    shape = dataclasses.replace(PRESETS["tiny"], tie_embeddings=True)
    model = llama_spec(shape).skeleton(16)
    assert all(p.is_meta for p in model.parameters())
    torch.testing.assert_close(model.rope, rope_cache(shape, 16), atol=0, rtol=0)
    assert model.output.weight is model.tok_embeddings.weight


def test_materialized_ties_stay_tied():
    shape = dataclasses.replace(PRESETS["tiny"], tie_embeddings=True)
    model = llama_spec(shape).build(16, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert not model.output.weight.is_meta and model.output.weight.std() > 0


def test_the_decoder_starts_with_its_init_conventions():
    """Norms 1, projections normal(0.02), residual outputs normal(0.02 / sqrt(2 n_layers))."""
    shape = ModelShape(dim=256, n_layers=8, n_heads=4, n_kv_heads=4, vocab_size=512, ffn_hidden=512)
    params = dict(llama_spec(shape).build(16, seed=1).named_parameters())
    residual = 0.02 / math.sqrt(2 * shape.n_layers)
    for name, param in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        expected = residual if name.endswith(("wo.weight", "w2.weight")) else 0.02
        assert param.std().item() == pytest.approx(expected, rel=0.03), name
        assert abs(param.mean().item()) < 0.1 * expected, name
    # Every parameter draws its own values.
    assert not torch.equal(
        params["layers.0.attention.wq.weight"], params["layers.1.attention.wq.weight"]
    )


def test_hf_llama_starts_with_transformers_init_conventions():
    transformers = pytest.importorskip("transformers")
    from raytrain_dt.models.hf import hf_spec

    config = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "pad_token_id": 3,
        "initializer_range": 0.05,
    }
    model = hf_spec("llama", config).build(16, seed=0)
    params = dict(model.named_parameters())
    embed = params["model.embed_tokens.weight"]
    assert not embed[3].any()  # the padding row, as transformers' _init_weights leaves it
    assert embed.std().item() == pytest.approx(0.05, rel=0.03)
    assert params["model.layers.1.mlp.down_proj.weight"].std().item() == pytest.approx(
        0.05, rel=0.03
    )
    norm = params["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    # The rotary table (a non-persistent buffer) is transformers' own, not garbage.
    reference = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        transformers.LlamaConfig(**config)
    )
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.inv_freq, atol=0, rtol=0)


@pytest.mark.parametrize("suffix", ["safetensors", "bin"])
def test_a_directory_region_is_that_region_of_the_stored_tensor(tmp_path, suffix):
    stored = {"w": torch.randn(SHAPE), "half": torch.randn(64, 48).to(torch.bfloat16)}
    if suffix == "safetensors":
        save_file(stored, tmp_path / "model.safetensors")
    else:
        torch.save(stored, tmp_path / "pytorch_model.bin")
    weights = DirectoryWeights(tmp_path, "model.hf")
    for (r0, r1), (c0, c1) in REGIONS:
        region = weights.read("w", None, SHAPE, (slice(r0, r1), slice(c0, c1)))
        assert torch.equal(region, stored["w"][r0:r1, c0:c1])
    for start, stop in FLAT_RANGES:
        flat = read_flat(weights, "w", None, SHAPE, start, stop)
        assert torch.equal(flat, stored["w"].reshape(-1)[start:stop])
    half = weights.read("half", None, (64, 48), (slice(8, 16), slice(0, 48)))
    assert half.dtype == torch.float32 and torch.equal(half, stored["half"][8:16].float())
    with pytest.raises(
        ConfigError, match=r"model.hf: half has shape \(64, 48\), the model \(64, 4\)"
    ):
        weights.read("half", None, (64, 4), (slice(0, 1), slice(0, 4)))
    with pytest.raises(ConfigError, match="model.hf: .* has no tensor absent"):
        weights.read("absent", None, (1,), (slice(0, 1),))


def test_the_initial_weights_come_from_init_from_then_the_hf_directory_then_the_seed(tmp_path):
    spec = llama_spec(PRESETS["tiny"])
    assert isinstance(initial_weights(spec, 0), RandomWeights)
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    from_dir = initial_weights(spec, 0, init_from=str(tmp_path))
    assert isinstance(from_dir, DirectoryWeights) and from_dir.key == "model.init_from"
    # Our names are mapped to the Hub's, as consolidation writes them.
    assert (
        from_dir.rename("layers.0.attention.wq.weight") == "model.layers.0.self_attn.q_proj.weight"
    )
