"""The layout equivalence matrix: every engine layout trains like the single-process reference.

One pool of 4 spawned processes (no Ray) runs layout after layout, 5 optimizer steps of 2
micro-batches each, and the losses and final full parameters must match `reference_run` within
1e-5. The tiny model has 4 layers, so interleaved pp=2 x 2 virtual stages holds 1 layer a stage.
DeepSpeed layouts run in the same pool (`engines.deepspeed_engine.initialize_deepspeed` resets
DeepSpeed's process-global groups for each new process group).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from matrix import GLOBAL_BATCH, STEPS, cfg, pool, reference
from reference import load_checkpoint_params

from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.parallel_dims import ParallelDims

GRAD_ACCUM = 2


def _layout(zero: int = 3, **kw) -> Layout:
    options = {
        k: kw.pop(k)
        for k in (
            "activation_checkpointing",
            "sequence_parallel",
            "pp_schedule",
            "virtual_stages",
            "offload_optimizer",
            "defer_grad_sync",
            "pp_layers",
        )
        if k in kw
    }
    dims = ParallelDims(world_size=_product(kw), **kw)
    return Layout(
        dims=dims,
        zero_stage=zero,
        micro_batch=GLOBAL_BATCH // (GRAD_ACCUM * dims.dp),
        grad_accum=GRAD_ACCUM,
        **options,
    )


def _padded(zero: int, **degrees) -> Layout:
    """A layout of 3 DP ranks whose slots (micro_batch 2 x GRAD_ACCUM) exceed GLOBAL_BATCH."""
    dims = ParallelDims(world_size=_product(degrees), **degrees)
    per_rank = -(-GLOBAL_BATCH // dims.dp)
    return Layout(
        dims, zero, -(-per_rank // GRAD_ACCUM), GRAD_ACCUM, real_global_batch=GLOBAL_BATCH
    )


def _product(degrees: dict) -> int:
    out = 1
    for v in degrees.values():
        out *= v
    return out


LAYOUTS = {
    "ddp": _layout(zero=0, dp_replicate=2),
    "fsdp2-full": _layout(zero=3, dp_shard=2),
    "fsdp2-grad-op+ac": _layout(zero=2, dp_shard=2, activation_checkpointing=True),
    "hsdp-2x2": _layout(zero=3, dp_replicate=2, dp_shard=2),
    "tp2": _layout(tp=2),
    "tp2+sp": _layout(tp=2, sequence_parallel=True),
    "dp2xtp2+sp": _layout(dp_shard=2, tp=2, sequence_parallel=True),
    "dp2xtp2": _layout(dp_shard=2, tp=2),
    "pp2-gpipe": _layout(pp=2, pp_schedule="gpipe"),
    "pp2-1f1b": _layout(pp=2, pp_schedule="1f1b"),
    "pp2-interleaved": _layout(pp=2, pp_schedule="interleaved", virtual_stages=2),
    "pp2xtp2": _layout(pp=2, tp=2),
    # Uneven stages: 4 layers on 3 stages (balanced: 2, 1, 1; GPipe, as 1F1B needs a
    # micro-batch per stage), and a pinned 3 + 1 split.
    "pp3-uneven": _layout(pp=3, pp_schedule="gpipe"),
    "pp2-pinned-3+1": _layout(pp=2, pp_layers=(3, 1)),
    "pp2xdp2": _layout(pp=2, dp_shard=2),
    # CPUOffloadPolicy: shards, gradients and the optimizer step live in host memory.
    "fsdp2-full+offload": _layout(zero=3, dp_shard=2, offload_optimizer=True),
    # ZeRO-1 accumulates without sync; stages 2 and 3 reduce every micro-step unless the
    # layout defers the reduce-scatter to the final one (engine.grad_sync=final).
    "fsdp2-zero1": _layout(zero=1, dp_shard=2),
    "fsdp2-full+deferred-sync": _layout(zero=3, dp_shard=2, defer_grad_sync=True),
    # dp=3 does not divide the global batch of 8: the ranks read 2/3/3 samples in 4 slots each
    # (rank 0's second micro-batch is all padding), weighted so the gradient is the reference's.
    "fsdp2-full-dp3-padded": _padded(zero=3, dp_shard=3),
    "ddp-dp3-padded": _padded(zero=0, dp_replicate=3),
    # Per-row losses of vocab-sharded DTensor logits (loss_parallel): 10 slots, 8 real.
    "tp2+sp-padded": Layout(
        ParallelDims(world_size=2, tp=2),
        3,
        5,
        GRAD_ACCUM,
        sequence_parallel=True,
        real_global_batch=GLOBAL_BATCH,
    ),
}


# DeepSpeed ZeRO-1 over our pipeline stages and schedules (the one DeepSpeed + pipeline
# combination); the DP ranks of each stage shard its optimizer.
DEEPSPEED_PIPELINE_LAYOUTS = {
    "ds-zero1-pp2-1f1b": _layout(zero=1, pp=2, pp_schedule="1f1b"),
    "ds-zero1-pp2-interleaved+ac": _layout(
        zero=1, pp=2, pp_schedule="interleaved", virtual_stages=2, activation_checkpointing=True
    ),
    "ds-zero1-pp2xdp2": _layout(zero=1, pp=2, dp_shard=2),
    # ZeRO-Offload: each stage's optimizer partition steps on the host.
    "ds-zero1-pp2xdp2-gpipe+offload": _layout(
        zero=1, pp=2, dp_shard=2, pp_schedule="gpipe", offload_optimizer=True
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_single_process(pool, cfg, reference, name):
    _assert_equals_reference(pool.run(cfg, LAYOUTS[name], STEPS), reference)


@pytest.mark.parametrize("name", list(DEEPSPEED_PIPELINE_LAYOUTS))
def test_deepspeed_pipeline_equals_single_process(pool, cfg, reference, name):
    deepspeed = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, name="deepspeed"))
    _assert_equals_reference(
        pool.run(deepspeed, DEEPSPEED_PIPELINE_LAYOUTS[name], STEPS), reference
    )


def _assert_equals_reference(result, reference) -> None:
    ref_losses, ref_params = reference
    assert result.losses == pytest.approx(ref_losses, abs=1e-5)
    assert result.params.keys() == ref_params.keys()
    for key, value in ref_params.items():
        torch.testing.assert_close(result.params[key], value, atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize(
    ("engine", "layout"),
    [("fsdp2", LAYOUTS["fsdp2-full"]), ("deepspeed", _layout(zero=1, dp_shard=2))],
    ids=["fsdp2", "deepspeed-zero1"],
)
def test_bf16_mixed_precision_tracks_the_fp32_reference(pool, cfg, reference, engine, layout):
    """bf16 as `select_device("bf16")` sets it (bf16 parameters in forward and backward, fp32
    reduction and fp32 master weights), run on CPU: FSDP2's MixedPrecisionPolicy, and
    DeepSpeed's bf16 ZeRO optimizer with fp32 gradient accumulation (the mix DeepSpeed
    refuses without ZeRO, first seen on an H200, where the CPU's fp32 runs hid it).

    bf16's unit roundoff is 2^-9 (about 2e-3): no logit, and so no mean loss, can be off by
    more relative to fp32 without the bf16 path being wrong (measured: up to 2.2e-4 over the
    5 steps). For the weights, the bf16 run must stay far closer to the reference than the
    reference moved from the initial weights (10%; measured: 3% at worst): it follows the
    same trajectory.
    """
    from raytrain_dt.control.run_setup import model_shape
    from raytrain_dt.models.llama import build_model

    ref_losses, ref_params = reference
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, name=engine))
    result = pool.run(cfg, layout, STEPS, precision="bf16")
    assert result.losses == pytest.approx(ref_losses, rel=2**-9)
    # Not the fp32 path in disguise: bf16 rounding shows in the losses.
    assert max(abs(a - b) for a, b in zip(result.losses, ref_losses, strict=True)) > 1e-5
    initial = build_model(model_shape(cfg), cfg.data.seq_len, cfg.run.seed).state_dict()
    for key, value in ref_params.items():
        assert result.params[key].dtype == torch.float32, key  # fp32 master weights
        moved = torch.linalg.vector_norm(value - initial[key])
        off = torch.linalg.vector_norm(result.params[key] - value)
        assert off < 0.1 * moved, (key, float(off), float(moved))


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ("fsdp2-full", "pp2-interleaved"),
        ("pp2-1f1b", "dp2xtp2"),
        ("pp2-pinned-3+1", "pp3-uneven"),
    ],
    ids=["pp1-to-pp2", "pp2-to-pp1", "pp2-3+1-to-pp3-uneven"],
)
def test_checkpoint_moves_between_pipeline_layouts(pool, cfg, reference, tmp_path, saved, loaded):
    """3 steps in one layout, a DCP checkpoint, the last 2 steps in another: still the reference.

    The checkpoint holds the full model's names whatever the pipeline split, so its keys equal a
    pp=1 checkpoint's, and model and optimizer state reshard across pp on load.
    """
    ref_losses, ref_params = reference
    first = pool.run(cfg, LAYOUTS[saved], 3, checkpoint_dir=str(tmp_path / "a"))
    second = pool.run(
        cfg,
        LAYOUTS[loaded],
        2,
        load_dir=str(tmp_path / "a"),
        start_step=3,
        checkpoint_dir=str(tmp_path / "b"),
    )
    assert first.checkpoint_keys == second.checkpoint_keys
    assert any(k.startswith("optim.state.layers.3.") for k in first.checkpoint_keys)
    assert first.losses + second.losses == pytest.approx(ref_losses, abs=1e-5)
    for key, value in ref_params.items():
        torch.testing.assert_close(second.params[key], value, atol=1e-5, rtol=0, msg=key)
    gathered = load_checkpoint_params(str(tmp_path / "b"))
    assert gathered.keys() == ref_params.keys()
    for key, value in ref_params.items():
        torch.testing.assert_close(gathered[key], value, atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        (DEEPSPEED_PIPELINE_LAYOUTS["ds-zero1-pp2xdp2"], _layout(zero=1, dp_shard=2)),
        (_layout(zero=1, dp_shard=2), DEEPSPEED_PIPELINE_LAYOUTS["ds-zero1-pp2-1f1b"]),
        # Activation checkpointing on one side only: the same names in DeepSpeed's files.
        (_layout(zero=2, dp_shard=2, activation_checkpointing=True), _layout(zero=2, dp_shard=2)),
        (DEEPSPEED_PIPELINE_LAYOUTS["ds-zero1-pp2-interleaved+ac"], _layout(zero=1, dp_shard=2)),
    ],
    ids=["pp2xdp2-to-dp2", "dp2-to-pp2", "dp2+ac-to-dp2", "pp2+ac-to-dp2"],
)
def test_deepspeed_checkpoint_moves_across_pipeline_split(
    pool, cfg, reference, tmp_path, saved, loaded
):
    """DeepSpeed's own checkpoint, 3 steps in one layout and the last 2 in another (pipeline
    split and DP size changed: the universal conversion, stage by stage; or activation
    checkpointing dropped): still the reference. Every stage's files name parameters as the
    unsplit model without activation checkpointing does."""
    ref_losses, ref_params = reference
    deepspeed = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, name="deepspeed"))
    first = pool.run(deepspeed, saved, 3, checkpoint_dir=str(tmp_path))
    names = set()
    for states in (tmp_path / "ds").glob("mp_rank_*_model_states.pt"):
        names |= set(torch.load(states, weights_only=False)["module"])
    assert names == ref_params.keys()
    second = pool.run(deepspeed, loaded, 2, load_dir=str(tmp_path), start_step=3)
    assert first.losses + second.losses == pytest.approx(ref_losses, abs=1e-5)
    for key, value in ref_params.items():
        torch.testing.assert_close(second.params[key], value, atol=1e-5, rtol=0, msg=key)


def test_stage_split_balances_embedding_and_head():
    from raytrain_dt.topology.pipeline_stages import stage_indices, stage_layer_counts

    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(4, 4) == [1, 1, 1, 1]
    # The end stages carry the embedding and the head, so they get fewer blocks; stage costs
    # (blocks + 1 at each end) stay within one block of each other.
    assert stage_layer_counts(8, 4) == [2, 3, 2, 1]
    assert stage_layer_counts(32, 4) == [8, 9, 8, 7]
    assert stage_indices(1, 2, 2) == [1, 3]


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"pp_schedule": "1f1b", "virtual_stages": 2}, "parallel.virtual_stages"),
        ({"pp_schedule": "interleaved", "virtual_stages": 4}, "parallel.pp"),
        (
            {"pp_schedule": "interleaved", "virtual_stages": 2, "grad_accum": 3},
            "trainer.grad_accum",
        ),
        ({"grad_accum": 1}, "trainer.grad_accum"),
        ({"pp_layers": (3, 2)}, "parallel.pp_layers"),
    ],
)
def test_invalid_pipeline_layouts_name_the_key(changes, key):
    from raytrain_dt.parallel.pipeline_parallel import validate_pipeline

    layout = dataclasses.replace(_layout(pp=2), **changes)
    with pytest.raises(ValueError, match=key):
        validate_pipeline(layout, n_layers=4, tie_embeddings=False)


# Shards cut along every placement the engines use: uneven FSDP chunks (dp=3), HSDP, FSDP over
# TP shards (strided), sequence parallelism, pipeline stages with and without TP, host offload.
MATERIALIZED = [
    "fsdp2-full-dp3-padded",
    "hsdp-2x2",
    "dp2xtp2+sp",
    "pp2-interleaved",
    "pp2xtp2",
    "fsdp2-full+offload",
]


@pytest.mark.parametrize("name", MATERIALIZED)
def test_every_layout_starts_from_the_single_process_weights(pool, cfg, name):
    """Ranks materialize only their shards, yet the model they hold together is exactly the one
    `ModelSpec.build` makes in one process (the reference's initial weights)."""
    from raytrain_dt.models.model_spec import model_spec

    initial = model_spec(cfg).build(cfg.data.seq_len, cfg.run.seed).state_dict()
    result = pool.run(cfg, LAYOUTS[name], 0)
    assert result.params.keys() == initial.keys()
    for key, value in initial.items():
        torch.testing.assert_close(result.params[key], value, atol=0, rtol=0, msg=key)


@pytest.fixture(scope="module")
def hf_weights(cfg, tmp_path_factory):
    """A Hugging Face-format directory (our consolidation's names and config.json) holding
    weights no random init gives: the full model of another seed."""
    import json

    from safetensors.torch import save_file

    from raytrain_dt.checkpoint.export import hf_config, hf_name
    from raytrain_dt.control.run_setup import model_shape
    from raytrain_dt.models.llama import build_model

    shape = model_shape(cfg)
    model = build_model(shape, cfg.data.seq_len, seed=99)
    path = tmp_path_factory.mktemp("init_from")
    (path / "config.json").write_text(json.dumps(hf_config(shape, cfg.data.seq_len)))
    save_file(
        {hf_name(n): p.detach().clone() for n, p in model.named_parameters()},
        path / "model.safetensors",
    )
    return str(path), model.state_dict()


@pytest.mark.parametrize("name", ["fsdp2-full-dp3-padded", "dp2xtp2", "pp2xtp2"])
def test_init_from_gives_each_rank_the_slices_it_holds(pool, cfg, hf_weights, name):
    path, expected = hf_weights
    result = pool.run(cfg, LAYOUTS[name], 0, init_from=path)
    for key, value in expected.items():
        torch.testing.assert_close(result.params[key], value, atol=0, rtol=0, msg=key)


def test_deepspeed_zero3_builds_partitioned_and_equals_single_process(pool, cfg, reference):
    """ZeRO-3 builds the model partitioned (`zero.Init`) and fills each rank's partitions:
    it still trains exactly like the single-process reference."""
    deepspeed = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, name="deepspeed"))
    _assert_equals_reference(pool.run(deepspeed, _layout(zero=3, dp_shard=2), STEPS), reference)


def test_deepspeed_zero3_loads_init_from_partitions(pool, cfg, hf_weights):
    path, expected = hf_weights
    deepspeed = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, name="deepspeed"))
    result = pool.run(deepspeed, _padded(zero=3, dp_shard=3), 0, init_from=path)
    for key, value in expected.items():
        torch.testing.assert_close(result.params[key], value, atol=0, rtol=0, msg=key)


def test_deepspeed_padded_layout_equals_single_process(pool, cfg, reference):
    """DeepSpeed ZeRO-2 on the padded 3-rank layout: DeepSpeed divides each micro-step's loss
    by the accumulation count and averages gradients over DP itself, and the padding-weighted
    loss (`engines.micro_loss`) still gives the reference's gradient. Last in the module: a
    process cannot start DeepSpeed again once its process group was destroyed."""
    import dataclasses

    ds_cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, name="deepspeed"))
    layout = _padded(zero=2, dp_shard=3)
    ref_losses, ref_params = reference
    result = pool.run(ds_cfg, layout, STEPS)
    assert result.losses == pytest.approx(ref_losses, abs=1e-5)
    for key, value in ref_params.items():
        torch.testing.assert_close(result.params[key], value, atol=1e-5, rtol=0, msg=key)


# DeepSpeed pipelines on uneven splits: the pinned 3 + 1 split and 4 layers on 3 stages.
DS_PINNED_3_1 = _layout(zero=1, pp=2, pp_layers=(3, 1))
DS_EVEN_2_2 = _layout(zero=1, pp=2, pp_schedule="1f1b")
DS_PP3_UNEVEN = _layout(zero=1, pp=3, pp_schedule="gpipe")


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(DS_PINNED_3_1, DS_EVEN_2_2), (DS_PINNED_3_1, DS_PP3_UNEVEN), (DS_PP3_UNEVEN, DS_PINNED_3_1)],
    ids=["pp2-3+1-to-pp2-2+2", "pp2-3+1-to-pp3-2+1+1", "pp3-2+1+1-to-pp2-3+1"],
)
def test_deepspeed_checkpoint_moves_across_uneven_splits(
    pool, cfg, reference, tmp_path, saved, loaded
):
    """DeepSpeed's own checkpoint of one uneven split, resumed on another (the same number of
    stages and DP size included, where DeepSpeed's stage files no longer match the stages):
    3 steps, then the last 2, equal to the reference."""
    ref_losses, ref_params = reference
    deepspeed = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, name="deepspeed"))
    first = pool.run(deepspeed, saved, 3, checkpoint_dir=str(tmp_path))
    second = pool.run(deepspeed, loaded, 2, load_dir=str(tmp_path), start_step=3)
    assert first.losses + second.losses == pytest.approx(ref_losses, abs=1e-5)
    for key, value in ref_params.items():
        torch.testing.assert_close(second.params[key], value, atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize(
    ("saved_engine", "saved", "loaded"),
    [
        ("deepspeed", DS_PINNED_3_1, _layout(pp=3, pp_schedule="gpipe")),
        ("fsdp2", _layout(pp=3, pp_schedule="gpipe"), DS_PINNED_3_1),
    ],
    ids=["ds-pp2-3+1-to-fsdp2-pp3-2+1+1", "fsdp2-pp3-2+1+1-to-ds-pp2-3+1"],
)
def test_conversion_between_engines_on_uneven_splits(
    pool, cfg, reference, tmp_path, saved_engine, saved, loaded
):
    """`raytrain-dt ckpt convert`'s read and write between an uneven DeepSpeed pipeline and an
    uneven FSDP2 one (in this process, as the tool runs): 3 steps in one, the converted
    checkpoint, the last 2 in the other, equal to the reference."""
    from raytrain_dt.control.run_setup import model_shape
    from raytrain_dt.tools.checkpoint_convert import (
        one_rank_layout,
        read_deepspeed,
        read_fsdp2,
        single_process_group,
        write_deepspeed,
        write_fsdp2,
    )

    ref_losses, ref_params = reference
    engines = {
        name: dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, name=name))
        for name in ("fsdp2", "deepspeed")
    }
    loaded_engine = "fsdp2" if saved_engine == "deepspeed" else "deepspeed"
    first = pool.run(engines[saved_engine], saved, 3, checkpoint_dir=str(tmp_path / "a"))
    shape, one_rank = model_shape(cfg), one_rank_layout(saved.as_dict(), 1)
    # The converted checkpoint is a plain 1-rank one, whatever split wrote it.
    assert (one_rank.dims.pp, one_rank.pp_layers, one_rank.virtual_stages) == (1, (), 1)
    with single_process_group():
        if saved_engine == "deepspeed":
            state, step = read_deepspeed(str(tmp_path / "a"), shape, cfg, one_rank)
            write_fsdp2(str(tmp_path / "b"), state, step, shape, cfg)
        else:
            state, step = read_fsdp2(str(tmp_path / "a"))
            write_deepspeed(str(tmp_path / "b"), state, step, shape, cfg, one_rank)
    assert state.keys() == ref_params.keys() and step == 3
    second = pool.run(engines[loaded_engine], loaded, 2, load_dir=str(tmp_path / "b"), start_step=3)
    assert first.losses + second.losses == pytest.approx(ref_losses, abs=1e-5)
    for key, value in ref_params.items():
        torch.testing.assert_close(second.params[key], value, atol=1e-5, rtol=0, msg=key)
