"""Expert parallelism: each MoE layer's experts split over the `ep` mesh axis, tokens moved to
them and back by all-to-all.

`apply_expert_parallel` turns every expert group's parameters (our `GroupedExperts`, and
transformers' fused experts of Mixtral and Qwen-MoE) into DTensors sharded on dim 0 (the
expert) over the ep mesh, so rank i of an ep group holds experts [i*E/ep, (i+1)*E/ep), and
routes the group's forward through an `AllToAllDispatcher`. It receives this rank's routed token
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

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from raytrain_dt.models.moe import GroupedExperts, local_experts


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """`model`'s expert groups: our `GroupedExperts` and transformers' fused experts (Mixtral,
    Qwen2/3-MoE: 3-D `gate_up_proj` and `down_proj`, called with (tokens, top-k experts,
    top-k weights))."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts) or _is_fused_hf(m)]


def num_experts(experts: nn.Module) -> int:
    return experts.n_experts if isinstance(experts, GroupedExperts) else experts.num_experts


def _is_fused_hf(module: nn.Module) -> bool:
    return (
        isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
        and isinstance(getattr(module, "down_proj", None), nn.Parameter)
        and hasattr(module, "num_experts")
    )


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Shard every expert group of `model` (still on the meta device) over `ep_mesh`; its size
    divides their number (`engines.moe_step.check_moe_layout`)."""
    ep = ep_mesh.size()
    dispatcher = AllToAllDispatcher(ep_mesh.get_group(), ep)
    for experts in expert_modules(model):
        for name, param in list(experts.named_parameters(recurse=False)):
            # src_data_rank=None: no scatter, each rank takes its own slice (a meta tensor here).
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        if isinstance(experts, GroupedExperts):
            experts.dispatcher = dispatcher
        else:
            # transformers' forward loops over the experts it holds whole: replaced on the
            # instance by the same dispatch as ours (parameter names unchanged).
            experts.forward = functools.partial(_fused_hf_forward, experts, dispatcher)


class AllToAllDispatcher:
    """Runs an expert group's forward across its ep group (see the module docstring)."""

    def __init__(self, group, ep: int):
        self.group = group
        self.ep = ep

    def __call__(
        self,
        tokens: torch.Tensor,
        counts: torch.Tensor,
        compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`tokens` sorted by expert, `counts` (E,) per expert; `compute(tokens, counts)` runs
        this rank's experts over tokens sorted by them."""
        ep, local = self.ep, counts.numel() // self.ep
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
        outputs = compute(arrived[by_expert], received.sum(dim=0))
        back = outputs[torch.argsort(by_expert)]
        return _all_to_all(back, send_splits, recv_splits, self.group)


def _fused_hf_forward(
    experts: nn.Module,
    dispatcher: AllToAllDispatcher,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' fused experts' forward, (tokens, top-k experts, top-k weights) -> the
    weighted sum, with the experts across the ep group."""
    top_k = top_k_index.shape[-1]
    token_of = torch.arange(hidden_states.shape[0], device=hidden_states.device)
    token_of = token_of.repeat_interleave(top_k)
    order = torch.argsort(top_k_index.flatten(), stable=True)
    token_of = token_of[order]
    counts = torch.bincount(top_k_index.flatten(), minlength=experts.num_experts)

    def compute(tokens: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = local_experts(experts.gate_up_proj), local_experts(experts.down_proj)
        outputs = []
        for e, chunk in enumerate(torch.split(tokens, local_counts.tolist())):
            gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)
            outputs.append(F.linear(experts.act_fn(gate) * up, down[e]))
        return torch.cat(outputs)

    routed = dispatcher(hidden_states[token_of], counts, compute)
    weights = top_k_weights.flatten()[order, None].to(routed.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token_of, routed * weights)


def _all_to_all(
    tokens: torch.Tensor, output_splits: list[int], input_splits: list[int], group
) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows."""
    out = tokens.new_empty((sum(output_splits), *tokens.shape[1:]))
    return dist_fn.all_to_all_single(out, tokens, output_splits, input_splits, group=group)
