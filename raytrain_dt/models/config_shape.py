"""The planner's `ModelShape` for a `TrainConfig`, read without building a model or importing
torch: a preset with the config's overrides, or the shape of a `model.hf` config.

The same shape `models.model_spec.model_spec(cfg).shape` carries; the simulator plans from
this one so that it never loads torch.
"""

from __future__ import annotations

from raytrain_dt.models.presets import ModelShape, resolve_shape


def config_shape(cfg) -> ModelShape:
    """The shape of the model a `TrainConfig` names."""
    m = cfg.model
    if m.hf:
        from raytrain_dt.models.hf_config import load_config, shape_of

        return shape_of(load_config(m.hf, dict(m.hf_config or {})))
    return resolve_shape(
        m.preset,
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        vocab_size=m.vocab_size,
        ffn_hidden=m.ffn_hidden,
        tie_embeddings=m.tie_embeddings,
        n_experts=m.n_experts,
        experts_per_token=m.experts_per_token,
        moe_ffn_hidden=m.moe_ffn_hidden,
        capacity_factor=m.capacity_factor,
        router_aux_loss_coef=m.router_aux_loss_coef,
    )
