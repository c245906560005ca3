"""The rank group the coordinator drives keeps to `RankGroupLike`, the real one and the unit
tests' fake alike: the same methods with the same parameters, so the fake cannot drift."""

from __future__ import annotations

import inspect

import pytest
from fakes import FakeCluster, FakeRankGroup

from raytrain_dt.control.cluster import ClusterView, RayClusterView
from raytrain_dt.control.group import RankGroupLike
from raytrain_dt.control.rank_group import RankGroup

# What tests script on the fake (faults and notices): not part of the protocol.
FAKE_SCRIPTING = {"kill_node", "kill_rank", "notice"}


def public_members(cls: type) -> set[str]:
    return {
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def parameters(cls: type, name: str) -> list[str] | None:
    member = inspect.getattr_static(cls, name)
    if isinstance(member, property):
        return None
    return list(inspect.signature(member).parameters)


@pytest.mark.parametrize("group_cls", [RankGroup, FakeRankGroup])
def test_rank_groups_have_exactly_the_protocols_methods(group_cls):
    expected = public_members(RankGroupLike)
    extra = FAKE_SCRIPTING if group_cls is FakeRankGroup else set()
    assert public_members(group_cls) - extra == expected
    for name in expected:
        assert parameters(group_cls, name) == parameters(RankGroupLike, name), name


def test_both_groups_satisfy_the_protocol_at_runtime(tmp_path):
    real = RankGroup(str(tmp_path), "accelerator", 1.0)
    fake = FakeRankGroup(str(tmp_path))
    assert isinstance(real, RankGroupLike) and isinstance(fake, RankGroupLike)


@pytest.mark.parametrize("cluster_cls", [RayClusterView, FakeCluster])
def test_cluster_views_have_the_protocols_methods(cluster_cls):
    for name in public_members(ClusterView):
        assert parameters(cluster_cls, name) == parameters(ClusterView, name), name
