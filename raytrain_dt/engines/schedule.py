"""Learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr`.

A pure function of the step, so it needs no state in checkpoints and is identical for every
engine and every layout.
"""

from __future__ import annotations

import math


def lr_at(
    step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> float:
    """LR for optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
