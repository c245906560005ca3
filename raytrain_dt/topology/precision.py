"""Which precision a run computes in: a pure function the planner (driver) and the ranks share."""

from __future__ import annotations


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """'auto' -> bf16 on GPUs, fp32 elsewhere; an explicit 'fp32' or 'bf16' is honoured."""
    if precision != "auto":
        return precision
    return "bf16" if on_gpu else "fp32"
