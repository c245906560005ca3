"""Hugging Face causal LMs as model specs (`model.hf`); the transformers model (its config is read by `hf_config`).

`model.hf` names a local directory or a model type:
- a directory with weights (`*.safetensors` / `pytorch_model*.bin`) and `config.json`: the
  weights are loaded (fine-tuning; our `ckpt consolidate` output is such a directory), each rank
  reading only the slices of the shards it holds (`models.hf_weights.DirectoryWeights`);
- a directory with only `config.json`, or a model type such as `llama`: random init from the
  config (nothing is downloaded), with `model.hf_config` overriding config fields.

The transformers model is held by `HFCausalLM`, which keeps the Llama family's module tree
(`model.embed_tokens`, `model.layers.N`, `model.norm`, `lm_head`, so parameter names are the
Hub's) but turns `layers` into a ModuleDict and runs its own forward over whatever a pipeline
stage holds. transformers' own forward, device map, weight loading and distributed init are
not used: FSDP, TP (`parallel.hf_tensor_parallel`) and PP are ours, and the model is built as a
skeleton and materialized shard by shard like our own (`models.materialize`), with
transformers' `_init_weights` distributions (`hf_param_init`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.hf_config import has_weights, load_config, shape_of
from raytrain_dt.models.materialize import ParamInit
from raytrain_dt.models.model_spec import ModelParts, ModelSpec
from raytrain_dt.models.moe import RouterTap

HF_PARTS = ModelParts(
    blocks="model.layers", first=("model.embed_tokens",), last=("model.norm", "lm_head")
)


class HFCausalLM(nn.Module):
    """Token ids (batch, seq) -> logits, over the parts of a transformers causal LM it holds."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        base = getattr(causal_lm, "model", None)
        missing = [
            name
            for name in ("embed_tokens", "layers", "norm", "rotary_emb")
            if getattr(base, name, None) is None
        ]
        if missing or getattr(causal_lm, "lm_head", None) is None:
            raise ConfigError(
                f"model.hf: {type(causal_lm).__name__} is not a Llama-family causal LM "
                f"(missing {', '.join(missing) or 'lm_head'})"
            )
        # ModuleDict keyed by index: the same parameter names as the ModuleList, and stages
        # can drop layers without renumbering the rest.
        base.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers)})
        self.config = causal_lm.config
        self.model = base
        self.lm_head = causal_lm.lm_head
        for layer in base.layers.values():
            tap_moe_block(getattr(layer, "mlp", None), self.config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds None for what it does not own (see `ModelParts`).
        base = self.model
        h = tokens if base.embed_tokens is None else base.embed_tokens(tokens)
        positions = torch.arange(h.shape[1], device=h.device)[None]
        rope = base.rotary_emb(h, positions)
        for layer in base.layers.values():
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out
        if base.norm is not None:
            h = base.norm(h)
        return h if self.lm_head is None else self.lm_head(h)


def tap_moe_block(block: nn.Module | None, config) -> None:
    """Give a transformers MoE block (Mixtral, Qwen2/3-MoE: a `gate` router returning
    (logits, weights, experts) and `experts`) a `models.moe.RouterTap`: its routing is counted
    into the step's router statistics and its load-balancing loss (transformers' own formula,
    n_experts * sum_e f_e * P_e, here per sequence, weighted by router_aux_loss_coef) is
    attached to its output, as for our MoE blocks. transformers adds that loss only in its
    own forward (`output_router_logits`), which ours replaces. No capacity: none drop."""
    gate = getattr(block, "gate", None)
    if gate is None or getattr(block, "experts", None) is None or not hasattr(gate, "top_k"):
        return
    n_experts = gate.num_experts
    block.router_tap = RouterTap(n_experts, getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    routing: dict = {}

    def keep_routing(_module, _inputs, output) -> None:
        routing["logits"], _, routing["experts"] = output

    def attach(module, _inputs, output: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = output.shape
        scores = torch.softmax(routing.pop("logits").float(), dim=-1).view(batch, seq_len, -1)
        experts = routing.pop("experts").view(batch, seq_len, -1)
        return module.router_tap.attach(output, scores, experts)

    gate.register_forward_hook(keep_routing)
    block.register_forward_hook(attach)


@dataclass(frozen=True)
class HFOptions:
    """What `build_hf` and `hf_param_init` need: the config's source and overrides, and the
    std of its normal init (`initializer_range`)."""

    source: str
    overrides: dict = field(default_factory=dict)
    init_std: float = 0.02


def build_hf(options: HFOptions, max_seq_len: int) -> HFCausalLM:
    """Factory of `hf_spec`: the model from its config (weights come from `materialize`)."""
    from transformers import AutoModelForCausalLM

    config = load_config(options.source, options.overrides)
    return HFCausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def hf_param_init(options: HFOptions, name: str, module: nn.Module) -> ParamInit:
    """transformers' `PreTrainedModel._init_weights` for the Llama family's modules: linear and
    embedding weights normal(initializer_range) (the padding row 0), biases 0, norms 1."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return ParamInit.zeros()
    if isinstance(module, nn.Linear):
        return ParamInit.normal(options.init_std)
    if isinstance(module, nn.Embedding):
        padding = () if module.padding_idx is None else (module.padding_idx,)
        return ParamInit.normal(options.init_std, zero_rows=padding)
    kind = type(module).__name__
    if "RMSNorm" in kind or "LayerNorm" in kind:
        return ParamInit.ones()
    # Mixture-of-experts blocks (Mixtral, Qwen-MoE): the stacked experts' 3-D weights and the
    # router's weight, both normal(initializer_range) as their `_init_weights` draws them.
    if kind.endswith(("Experts", "TopKRouter")):
        return ParamInit.normal(options.init_std)
    raise ConfigError(
        f"model.hf: no initialisation rule for {name} (a {kind}); "
        "only Llama-family modules are supported"
    )


def hf_spec(source: str, overrides: dict | None = None, init: str = "auto") -> ModelSpec:
    """A spec for `model.hf`. init: auto (weights when the directory has them), random, weights."""
    overrides = overrides or {}
    config = load_config(source, overrides)
    if init not in ("auto", "random", "weights"):
        raise ConfigError(f"model.hf_init: {init!r} is not one of auto, random, weights")
    load_weights = init == "weights" or (init == "auto" and has_weights(source))
    if load_weights and not has_weights(source):
        raise ConfigError(f"model.hf: {source} holds no weights (model.hf_init=weights)")
    return ModelSpec(
        name=f"hf:{config.model_type}",
        shape=shape_of(config),
        factory=build_hf,
        options=HFOptions(source, overrides, getattr(config, "initializer_range", None) or 0.02),
        parts=HF_PARTS,
        tensor_parallel="raytrain_dt.parallel.hf_tensor_parallel:apply_hf_tensor_parallel",
        # transformers' attention takes the whole sequence; no ring for it (yet).
        context_parallel=None,
        vocab_size=config.vocab_size,
        param_init=hf_param_init,
        weights_dir=source if load_weights else None,
    )
