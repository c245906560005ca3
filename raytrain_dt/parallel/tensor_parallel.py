"""Megatron-style tensor parallelism for the Llama decoder, with DTensor `parallelize_module`.

Column-parallel q/k/v and MLP gate/up projections, row-parallel attention output and MLP down
projections, so each block needs one all-reduce in forward and one in backward per sub-layer,
and the heads split evenly across TP ranks. The embedding is vocab-parallel (row-parallel over
the vocabulary) and the head is vocab-parallel with its logits gathered. Norms hold `Replicate`
DTensors, so every parameter lives on the same (dp, tp) mesh once FSDP2 shards it: the fused
(foreach) optimizer and clipping kernels cannot mix meshes.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

BLOCK_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
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
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
        for norm in (block.attention_norm, block.ffn_norm):
            _replicate(norm, tp_mesh)
    _replicate(model.norm, tp_mesh)
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Replicate()
            ),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )


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
