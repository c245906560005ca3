"""Megatron-style tensor (and sequence) parallelism for the Llama decoder via `parallelize_module`.

Column-parallel q/k/v and MLP gate/up projections, row-parallel attention output and MLP down
projections, so each block needs one all-reduce in forward and one in backward per sub-layer,
and the heads split evenly across TP ranks. The embedding is vocab-parallel (row-parallel over
the vocabulary) and so are the head and the loss: the head's logits stay sharded on the vocabulary
(`Shard(-1)`) and cross-entropy runs under `torch.distributed.tensor.parallel.loss_parallel`
(`loss_context`), which reduces the per-shard max and sum-exp instead of gathering the logits.

With sequence parallelism the residual stream between sub-layers is sharded along the sequence
(Shard(1)): norms run on their sequence slice, each all-reduce becomes a reduce-scatter after the
row-parallel projection plus an all-gather before the column-parallel ones, so activation memory
outside attention/MLP drops by the TP degree at the same communication volume.

Norms hold `Replicate` DTensors either way, so every parameter lives on the same (dp, tp) mesh
once FSDP2 shards it: the fused (foreach) optimizer and clipping kernels cannot mix meshes.
Modules a pipeline stage does not hold (None) are skipped.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def _block_plan(sequence_parallel: bool) -> dict:
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    if not sequence_parallel:
        return {
            **plan,
            "attention.wo": RowwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
    return {
        **plan,
        "attention_norm": SequenceParallel(),
        # Attention takes (x, rope): gather x's sequence shards once for q, k and v together;
        # rope is a plain full-length table and passes through untouched.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    shape = model.shape
    tp = tp_mesh.size()
    if shape.n_heads % tp or shape.n_kv_heads % tp:
        raise ValueError(
            f"parallel.tp: {tp} must divide model.n_heads={shape.n_heads} and "
            f"model.n_kv_heads={shape.n_kv_heads}"
        )
    if shape.tie_embeddings:
        raise ValueError(
            "parallel.tp: tied embeddings with tensor parallelism are not supported yet"
        )
    # The positions this rank holds: data.seq_len, or its cp rank's share under context
    # parallelism (applied first, it cuts the rotary table to those positions).
    seq_len = model.rope.shape[0]
    if sequence_parallel and seq_len % tp:
        raise ValueError(
            f"parallel.sequence_parallel: the {seq_len} positions a rank holds (data.seq_len / "
            f"parallel.cp) must be divisible by parallel.tp={tp}"
        )
    plan = _block_plan(sequence_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
        if not sequence_parallel:
            for norm in (block.attention_norm, block.ffn_norm):
                _replicate(norm, tp_mesh)
    # Shard(1) between the embedding, the blocks and the head when sequence-parallel.
    stream = Shard(1) if sequence_parallel else Replicate()
    root_plan: dict = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream
        )
    if model.norm is not None:
        if sequence_parallel:
            root_plan["norm"] = SequenceParallel()
        else:
            _replicate(model.norm, tp_mesh)
    if model.output is not None:
        # Logits stay sharded on the vocabulary (a DTensor): the loss runs vocab-parallel under
        # `loss_context`, so the (batch, seq, vocab) logits are never gathered.
        root_plan["output"] = ColwiseParallel(
            input_layouts=stream, output_layouts=Shard(-1), use_local_output=False
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)


def loss_context(tp_enabled: bool) -> contextlib.AbstractContextManager:
    """The context the loss's forward *and* backward must run in (vocab-parallel cross-entropy).

    Harmless for plain-tensor logits (a model whose plan gathers them), so an engine can enter
    it whenever TP is on.
    """
    return loss_parallel() if tp_enabled else contextlib.nullcontext()


def _replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Replicated parameters; plain tensors in and out, so neighbours need not know."""
    distribute_module(
        module,
        tp_mesh,
        input_fn=lambda _m, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
        ),
        output_fn=lambda _m, output, _mesh: output.to_local(),
    )
