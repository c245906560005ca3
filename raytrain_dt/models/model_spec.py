"""`ModelSpec`: everything the engines, the pipeline and the planner need to know about a model.

A spec is pure, picklable data, shipped to every rank actor: a factory reference plus its
options (never a live model), the shape facts the planner prices (`ModelShape`), the module
paths of the repeated blocks (wrapped by FSDP, activation-checkpointed, split between pipeline
stages) and of the modules only the first or the last pipeline stage holds, the loss, and the
tensor-parallel plan. Callables may be given as objects (pickled by reference, so they must be
module-level) or as "package.module:name" strings resolved on first use, which keeps imports
such as torch.distributed or transformers out of the processes that never call them.

Our Llama decoder is one spec (`llama_spec`); `model.hf` builds a transformers one
(`raytrain_dt.models.hf`), imported only when a config asks for it.

Ranks never build the full model: they take the spec's `skeleton` (parameters on the meta
device), shard it, and materialize their shards (`models.materialize`). `build` gives the whole
model in one process (the tests' reference, offline tools) by the same path, so its weights are
the ones every layout starts from.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.config_shape import config_shape
from raytrain_dt.models.materialize import (
    ParamInit,
    WeightSource,
    initial_weights,
    materialize,
    parameters_on_meta,
)
from raytrain_dt.models.presets import ModelShape

# (model, tp_mesh, sequence_parallel) -> None, parallelizing the model in place.
TensorParallelFn = Callable[[nn.Module, Any, bool], None]
# (model, cp_mesh, seq_len) -> None: the model runs on this cp rank's positions, in place.
ContextParallelFn = Callable[[nn.Module, Any, int], None]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelParts:
    """Dotted module paths inside the model, which the parallel code addresses by name."""

    # An nn.ModuleDict keyed by layer index: one FSDP unit and one checkpointed unit each, and
    # the unit pipeline stages are cut along.
    blocks: str = "layers"
    # Held only by the first pipeline stage (the embedding) and only by the last (norm, head).
    first: tuple[str, ...] = ("tok_embeddings",)
    last: tuple[str, ...] = ("norm", "output")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    shape: ModelShape
    # (options, max_seq_len) -> nn.Module on the current default device; its own parameter
    # init is irrelevant (parameters are filled by `materialize`).
    factory: Callable[..., nn.Module] | str
    options: Any = None
    parts: ModelParts = field(default_factory=ModelParts)
    tensor_parallel: TensorParallelFn | str | None = (
        "raytrain_dt.parallel.tensor_parallel:apply_tensor_parallel"
    )
    # None for a model whose attention cannot run over a split sequence (refused for cp > 1).
    context_parallel: ContextParallelFn | str | None = (
        "raytrain_dt.parallel.context_parallel:apply_context_parallel"
    )
    loss: LossFn | str = "raytrain_dt.models.llama:next_token_loss"
    # Token ids the model embeds; the data's ids must stay below it.
    vocab_size: int | None = None
    # (options, name, owning module) -> `ParamInit`: how each parameter starts, by its name in
    # the unsharded model (see `models.materialize`).
    param_init: Callable[..., ParamInit] | str = "raytrain_dt.models.llama:llama_param_init"
    # A directory whose weights the model starts from (`model.hf` with weights).
    weights_dir: str | None = None

    def build(
        self,
        max_seq_len: int,
        seed: int,
        device: str | torch.device = "cpu",
        weights: WeightSource | None = None,
    ) -> nn.Module:
        """The full model in this process, with the weights every layout starts from
        (`weights`, else `initial_weights(self, seed)`); "meta" builds the structure without
        memory (for inspection and planning)."""
        if torch.device(device).type == "meta":
            with torch.device("meta"):
                return resolve(self.factory)(self.options, max_seq_len)
        model = self.skeleton(max_seq_len)
        materialize(model, device, weights or initial_weights(self, seed))
        return model

    def skeleton(self, max_seq_len: int) -> nn.Module:
        """The model with its parameters on the meta device (no memory) and its buffers
        computed on the host: what ranks cut, shard, then `materialize`."""
        with torch.device("cpu"), parameters_on_meta():
            return resolve(self.factory)(self.options, max_seq_len)

    def instantiate(self, max_seq_len: int) -> nn.Module:
        """The factory's model under whatever construction context the caller set up
        (DeepSpeed's `zero.Init`, which partitions each module as it is built)."""
        return resolve(self.factory)(self.options, max_seq_len)

    def init_rule(self, name: str, module: nn.Module) -> ParamInit:
        """How the parameter `name` (unsharded model), held by `module`, is initialised."""
        return resolve(self.param_init)(self.options, name, module)

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return model.get_submodule(self.parts.blocks)

    def loss_fn(self) -> LossFn:
        return resolve(self.loss)

    def apply_tensor_parallel(self, model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
        if self.tensor_parallel is None:
            raise ValueError(f"parallel.tp: model {self.name!r} has no tensor-parallel plan")
        resolve(self.tensor_parallel)(model, tp_mesh, sequence_parallel)

    def apply_context_parallel(self, model: nn.Module, cp_mesh, seq_len: int) -> None:
        if self.context_parallel is None:
            raise ConfigError(
                f"parallel.cp: model {self.name!r} has no context-parallel attention "
                "(our presets have; set parallel.cp=1)"
            )
        resolve(self.context_parallel)(model, cp_mesh, seq_len)


def resolve(ref: Callable | str) -> Callable:
    """A callable, or the object a "package.module:name" string names."""
    if callable(ref):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def get_path(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at a dotted path, or None where a pipeline stage dropped it."""
    node: nn.Module | None = model
    for part in path.split("."):
        node = getattr(node, part, None) if node is not None else None
    return node


def set_path(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` at a dotted path, creating plain containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        if getattr(node, part, None) is None:
            node.register_module(part, nn.Module())
        node = getattr(node, part)
    node.register_module(leaf, module)


def _build_llama(options: ModelShape, max_seq_len: int) -> nn.Module:
    from raytrain_dt.models.llama import LlamaDecoder

    return LlamaDecoder(options, max_seq_len)


def llama_spec(shape: ModelShape, name: str = "llama") -> ModelSpec:
    """Our Llama-style decoder (`models.llama`) as a spec."""
    return ModelSpec(
        name=name, shape=shape, factory=_build_llama, options=shape, vocab_size=shape.vocab_size
    )


def model_spec(cfg) -> ModelSpec:
    """The spec a `TrainConfig` names: `model.hf` (transformers) or our preset."""
    m = cfg.model
    if m.hf:
        from raytrain_dt.models.hf import hf_spec

        return hf_spec(m.hf, dict(m.hf_config or {}), m.hf_init)
    return llama_spec(config_shape(cfg), name=m.preset)
