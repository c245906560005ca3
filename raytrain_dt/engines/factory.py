"""Engine selection: the one place that maps `engine.name` and the layout to an Engine."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.engines.base import Engine
from raytrain_dt.models.materialize import WeightSource
from raytrain_dt.models.model_spec import ModelSpec
from raytrain_dt.topology.layout import Layout


def build_engine(
    spec: ModelSpec,
    cfg: TrainConfig,
    layout: Layout,
    mesh: DeviceMesh,
    device: DeviceSpec,
    weights: WeightSource | None = None,
) -> Engine:
    """The engine for `spec`'s model at this layout. Each engine builds the model itself,
    holding only what this rank must (`models.materialize`), from `weights` (the spec's own
    initial weights when None: its random init, or the pretrained weights it names)."""
    if cfg.engine.name == "fsdp2":
        from raytrain_dt.engines.fsdp2 import FSDP2Engine

        return FSDP2Engine(spec, cfg, layout, mesh, device, weights)
    if cfg.engine.name == "deepspeed" and layout.dims.pp_enabled:
        from raytrain_dt.engines.deepspeed_pipeline import DeepSpeedPipelineEngine

        return DeepSpeedPipelineEngine(spec, cfg, layout, mesh, device, weights)
    if cfg.engine.name == "deepspeed":
        from raytrain_dt.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(spec, cfg, layout, mesh, device, weights)
    raise ValueError(f"engine.name: {cfg.engine.name!r} has no engine")
