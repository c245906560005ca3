"""`RankSpec`: everything the coordinator tells one rank about the segment it is to train.

Pure data (no torch), built on the driver and shipped to the rank actor. A new spec is sent on
every (re)start of the group, so one actor can serve several layouts in its lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.data.input_pipeline import DataSlice
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.layout import Layout

if TYPE_CHECKING:  # the spec module imports torch; this one stays pure data
    from raytrain_dt.models.model_spec import ModelSpec


@dataclass(frozen=True)
class RankSpec:
    rank: int
    layout: Layout
    master_addr: str
    master_port: int
    cfg: TrainConfig
    shape: ModelShape
    data: DataSlice
    start_step: int
    end_step: int
    checkpoint_root: str
    resume_from: str | None = None
    # How to build and parallelize the model; our decoder of `shape` when None.
    model: ModelSpec | None = None

    @property
    def world_size(self) -> int:
        return self.layout.dims.world_size
