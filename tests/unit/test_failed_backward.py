"""A backward that raised leaves the nodes it had not run in its thread's autograd queue, and
with them what they hold (in a rank, FSDP's param groups, their mesh and its process groups):
`forget_failed_backward`, which a rank's release runs on its torch thread, lets them go."""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from raytrain_dt.worker.layout_release import forget_failed_backward


class _ParamGroup:
    """Stands for FSDP's param group, which its post-backward node holds."""


class _Holds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _PeerLost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("Connection reset by peer")


def _failing_backward(groups: list) -> str:
    x = torch.ones(4, requires_grad=True)
    parts = []
    for scale in range(2, 7):  # five layers' nodes, still queued when the failure comes
        group = _ParamGroup()
        groups.append(weakref.ref(group))
        parts.append(_Holds.apply(x * scale, group).sum())
    loss = sum(parts) + _PeerLost.apply(x).sum()
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return "no failure"


def test_a_failed_backwards_nodes_are_let_go_on_its_thread():
    torch_thread = ThreadPoolExecutor(1)  # a rank's torch thread: it outlives its layouts
    groups: list = []
    assert torch_thread.submit(_failing_backward, groups).result() == "Connection reset by peer"
    gc.collect()
    # What the failure left queued holds them: no collection frees them.
    assert sum(ref() is not None for ref in groups) == 5
    torch_thread.submit(forget_failed_backward).result()
    gc.collect()
    assert [ref() for ref in groups] == [None] * 5
