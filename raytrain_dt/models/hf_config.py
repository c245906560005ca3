"""A `model.hf` source's transformers config and the planner's shape of it, without torch: the
driver and the simulator plan from this, and `models/hf.py` builds the model from the same config.

transformers is imported only inside `load_config`, when a config asks for `model.hf`.
"""

from __future__ import annotations

from pathlib import Path

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.presets import ModelShape

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


def has_weights(source: str) -> bool:
    path = Path(source)
    return path.is_dir() and any(any(path.glob(g)) for g in WEIGHT_GLOBS)


def load_config(source: str, overrides: dict):
    """The transformers config for a local directory or a model type; never downloads."""
    from transformers import AutoConfig

    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.hf: {source} has no config.json")
        config = AutoConfig.from_pretrained(path, local_files_only=True, **overrides)
    elif "/" in source or source.startswith("."):
        raise ConfigError(f"model.hf: {source} is not a local directory (nothing is downloaded)")
    else:
        try:
            config = AutoConfig.for_model(source, **overrides)
        except ValueError as exc:
            raise ConfigError(f"model.hf: {source!r} is not a known model type ({exc})") from exc
    # Our forward passes no mask: SDPA's causal path, the same kernel our own decoder uses.
    config._attn_implementation = "sdpa"
    return config


def shape_of(config) -> ModelShape:
    """The planner's facts about a Llama-family config, mixture-of-experts ones included
    (Mixtral: num_local_experts of inner size intermediate_size; Qwen2/3-MoE: num_experts of
    moe_intermediate_size, plus Qwen2-MoE's shared expert)."""
    n_heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    n_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    moe = {}
    if n_experts:
        moe = dict(
            n_experts=n_experts,
            experts_per_token=config.num_experts_per_tok,
            moe_ffn_hidden=getattr(config, "moe_intermediate_size", 0) or 0,
            shared_ffn_hidden=getattr(config, "shared_expert_intermediate_size", 0) or 0,
            router_aux_loss_coef=getattr(config, "router_aux_loss_coef", 0.0) or 0.0,
        )
    return ModelShape(
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        vocab_size=config.vocab_size,
        ffn_hidden=config.intermediate_size,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        **moe,
    )
