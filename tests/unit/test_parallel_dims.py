"""ParallelDims: degree validation, rank <-> coordinate arithmetic and group layout."""

from __future__ import annotations

import pytest

from raytrain_dt.topology.parallel_dims import MESH_AXES, ParallelDims


def test_product_mismatch_names_the_product() -> None:
    with pytest.raises(ValueError, match=r"= 12 != world_size\(16\)"):
        ParallelDims(world_size=16, pp=2, dp_shard=3, tp=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_degrees_must_be_positive_ints(bad) -> None:
    with pytest.raises(ValueError, match=r"ParallelDims\.tp"):
        ParallelDims(world_size=4, tp=bad)


def test_expert_parallel_must_divide_dp_shard() -> None:
    with pytest.raises(ValueError, match=r"ep=2 does not divide dp_shard=3"):
        ParallelDims(world_size=6, dp_shard=3, ep=2)


def test_expert_groups_are_consecutive_dp_shard_ranks() -> None:
    dims = ParallelDims(world_size=8, dp_shard=4, tp=2, ep=2)
    assert dims.dp_shard_mod_ep == 2 and dims.dp == 4 and dims.world_size == 8
    # dp_shard is strided by tp (=2): ep partners are dp_shard 0,1 then 2,3 of each tp rank.
    assert sorted(dims.ep_groups()) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.describe() == "dp_shard=4 x tp=2 x ep=2"


def test_rank_coords_round_trip() -> None:
    dims = ParallelDims(world_size=48, pp=2, dp_replicate=2, dp_shard=3, cp=1, tp=4)
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert dims.rank_of(**{a: getattr(c, a) for a in MESH_AXES}) == rank
        assert c.dp == c.dp_replicate * dims.dp_shard + c.dp_shard
        seen.add(tuple(getattr(c, a) for a in MESH_AXES))
    assert len(seen) == dims.world_size
    with pytest.raises(ValueError, match="outside world_size"):
        dims.coords(48)


def test_tp_groups_are_consecutive_ranks() -> None:
    dims = ParallelDims(world_size=32, pp=2, dp_shard=4, tp=4)
    groups = dims.groups("tp")
    assert len(groups) == 8
    for g in groups:
        assert g == list(range(g[0], g[0] + 4))
        assert g[0] % 4 == 0


def test_pp_is_outermost_and_dp_groups_stride_over_tp() -> None:
    dims = ParallelDims(world_size=16, pp=2, dp_shard=2, tp=4)
    assert dims.groups("pp")[0] == [0, 8]
    assert dims.groups("dp_shard")[0] == [0, 4]
    assert dims.dp == 2 and dims.shape == (2, 1, 2, 1, 4)
    assert dims.describe() == "pp=2 x dp_shard=2 x tp=4"
    with pytest.raises(ValueError, match="unknown mesh axis"):
        dims.groups("ep")
