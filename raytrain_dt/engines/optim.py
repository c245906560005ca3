"""Optimizer construction shared by every engine: AdamW with decay on matrices only.

Norm weights (1-D) are not decayed. Keeping this in one place is what lets an FSDP2 run, a
DeepSpeed run and a single-process reference take identical steps.

Sharded (DTensor) parameters step through `ShardLocalAdamW`: the same AdamW kernels on each
rank's local shards. AdamW is elementwise, so a shard's update needs nothing from other ranks,
but run on DTensors every foreach op first goes through DTensor's sharding propagation. That is
computed afresh for every new layout (its caches hold the old mesh and are dropped with it:
`worker/layout_release.py`) and costs about 60 ms per op for the tiny model's 21 parameters on
this CPU, growing with the parameter count: about a second on the path of every re-formation,
spent initialising the optimizer state for the checkpoint load. On local shards the same
kernels see the same inputs, so the update is bit-identical; the state is still made of
DTensors with the parameters' specs, so checkpoints and DCP resharding see the usual state.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype

from raytrain_dt.config.schema import TrainerConfig
from raytrain_dt.engines.schedule import lr_at
from raytrain_dt.models.materialize import local_shard


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():
        # A parameter ZeRO-3 partitioned as it was built is an empty 1-D tensor; DeepSpeed
        # keeps its real shape in `ds_shape`.
        if param.requires_grad:
            ndim = len(getattr(param, "ds_shape", param.shape))
            (decay if ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class ShardLocalAdamW(torch.optim.AdamW):
    """AdamW that updates DTensor parameters through their local shards (see the module's
    doc). A step whose gradients do not have their parameters' placements (a gradient still
    `Partial` over some mesh dimension needs a reduction first) runs as plain AdamW."""

    def init_state(self) -> None:
        """Create the zero state of every trainable parameter that has none, as a first step
        would, without running one. DCP's `get_state_dict` otherwise initialises it with a
        zero-gradient step (`_init_optim_state`), on DTensors."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.requires_grad and not self.state[param]:
                    self.state[param] = _zero_state(param, group)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or not self._grads_match_shards():
            # Also every step of a model without DTensors. torch wraps each optimizer class's
            # step with the step hooks, which have run already for this call: not twice.
            plain_step = torch.optim.AdamW.step
            if getattr(plain_step, "hooked", False):
                plain_step = plain_step.__wrapped__
            return plain_step(self, closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for param in params:
                if not self.state[param]:
                    self.state[param] = _zero_state(param, group)
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adam(
                [local_shard(p) for p in params],
                [local_shard(p.grad) for p in params],
                [local_shard(s["exp_avg"]) for s in states],
                [local_shard(s["exp_avg_sq"]) for s in states],
                [local_shard(s["max_exp_avg_sq"]) for s in states] if group["amsgrad"] else [],
                [s["step"] for s in states],
                amsgrad=group["amsgrad"],
                has_complex=any(torch.is_complex(p) for p in params),
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
        return None

    def _grads_match_shards(self) -> bool:
        """Some parameter is a DTensor, and every DTensor's gradient has its spec."""
        sharded = False
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None or not isinstance(param, DTensor):
                    continue
                sharded = True
                if not isinstance(grad, DTensor) or (grad.device_mesh, grad.placements) != (
                    param.device_mesh,
                    param.placements,
                ):
                    return False
        return sharded


def _zero_state(param: torch.Tensor, group: dict) -> dict:
    """AdamW's initial state for `param` (torch's `Adam._init_group`), its tensors built from
    the local shard with the parameter's spec (no DTensor op runs)."""

    def zeros() -> torch.Tensor:
        local = torch.zeros_like(local_shard(param), memory_format=torch.preserve_format)
        if not isinstance(param, DTensor):
            return local
        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    on_device = group["capturable"] or group["fused"]
    state = {
        # torch keeps `step` on the host unless capturable or fused (kernel launches cost).
        "step": torch.zeros(
            (), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=local_shard(param).device
        )
        if on_device
        else torch.tensor(0.0, dtype=_get_scalar_dtype()),
        "exp_avg": zeros(),
        "exp_avg_sq": zeros(),
    }
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = zeros()
    return state


def build_adamw(
    model: nn.Module, trainer: TrainerConfig, sharded: bool = False
) -> torch.optim.AdamW:
    """`sharded`: the parameters are DTensors (FSDP2), stepped on their local shards
    (`ShardLocalAdamW`). DeepSpeed gets torch's own class: ZeRO refuses any other."""
    optimizer_class = ShardLocalAdamW if sharded else torch.optim.AdamW
    return optimizer_class(
        param_groups(model, trainer.weight_decay),
        lr=trainer.lr,
        betas=(trainer.beta1, trainer.beta2),
        eps=trainer.eps,
        # foreach is the fast path on both CPU and CUDA and works with DTensor shards.
        foreach=True,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def scheduled_lr(trainer: TrainerConfig, step: int) -> float:
    """The LR of optimizer step `step` (0-based) under the trainer's schedule."""
    return lr_at(
        step,
        lr=trainer.lr,
        warmup_steps=trainer.warmup_steps,
        total_steps=trainer.steps,
        min_lr_ratio=trainer.min_lr_ratio,
    )


def apply_lr_schedule(optimizer: torch.optim.Optimizer, trainer: TrainerConfig, step: int) -> float:
    """Set the scheduled LR of optimizer step `step` (0-based) on `optimizer`; returns it."""
    lr = scheduled_lr(trainer, step)
    set_lr(optimizer, lr)
    return lr
