"""Engine selection: the one place that maps `engine.name` and the layout to an Engine."""

from __future__ import annotations

from raytrain_dt.engines.base import Engine, EngineBuild
from raytrain_dt.topology.pins import engine_refusal


def build_engine(build: EngineBuild) -> Engine:
    """The engine for the build's model at its layout. Each engine builds the model itself,
    holding only what this rank must (`models.materialize`), from the build's weights (the
    spec's own initial weights when None: its random init, or the pretrained weights it names)."""
    cfg, layout = build.cfg, build.layout
    if cfg.engine.name == "fsdp2":
        from raytrain_dt.engines.fsdp2 import FSDP2Engine

        return FSDP2Engine(build)
    # The planner refuses this before any rank starts; a model given through the API is
    # checked here too.
    refusal = engine_refusal(cfg.engine.name, None, None, None, moe=build.spec.shape.is_moe)
    if refusal:
        raise ValueError(refusal)
    if cfg.engine.name == "deepspeed" and layout.dims.pp_enabled:
        from raytrain_dt.engines.deepspeed_pipeline import DeepSpeedPipelineEngine

        return DeepSpeedPipelineEngine(build)
    if cfg.engine.name == "deepspeed":
        from raytrain_dt.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(build)
    raise ValueError(f"engine.name: {cfg.engine.name!r} has no engine")
