"""Expert parallelism: each MoE layer's experts split over the `ep` mesh axis, tokens moved to
them and back by all-to-all.

`apply_expert_parallel` turns every `GroupedExperts` parameter into a DTensor sharded on dim 0
(the expert) over the ep mesh, so rank i of an ep group holds experts [i*E/ep, (i+1)*E/ep), and
gives the module an `AllToAllDispatcher`. The dispatcher receives this rank's routed token
copies sorted by expert with a count per expert, and:
1. exchanges the counts (all-to-all of E integers), so each rank learns how many tokens every
   peer sends to each of its experts;
2. sends the tokens (differentiable all-to-all, uneven splits: one block per destination);
3. regroups what it received by local expert (it arrives grouped by source), runs the experts;
4. undoes the regrouping and sends every output back to the rank its token came from.
Backward runs the same exchanges in reverse (`torch.distributed.nn.functional`). Every tensor
that enters a collective lives on the compute device.

The experts' gradient then holds the contributions of every ep peer's tokens; the engine
shards and reduces it over the ranks holding the same experts (`expert_fsdp_mesh`) with the
divide factor of the whole DP mesh, so it equals the single-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from raytrain_dt.models.moe import GroupedExperts


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Shard every expert group of `model` (still on the meta device) over `ep_mesh`; its size
    divides their number (`engines.fsdp2.check_moe_layout`)."""
    ep = ep_mesh.size()
    for experts in expert_modules(model):
        for name, param in list(experts.named_parameters(recurse=False)):
            # src_data_rank=None: no scatter, each rank takes its own slice (a meta tensor here).
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        experts.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), ep)


class AllToAllDispatcher:
    """Runs a `GroupedExperts`' forward across its ep group (see the module docstring)."""

    def __init__(self, group, ep: int):
        self.group = group
        self.ep = ep

    def __call__(
        self, experts: GroupedExperts, tokens: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        ep, local = self.ep, experts.n_experts // self.ep
        # received[s, l]: tokens peer s sends to this rank's local expert l.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, local)
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        arrived = _all_to_all(tokens, recv_splits, send_splits, self.group)
        # Arrived grouped by (source, local expert); the experts want (local expert, source).
        segment = torch.repeat_interleave(
            torch.arange(ep * local, device=tokens.device), received.flatten()
        )
        by_expert = torch.argsort((segment % local) * ep + segment // local, stable=True)
        outputs = experts.compute(arrived[by_expert], received.sum(dim=0))
        back = outputs[torch.argsort(by_expert)]
        return _all_to_all(back, send_splits, recv_splits, self.group)


def _all_to_all(
    tokens: torch.Tensor, output_splits: list[int], input_splits: list[int], group
) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows."""
    out = tokens.new_empty((sum(output_splits), *tokens.shape[1:]))
    return dist_fn.all_to_all_single(out, tokens, output_splits, input_splits, group=group)
