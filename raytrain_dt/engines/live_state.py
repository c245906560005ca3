"""The model and optimizer state dicts of an FSDP2 rank, built once and kept current, for the
copies taken every step (`FSDP2Engine.stage_copy`).

torch's `get_state_dict` walks every parameter and optimizer state on each call (FQN mapping,
flattening): about 12 ms on the training thread for a 16-block model on a CPU core here, which
a copy of every step would pay every step, more than the copy itself costs there once it runs
beside the step. The dicts it returns hold the live tensors (sharded parameters and optimizer
states, updated in place by the optimizer step), so after the first call only their plain
values can go stale: the param groups' (the scheduled lr) and any non-tensor optimizer state.
`LiveStateDicts` finds where each plain value lives in the optimizer once, and each call reads
those values again, and builds the dicts again if the optimizer's state was replaced (a load).
Where it cannot place a value (an optimizer whose state it does not know), it falls back to
`get_state_dict` on every call. Because those dicts hold the parameters' own storage, a load
into them has set the parameters already (`holds_the_parameters`, `FSDP2Engine.load`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from raytrain_dt.models.materialize import local_shard

# A plain value of the flat optimizer dict: (its key, the dict it is read from, its name there).
_Source = tuple[str, dict, str]


class LiveStateDicts:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        fresh: Callable[[], tuple[dict, dict]],
    ) -> None:
        """`fresh`: the engine's own (model, flat optimizer) state dicts, as it saves them."""
        self._fresh = fresh
        self._model, self._optimizer = model, optimizer
        self._build()

    def _build(self) -> None:
        model_sd, optim_sd = self._fresh()
        try:
            self._sources = _plain_value_sources(self._model, self._optimizer, optim_sd)
        except Exception:  # a model or optimizer whose names torch's helper cannot map
            self._sources = None
        self._dicts = (model_sd, optim_sd)
        # A loaded optimizer state (`Optimizer.load_state_dict`) replaces both objects, and
        # with them every state tensor the dicts hold.
        self._built_on = (self._optimizer.state, self._optimizer.param_groups)

    def __call__(self) -> tuple[dict, dict]:
        if self._sources is None:
            return self._fresh()
        state, groups = self._built_on
        if self._optimizer.state is not state or self._optimizer.param_groups is not groups:
            self._build()
            if self._sources is None:
                return self._dicts
        model_sd, optim_sd = self._dicts
        for key, source, name in self._sources:
            optim_sd[key] = source[name]
        return model_sd, optim_sd


def _plain_value_sources(
    model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: dict[str, Any]
) -> list[_Source] | None:
    """Where each non-tensor value of the flat optimizer dict (`param_groups.<fqn>.<name>`,
    `state.<fqn>.<name>`) is read from: its parameter's group or state; None if one cannot be
    placed."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    param_of = {}
    for name, param in model.named_parameters():
        for fqn in _get_fqns(model, name):
            param_of[fqn] = param
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    sources: list[_Source] = []
    for key, value in optim_sd.items():
        if isinstance(value, torch.Tensor):
            continue
        section, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        param = param_of.get(fqn)
        if param is None or section not in ("param_groups", "state"):
            return None
        source = group_of.get(id(param)) if section == "param_groups" else optimizer.state[param]
        if source is None or name not in source:
            return None
        sources.append((key, source, name))
    return sources


def holds_the_parameters(model: nn.Module, model_state: dict) -> bool:
    """Whether every entry of `model_state` is the storage of the model's own parameter or
    buffer of that name (so an in-place load has already set them)."""
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    for name, value in model_state.items():
        held = own.get(name)
        if not isinstance(value, torch.Tensor) or held is None:
            return False
        ours, theirs = local_shard(value), local_shard(held)
        if (
            ours.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr()
            or ours.storage_offset() != theirs.storage_offset()
            or ours.shape != theirs.shape
            or ours.stride() != theirs.stride()
        ):
            return False
    return True
