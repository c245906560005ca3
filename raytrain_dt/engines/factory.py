"""Engine selection: the one place that maps `engine.name` and the layout to an Engine."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.engines.base import Engine
from raytrain_dt.models.spec import ModelSpec
from raytrain_dt.topology.layout import Layout


def build_engine(
    model: nn.Module,
    cfg: TrainConfig,
    layout: Layout,
    mesh: DeviceMesh,
    device: DeviceSpec,
    spec: ModelSpec | None = None,
) -> Engine:
    """`spec` says how to parallelize `model` (our decoder's spec when None)."""
    if cfg.engine.name == "fsdp2":
        from raytrain_dt.engines.fsdp2 import FSDP2Engine

        return FSDP2Engine(model, cfg, layout, mesh, device, spec)
    if cfg.engine.name == "deepspeed" and layout.dims.pp_enabled:
        from raytrain_dt.engines.deepspeed_pipeline import DeepSpeedPipelineEngine

        return DeepSpeedPipelineEngine(model, cfg, layout, mesh, device, spec)
    if cfg.engine.name == "deepspeed":
        from raytrain_dt.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(model, cfg, layout, mesh, device, spec)
    raise ValueError(f"engine.name: {cfg.engine.name!r} has no engine")
