"""Cutting the global batch: global_batch = micro_batch x grad_accum x dp, exactly."""

from __future__ import annotations

from raytrain_dt.errors import ConfigError


def split_global_batch(
    global_batch: int,
    dp: int,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    max_micro_batch: int = 8,
) -> tuple[int, int]:
    """(micro_batch, grad_accum) for a DP degree; derives whichever is null.

    With both null it picks the largest micro-batch <= max_micro_batch that divides the
    per-rank batch, so accumulation is as small as memory allows.
    """
    if global_batch % dp:
        raise ConfigError(
            f"trainer.global_batch: {global_batch} is not divisible by the DP degree {dp}"
        )
    per_rank = global_batch // dp
    if micro_batch and grad_accum:
        if micro_batch * grad_accum != per_rank:
            raise ConfigError(
                f"trainer.micro_batch: {micro_batch} x trainer.grad_accum {grad_accum} x dp {dp} "
                f"!= trainer.global_batch {global_batch}"
            )
        return micro_batch, grad_accum
    if micro_batch:
        if per_rank % micro_batch:
            raise ConfigError(
                f"trainer.micro_batch: {micro_batch} does not divide the per-rank batch {per_rank} "
                f"(global_batch {global_batch} / dp {dp})"
            )
        return micro_batch, per_rank // micro_batch
    if grad_accum:
        if per_rank % grad_accum:
            raise ConfigError(
                f"trainer.grad_accum: {grad_accum} does not divide the per-rank batch {per_rank} "
                f"(global_batch {global_batch} / dp {dp})"
            )
        return per_rank // grad_accum, grad_accum
    micro = max(m for m in range(1, min(per_rank, max_micro_batch) + 1) if per_rank % m == 0)
    return micro, per_rank // micro
