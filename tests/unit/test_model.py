"""The Llama-style decoder: shapes, parameter counts, causality, tying, determinism."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.llama import build_model, next_token_loss
from raytrain_dt.models.presets import PRESETS, resolve_shape


def test_logits_shape_and_initial_loss_near_uniform():
    shape = PRESETS["tiny"]
    model = build_model(shape, max_seq_len=32, seed=0)
    tokens = torch.randint(0, shape.vocab_size, (3, 32))
    logits = model(tokens)
    assert logits.shape == (3, 32, shape.vocab_size)
    # Small init: the first loss is close to log(vocab).
    assert next_token_loss(logits, tokens).item() == pytest.approx(
        torch.log(torch.tensor(256.0)).item(), abs=0.1
    )


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_the_shape_arithmetic(tied):
    shape = dataclasses.replace(PRESETS["tiny"], tie_embeddings=tied)
    model = build_model(shape, max_seq_len=16, seed=0)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params
    assert (model.output.weight is model.tok_embeddings.weight) == tied


def test_attention_is_causal():
    model = build_model(PRESETS["tiny"], max_seq_len=16, seed=0)
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.equal(model(tokens)[0, :10], model(changed)[0, :10])
        assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:])


def test_init_is_deterministic_in_the_seed():
    a = build_model(PRESETS["tiny"], 16, seed=3).state_dict()
    b = build_model(PRESETS["tiny"], 16, seed=3).state_dict()
    c = build_model(PRESETS["tiny"], 16, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


@pytest.mark.parametrize(
    ("preset", "billions"),
    [
        ("llama-1b", 1.24),
        ("llama-7b", 6.74),
        ("llama-13b", 13.0),
        ("llama-70b", 70.6),
        ("llama-405b", 405.9),
    ],
)
def test_large_presets_have_their_published_sizes(preset, billions):
    assert PRESETS[preset].num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_bad_shapes_name_the_key():
    with pytest.raises(ConfigError, match="model.preset: 'llama-9b'"):
        resolve_shape("llama-9b")
    with pytest.raises(ConfigError, match="model.dim: 65 is not divisible by model.n_heads=4"):
        resolve_shape("tiny", dim=65)
