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
class MemoryResume:
    """Where the in-memory copies of one step are (`worker/peer_copies.py`): the ranks of
    formation `generation` that wrote them (`owners` of them), and for each owner the actors
    that hold its copy, as (actor index, actor handle), the surest first."""

    generation: int
    step: int
    owners: int
    holders: dict[int, list[tuple[int, object]]]


@dataclass(frozen=True)
class CopyPeer:
    """The actor (on another node where there is one) that holds this rank's in-memory copies."""

    actor_index: int
    handle: object


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
    # How long joining the process group may wait for its peers (the formation's time left):
    # a peer that died before it joined must not hold the others for `comm.timeout_s`.
    join_timeout_s: float | None = None
    # In-memory copies (`checkpoint.memory_every_steps`): this formation's number and this
    # actor's index (they name the copies), the peer holding this rank's copies, and the
    # copies to resume from instead of `resume_from`'s files (set with it).
    generation: int = 0
    actor_index: int = -1
    copy_peer: CopyPeer | None = None
    memory_resume: MemoryResume | None = None

    @property
    def world_size(self) -> int:
        return self.layout.dims.world_size
