"""The loss one micro-step backpropagates, shared by every engine.

Engines average gradients over DP and divide each micro-step's loss by the accumulation count,
so with D ranks, A micro-steps and `micro_batch` rows each, a micro-step loss equal to the mean
of its rows' losses yields the gradient of the mean over the D * A * micro_batch slots. That is
the global-batch mean only when every slot holds a sample. A padded layout (`Layout.padded_slots`
> 0: D does not divide the global batch G) has rows that are padding (`real` False), so there
the micro-step loss is the sum of its real rows' losses times D * A / G instead: padding then
weighs nothing, and the averaging over D and A turns the sum into (1/G) * the sum over the G
samples, the single-process gradient. Summing these micro-step losses over a rank's micro-steps
and over DP, divided by D * A, gives the reported global mean the same way as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from raytrain_dt.topology.layout import Layout


def micro_step_loss(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    tokens: torch.Tensor,
    real: torch.Tensor | None,
    layout: Layout,
) -> torch.Tensor:
    """`loss_fn` over the micro-batch, or its padding-free weighted form on a padded layout."""
    if not layout.padded_slots:
        return loss_fn(logits, tokens)  # exactly today's arithmetic when every slot is a sample
    if real is None:
        raise ValueError(f"{layout.describe()} pads its batch: train_step needs the real-row masks")
    # Per row, since the model's loss is a mean over whatever rows it is given.
    rows = torch.stack([loss_fn(logits[i : i + 1], tokens[i : i + 1]) for i in range(len(tokens))])
    scale = layout.dims.dp * layout.grad_accum / layout.global_batch
    # A multiply, not a selection: a micro-batch of padding alone still backpropagates (zeros),
    # so every rank runs the same collectives.
    return (rows * real.to(rows.device, rows.dtype)).sum() * scale
