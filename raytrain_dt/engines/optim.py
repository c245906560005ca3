"""Optimizer construction shared by every engine: AdamW with decay on matrices only.

Norm weights (1-D) are not decayed. Keeping this in one place is what lets an FSDP2 run, a
DeepSpeed run and a single-process reference take identical steps.
"""

from __future__ import annotations

import torch
from torch import nn

from raytrain_dt.config.schema import TrainerConfig
from raytrain_dt.engines.schedule import lr_at


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


def build_adamw(model: nn.Module, trainer: TrainerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
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
