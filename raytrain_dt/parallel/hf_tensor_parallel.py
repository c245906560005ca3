"""Tensor parallelism for Hugging Face Llama-family models, from the model's own TP plan.

transformers ships a plan per architecture (`config.base_model_tp_plan`, e.g.
`{"layers.*.self_attn.q_proj": "colwise", ...}`, and the head's `lm_head:
colwise_gather_output`); its style names are mapped here onto DTensor's ColwiseParallel and
RowwiseParallel and applied with `parallelize_module` per block. transformers' own
distributed init is not used. Where a config carries no plan, the Llama family's (the same
Megatron split our decoder uses) is written out below.

As for our decoder, the embedding is vocab-parallel with a replicated output, the head's logits
are gathered, and norms hold Replicate DTensors, so every parameter lives on the tp mesh.
Sequence parallelism is not offered for these models yet.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from raytrain_dt.parallel.tensor_parallel import _replicate

LLAMA_FAMILY_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
}


def block_plan(base_model_tp_plan: dict[str, str] | None) -> dict:
    """`layers.*.<path>: style` entries -> a per-block `parallelize_module` plan."""
    plan = {}
    for pattern, style in (base_model_tp_plan or LLAMA_FAMILY_PLAN).items():
        if not pattern.startswith("layers.*."):
            continue  # embedding/norm entries: handled below the same way for every model
        if style not in _STYLES:
            raise ValueError(
                f"parallel.tp: the model's TP plan uses style {style!r} for {pattern}, which is "
                f"not supported (supported: {', '.join(_STYLES)})"
            )
        plan[pattern.removeprefix("layers.*.")] = _STYLES[style]()
    return plan


def apply_hf_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool
) -> None:
    config = model.config
    tp = tp_mesh.size()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"parallel.tp: {tp} must divide num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads}"
        )
    if sequence_parallel:
        raise ValueError("parallel.sequence_parallel: not supported for model.hf models yet")
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("parallel.tp: tied embeddings with tensor parallelism are not supported")
    plan = block_plan(getattr(config, "base_model_tp_plan", None))
    base = model.model
    for block in base.layers.values():
        parallelize_module(block, tp_mesh, plan)
        # Whatever the plan leaves out (the norms) is replicated on the tp mesh.
        for name, module in block.named_modules():
            if name not in plan and any(True for _ in module.parameters(recurse=False)):
                _replicate(module, tp_mesh)
    if base.embed_tokens is not None:
        parallelize_module(
            base.embed_tokens,
            tp_mesh,
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        )
    if base.norm is not None:
        _replicate(base.norm, tp_mesh)
    if model.lm_head is not None:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
