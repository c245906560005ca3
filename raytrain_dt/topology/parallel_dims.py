"""`ParallelDims`: the one object that owns all parallel-degree arithmetic.

The rank grid is `arange(world).view(pp, dp_replicate, dp_shard, cp, tp)`: TP is innermost, so
a TP group is a run of consecutive ranks (and therefore on one node once ranks are ordered by
node), and PP is outermost, so a whole pipeline stage is a contiguous block of ranks.
"Axis" means a mesh axis; counts carry a `num_` prefix. No torch here: the control plane and the
simulator use this without it; the worker builds the device mesh from it (`parallel/device_mesh.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Outermost to innermost. The order is a contract with checkpoints' layout records.
MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class RankCoords:
    rank: int
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    # Flattened data-parallel index: ranks with equal `dp` read the same batches.
    dp: int


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    # Expert parallel: each MoE layer's experts are split over `ep` consecutive dp_shard ranks,
    # which exchange tokens by all-to-all. Not a mesh axis of its own: EP borrows the dp_shard
    # ranks (as in torchtitan), so it never changes the world size or the data split; expert
    # parameters are then FSDP-sharded over the remaining `dp_shard_mod_ep` ranks.
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in (*MESH_AXES, "ep", "world_size"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{axis} must be a positive int, got {value!r}")
        if self.dp_shard % self.ep:
            raise ValueError(
                f"ParallelDims.ep={self.ep} does not divide dp_shard={self.dp_shard}: expert "
                "parallelism splits the experts over dp_shard ranks"
            )
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"pp({self.pp}) * dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) "
                f"* cp({self.cp}) * tp({self.tp}) = {product} != world_size({self.world_size})"
            )

    # --- degrees -----------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many distinct batches one optimizer step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def dp_shard_mod_ep(self) -> int:
        """Ranks each expert's parameters are FSDP-sharded over (dp_shard / ep)."""
        return self.dp_shard // self.ep

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    def describe(self) -> str:
        parts = [f"{axis}={getattr(self, axis)}" for axis in MESH_AXES if getattr(self, axis) > 1]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        return " x ".join(parts) if parts else "single rank"

    def as_dict(self) -> dict[str, int]:
        return {"world_size": self.world_size, **{a: getattr(self, a) for a in (*MESH_AXES, "ep")}}

    # --- rank <-> coordinates ----------------------------------------------------------------
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world_size {self.world_size}")
        values = {}
        rest = rank
        for axis in reversed(MESH_AXES):
            size = getattr(self, axis)
            values[axis] = rest % size
            rest //= size
        dp = values["dp_replicate"] * self.dp_shard + values["dp_shard"]
        return RankCoords(rank=rank, dp=dp, **values)

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for axis in MESH_AXES:
            rank = rank * getattr(self, axis) + coords.get(axis, 0)
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Rank lists that vary only along `axis` (for example every TP group)."""
        if axis not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; axes are {MESH_AXES}")
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(getattr(c, a) for a in MESH_AXES if a != axis)
            by_rest.setdefault(key, []).append(rank)
        return list(by_rest.values())

    def ep_groups(self) -> list[list[int]]:
        """Rank lists that share one copy of every expert between them (an all-to-all group):
        `ep` consecutive dp_shard indices, all other coordinates equal."""
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = (c.pp, c.dp_replicate, c.dp_shard // self.ep, c.cp, c.tp)
            by_rest.setdefault(key, []).append(rank)
        return list(by_rest.values())
