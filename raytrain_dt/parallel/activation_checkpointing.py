"""Activation checkpointing: recompute each block's activations in backward instead of keeping
them, for every engine (FSDP2 wraps its blocks; DeepSpeed keeps their parameter names)."""

from __future__ import annotations

from torch import nn


def apply_activation_checkpointing(
    model: nn.Module, blocks: nn.ModuleDict | None = None, keep_names: bool = False
) -> None:
    """Checkpoint each block (the model's `layers` unless its spec names other blocks).

    `keep_names`: recompute through the block's own forward instead of wrapping it in torch's
    CheckpointWrapper, whose `_checkpoint_wrapped_module.` would enter every parameter's name.
    DeepSpeed records those names in its checkpoint files, so a checkpoint written with AC
    would not load into a layout without it (DCP's state dicts strip the wrapper: FSDP2 wraps).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = model.layers if blocks is None else blocks
    for name, block in list(blocks.named_children()):
        if keep_names:
            block.forward = _recomputed_in_backward(block.forward)
        else:
            blocks.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def _recomputed_in_backward(forward):
    """`forward` under non-reentrant activation checkpointing, as CheckpointWrapper runs it."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return checkpointed
