"""Uneven pipeline stages: any pp up to the layer count, stage sizes balanced by cost (the end
stages carry the embedding and the head), `parallel.pp_layers` to pin the split, one split for
the planner's models and for the pipeline code."""

from __future__ import annotations

import itertools

import pytest

from raytrain_dt.config.load import load_config
from raytrain_dt.errors import ConfigError, PlanningError
from raytrain_dt.models.llama import build_model
from raytrain_dt.models.presets import PRESETS
from raytrain_dt.parallel.pipeline_parallel import split_model
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.memory import stage_params
from raytrain_dt.topology.parallel_dims import ParallelDims
from raytrain_dt.topology.pins import LayoutPins
from raytrain_dt.topology.pipeline_stages import (
    busiest_rank_share,
    end_cost,
    pipeline_degrees,
    split_of,
    stage_layer_counts,
)
from raytrain_dt.topology.planner import plan
from raytrain_dt.topology.published_runs import PUBLISHED_RUNS

L405 = PRESETS["llama-405b"]


def test_llama_405b_on_16_stages_is_llama_3s_split() -> None:
    # The Llama 3 paper's 16 stages: one block fewer on the first and the last.
    assert end_cost(L405) == 1
    assert split_of(L405, 16) == [7] + [8] * 14 + [7]
    assert busiest_rank_share(L405, 16) == pytest.approx(8 / 128)
    layer, head = L405.params_per_layer, L405.vocab_size * L405.dim
    assert stage_params(L405, 16) == max(8 * layer, 7 * layer + head + L405.dim)


def test_small_vocabulary_gives_an_even_split() -> None:
    gpt_1t = next(r for r in PUBLISHED_RUNS if r.label == "GPT 1008B").shape
    assert end_cost(gpt_1t) == 0  # a 51,200 x 25,600 head is 0.17 of a block
    assert split_of(gpt_1t, 64) == [2] * 64
    assert busiest_rank_share(gpt_1t, 64) == pytest.approx(1 / 64)


def _stage_costs(counts: list[int], end: int) -> list[int]:
    """Blocks plus the embedding's and the head's `end` blocks' worth on the end stages."""
    costs = list(counts)
    if len(costs) > 1:
        costs[0] += end
        costs[-1] += end
    return costs


@pytest.mark.parametrize("end", [0, 1])
def test_every_split_is_cost_balanced_per_stage_and_per_rank(end) -> None:
    # With an end cost of at most a block, both levellings reach within one block.
    for n_layers in range(1, 130):
        for pp in range(1, 17):
            for v in (1, 2, 3, 4):
                stages = pp * v
                if stages > n_layers:
                    continue
                counts = stage_layer_counts(n_layers, stages, end, pp)
                assert len(counts) == stages and sum(counts) == n_layers and min(counts) >= 1
                costs = _stage_costs(counts, end)
                where = (n_layers, pp, v, end, counts)
                # No stage costs more than one block above the cheapest one...
                assert max(costs) - min(costs) <= 1, where
                # ...and the dearest is as cheap as any split makes it.
                total = n_layers + (2 * end if stages > 1 else 0)
                assert max(costs) == max(1 + end if stages > 1 else 1, -(-total // stages))
                # The ranks holding the looped stages are balanced the same way.
                rank_costs = [sum(costs[r::pp]) for r in range(pp)]
                assert max(rank_costs) - min(rank_costs) <= 1, where


@pytest.mark.parametrize(
    ("preset", "pp", "v", "expected"),
    [
        # The Llama 3 paper's split: one block fewer on the first and the last stage.
        ("llama-405b", 16, 1, [7] + [8] * 14 + [7]),
        # Interleaved: 64 stages of 2 blocks, the end ones give a block to the embedding/head.
        ("llama-405b", 16, 4, [1] + [2] * 62 + [1]),
        # 80 blocks on 5 ranks x 4 stages, 82 blocks' worth of cost: every stage costs 4 or 5
        # and every rank 16 or 17, the dearer ones the earliest; no tail of 1s (not the
        # 4, 5 x 14, 2, 1 x 4 that filling stages to 5 in order gives).
        ("llama-70b", 5, 4, [4, 5] + [4] * 17 + [3]),
        # 80 blocks on 8 ranks x 4 stages: 2 or 3 each, ranks 10 or 11.
        ("llama-70b", 8, 4, [2] + [3] * 17 + [2] * 13 + [1]),
        # 40 blocks on 8 ranks x 4 stages (42 blocks' worth, ranks 5 or 6): eight 2-block
        # chunks, none on the stages that also carry the embedding or the head.
        ("llama-13b", 8, 4, [1] + [2] * 6 + [1] + [2] * 2 + [1] * 22),
        ("llama-405b", 8, 2, [7] + [8] * 14 + [7]),
        # 128 blocks' worth on 3 stages: 43, 43, 42 (torchtitan's split: the earliest dearer).
        ("llama-405b", 3, 1, [42, 43, 41]),
    ],
)
def test_interleaved_splits_of_the_big_presets(preset, pp, v, expected) -> None:
    shape = PRESETS[preset]
    counts = split_of(shape, pp, v)
    assert counts == expected
    costs = _stage_costs(counts, end_cost(shape))
    assert max(costs) - min(costs) <= 1
    rank_costs = [sum(costs[r::pp]) for r in range(pp)]
    assert max(rank_costs) - min(rank_costs) <= 1


def test_a_large_head_is_balanced_per_rank_too() -> None:
    # llama-1b: a 128,256 x 2,048 head is 4 blocks' worth. On 4 ranks x 2 stages the ends keep
    # one block each (cost 5), and the ranks holding them take one block on their other stage,
    # so every rank costs 6 (24 blocks' worth / 4); the end ranks used to cost 7 (1, 3, 3, 2,
    # 2, 2, 2, 1), which made them the pipeline's bottleneck.
    l1b = PRESETS["llama-1b"]
    assert end_cost(l1b) == 4
    counts = split_of(l1b, 4, 2)
    assert counts == [1, 3, 3, 1, 1, 3, 3, 1]
    costs = _stage_costs(counts, 4)
    assert [sum(costs[r::4]) for r in range(4)] == [6, 6, 6, 6]
    assert busiest_rank_share(l1b, 4, 2) == pytest.approx(6 / 24)


def _splits(n_layers: int, stages: int):
    """Every split of n_layers blocks into `stages` stages of at least one block."""
    for cuts in itertools.combinations(range(1, n_layers), stages - 1):
        bounds = (0, *cuts, n_layers)
        yield [b - a for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("end", [0, 1, 2, 4])
def test_no_split_has_a_cheaper_dearest_stage_or_busiest_rank(end) -> None:
    # Against every possible split of up to 12 blocks: the dearest stage is as cheap as it can
    # be, and under that the busiest rank (which sets an interleaved pipeline's pace) too.
    for n_layers in range(2, 13):
        for pp in range(1, 5):
            for v in (1, 2, 3):
                stages = pp * v
                if not 1 < stages <= n_layers:
                    continue

                def worst(counts, pp=pp):
                    costs = _stage_costs(counts, end)
                    return max(costs), max(sum(costs[r::pp]) for r in range(pp))

                best = min(worst(c) for c in _splits(n_layers, stages))
                counts = stage_layer_counts(n_layers, stages, end, pp)
                assert worst(counts) == best, (n_layers, pp, v, end, counts)


@pytest.mark.parametrize("preset", ["llama-7b", "llama-13b", "llama-70b", "llama-405b"])
def test_interleaved_chunks_differ_only_by_what_the_ends_force(preset) -> None:
    # Every degree the planner tries, with and without interleaving: the chunks sum to the
    # layer count, none is empty, the middle ones are within a block of each other, the end
    # ones (carrying the embedding or the head) at most a block plus `end_cost` smaller, and
    # every stage's cost within a block of every other's.
    shape = PRESETS[preset]
    end = end_cost(shape)
    assert end <= 1
    for pp in pipeline_degrees(shape.n_layers):
        for v in (1, 2, 4):
            if not 1 < pp * v <= shape.n_layers:
                continue
            counts = split_of(shape, pp, v)
            where = (preset, pp, v, counts)
            assert len(counts) == pp * v and sum(counts) == shape.n_layers, where
            assert min(counts) >= 1, where
            middle = counts[1:-1] or counts
            assert max(middle) - min(middle) <= 1, where
            assert max(middle) - min(counts) <= 1 + end, where
            assert max(counts) == max(middle), where
            costs = _stage_costs(counts, end)
            assert max(costs) - min(costs) <= 1, where


def test_interleaved_split_model_puts_the_embedding_and_head_on_the_end_stages() -> None:
    # tiny (4 blocks) on pp=2 x v=2: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3; only
    # stage 0 keeps the embedding and only stage 3 the head.
    tiny = PRESETS["tiny"]
    dims = ParallelDims(world_size=2, pp=2, dp_replicate=1, dp_shard=1, tp=1)
    layout = Layout(dims, 0, 1, 4, pp_schedule="interleaved", virtual_stages=2)
    assert split_of(tiny, 2, 2) == [1, 1, 1, 1]
    rank0 = split_model(build_model(tiny, 64, seed=0), layout, pp_rank=0)
    rank1 = split_model(build_model(tiny, 64, seed=0), layout, pp_rank=1)
    assert [list(p.layers.keys()) for p in rank0] == [["0"], ["2"]]
    assert [list(p.layers.keys()) for p in rank1] == [["1"], ["3"]]
    assert rank0[0].tok_embeddings is not None and rank0[1].tok_embeddings is None
    assert all(p.tok_embeddings is None for p in rank1)
    assert rank1[1].output is not None and rank1[0].output is None
    assert all(p.output is None for p in rank0)


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="5 pipeline stages for 4 layers"):
        stage_layer_counts(4, 5)


def test_pinned_split_and_interleaving_follow_the_stages_a_rank_holds() -> None:
    assert split_of(L405, 4, pp_layers=(30, 33, 33, 30)) == [30, 33, 33, 30]
    # v=2 on pp=2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
    share = busiest_rank_share(L405, 2, 2, pp_layers=(10, 50, 50, 16))
    assert share == pytest.approx((50 + 16 + 1) / 128)


def test_pipeline_degrees_are_layer_divisors_and_powers_of_two() -> None:
    assert pipeline_degrees(126) == [1, 2, 3, 4, 6, 7, 8, 9, 14, 16, 18, 21, 32, 42, 63, 64, 126]


def test_llama_405b_plans_at_pp_16() -> None:
    topo = Topology(1024, 8)
    p = plan(L405, topo, global_batch=2048, seq_len=8192, pins=LayoutPins(tp=8, pp=16))
    lay = p.best.layout
    assert (lay.dims.tp, lay.dims.pp, lay.dims.dp) == (8, 16, 64)
    # Unpinned, the schedule is the planner's: interleaving cuts the 15/32 bubble.
    assert lay.pp_schedule == "interleaved" and lay.virtual_stages == 4
    t = p.best.step_time
    assert t.bubble_s == pytest.approx((t.compute_s + t.tp_comm_s) * 15 / (4 * 32))


def test_pp_layers_from_the_config_reach_the_layout() -> None:
    cfg = load_config("conf/test.yaml", ["parallel.pp_layers=[3,1]", "parallel.pp=2"])
    pins = LayoutPins.from_config(cfg)
    assert pins.pp_layers == (3, 1)
    tiny = PRESETS["tiny"]
    lay = plan(tiny, Topology(1, 2), global_batch=8, seq_len=64, pins=pins).best.layout
    assert lay.dims.pp == 2 and lay.pp_layers == (3, 1)
    assert Layout.from_dict(lay.as_dict()) == lay  # a layout record round-trips the split


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.pp_layers=[2,0]"], r"^parallel\.pp_layers: every stage needs >= 1 layer"),
        (
            ["parallel.pp_layers=[2,2]", "parallel.pp=4"],
            r"^parallel\.pp_layers: 2 stages, but parallel\.pp=4 x parallel\.virtual_stages=1 = 4$",
        ),
    ],
)
def test_bad_pp_layers_are_one_line_naming_the_key(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("conf/test.yaml", overrides)


def test_split_model_cuts_the_pinned_split() -> None:
    tiny = PRESETS["tiny"]
    dims = ParallelDims(world_size=2, pp=2, dp_replicate=1, dp_shard=1, tp=1)
    layout = Layout(dims, 0, 1, 4, pp_layers=(3, 1))
    first = split_model(build_model(tiny, 64, seed=0), layout, pp_rank=0)[0]
    last = split_model(build_model(tiny, 64, seed=0), layout, pp_rank=1)[0]
    assert list(first.layers.keys()) == ["0", "1", "2"] and first.output is None
    assert list(last.layers.keys()) == ["3"] and last.tok_embeddings is None


def test_no_1f1b_layout_has_fewer_micro_batches_than_stages() -> None:
    tiny, topo = PRESETS["tiny"], Topology(1, 4)
    best = plan(tiny, topo, global_batch=4, seq_len=64, pins=LayoutPins(pp=4)).best.layout
    assert (best.micro_batch, best.grad_accum) == (1, 4)
    with pytest.raises(PlanningError, match="^nothing fits"):
        plan(tiny, topo, global_batch=4, seq_len=64, pins=LayoutPins(pp=4, micro_batch=2))
    gpipe = LayoutPins(pp=4, micro_batch=2, pp_schedule="gpipe")
    assert plan(tiny, topo, global_batch=4, seq_len=64, pins=gpipe).best.layout.grad_accum == 2
