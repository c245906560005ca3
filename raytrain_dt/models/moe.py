"""The mixture-of-experts feed-forward of our decoder (`ModelShape.is_moe`): top-k routing,
per-sequence expert capacity, the load-balancing loss, and the router statistics a step reports.

Routing (Mixtral's convention): a bias-free router gives each token fp32 softmax scores over
the experts; the token goes to its top-k experts with the chosen scores renormalized to sum to
1. Capacity is counted per SEQUENCE, so which assignments are dropped does not depend on how a
batch is split over ranks (every layout then equals the single-process run): expert e accepts at
most ceil(capacity_factor * seq_len * k / n_experts) assignments of one sequence, earliest
positions first; a dropped assignment contributes nothing (the residual carries the token on).
capacity_factor 0 means no limit.

The load-balancing loss (Switch/Mixtral) of one sequence is n_experts * sum_e f_e * P_e, f_e the
share of its tokens routed to e (before capacity; sums to k) and P_e its mean router score for
e. It never enters the reported next-token loss or the loss function: `AuxLossAutoScaler`
attaches it to the block's output (identity forward) and adds its gradient in backward. Each
row's weight in it (`RouterTap.row_weights`, set by the engine before every micro-step forward) is
what makes the summed gradient over micro-steps and DP ranks equal the single-process one (the
default, None, is the mean over the batch's rows: one forward over the whole batch).

Experts are grouped 3-D parameters (w1/w3: (E, hidden, dim), w2: (E, dim, hidden)) in an
`experts` submodule (`GroupedExperts`), so expert parallelism shards dim 0 and swaps in a token
dispatcher (`parallel/expert_parallel.py`) without the rest of this module knowing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from raytrain_dt.models.presets import ModelShape


def expert_capacity(capacity_factor: float, seq_len: int, top_k: int, n_experts: int) -> int:
    """Assignments of one sequence an expert accepts; 0 for no limit."""
    if capacity_factor <= 0:
        return 0
    return math.ceil(capacity_factor * seq_len * top_k / n_experts)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 scores (..., E), chosen experts (..., k), their renormalized weights (..., k))."""
    scores = torch.softmax(logits.float(), dim=-1)
    weights, experts = scores.topk(top_k, dim=-1)
    return scores, experts, weights / weights.sum(dim=-1, keepdim=True)


def capacity_keep(
    experts: torch.Tensor, n_experts: int, capacity: int, split: SequenceSplit | None = None
) -> torch.Tensor:
    """Which assignments of `experts` (batch, seq, k) an expert accepts: at most `capacity` per
    expert and sequence, in position order (a token's k experts are distinct, so the order
    within a token does not matter). `split`: this rank holds chunks of each sequence
    (context parallelism); the assignments of the chunks before each count first."""
    if capacity <= 0:
        return torch.ones_like(experts, dtype=torch.bool)
    per_position = F.one_hot(experts, n_experts).sum(dim=2)  # (batch, seq, E)
    if split is None:
        # The 1-based arrival number of each assignment at its expert, within its sequence.
        arrivals = per_position.cumsum(dim=1)
    else:
        arrivals = split.arrivals(per_position)
    return arrivals.gather(2, experts) <= capacity  # (batch, seq, k)


def load_balancing_loss(
    scores: torch.Tensor, experts: torch.Tensor, n_experts: int, split: SequenceSplit | None = None
) -> torch.Tensor:
    """Per sequence (batch,): n_experts * sum_e f_e * P_e over its positions (`split`: over
    every cp rank's positions; each holding rank then computes the same value)."""
    routed = F.one_hot(experts, n_experts).sum(dim=(1, 2)).float()  # (batch, E)
    score_sums = scores.sum(dim=1)  # (batch, E)
    seq_len = scores.shape[1]
    if split is not None:
        routed, score_sums = split.total(routed), split.total(score_sums)
        seq_len *= split.cp
    return n_experts * (routed / seq_len * score_sums / seq_len).sum(dim=-1)


class SequenceSplit:
    """This rank's part of each sequence under context parallelism: chunks `rank` and
    2·cp-1-`rank` of 2·cp (`parallel.context_parallel.chunk_positions`), the others on the
    cp group's ranks. Capacity and the load-balancing loss are per whole sequence, so they
    combine counts over the group."""

    def __init__(self, group, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank

    def total(self, per_row: torch.Tensor) -> torch.Tensor:
        """(batch, E) summed over the group's ranks (differentiable: each rank's gradient
        reaches every rank's positions)."""
        return dist_fn.all_reduce(per_row, group=self.group)

    def arrivals(self, per_position: torch.Tensor) -> torch.Tensor:
        """1-based arrival numbers (batch, local seq, E) of each position's assignments at
        each expert, counting every earlier position of the whole sequence."""
        batch, local_len, n_experts = per_position.shape
        chunks = per_position.view(batch, 2, local_len // 2, n_experts)
        per_chunk = chunks.sum(dim=2)  # (batch, 2, E): this rank's two chunks
        gathered = [torch.empty_like(per_chunk) for _ in range(self.cp)]
        dist.all_gather(gathered, per_chunk, group=self.group)
        ordered = torch.empty(
            batch, 2 * self.cp, n_experts, dtype=per_chunk.dtype, device=per_chunk.device
        )
        for rank, counts in enumerate(gathered):
            ordered[:, rank] = counts[:, 0]
            ordered[:, 2 * self.cp - 1 - rank] = counts[:, 1]
        before = ordered.cumsum(dim=1) - ordered  # assignments in earlier chunks
        mine = before[:, [self.rank, 2 * self.cp - 1 - self.rank]]  # (batch, 2, E)
        return (chunks.cumsum(dim=2) + mine[:, :, None, :]).view_as(per_position)


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; backward also sends gradient 1 into `aux_loss` (the loss is
    already weighted for its share of the step), so its gradient joins the model's."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


def local_experts(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a parameter (a DTensor over the ep mesh under expert parallelism)."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


class GroupedExperts(nn.Module):
    """n_experts SwiGLU experts as three stacked parameters (dim 0: the expert)."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down
        # Set by `parallel.expert_parallel`: exchanges tokens with the ranks holding the experts.
        self.dispatcher = None

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`tokens` (n, dim) sorted by expert, `counts` (E,) per expert -> outputs, same order."""
        if self.dispatcher is not None:
            return self.dispatcher(tokens, counts, self.compute)
        return self.compute(tokens, counts)

    def compute(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run the experts this rank holds over `tokens` sorted by them (`counts` each)."""
        w1, w3, w2 = local_experts(self.w1), local_experts(self.w3), local_experts(self.w2)
        outputs = []
        # A host list of sizes: split needs it (one device sync per layer).
        for e, chunk in enumerate(torch.split(tokens, counts.tolist())):
            # Every expert runs, even on no tokens, so each gets a (zero) gradient.
            hidden = F.silu(chunk @ w1[e].to(chunk.dtype).T) * (chunk @ w3[e].to(chunk.dtype).T)
            outputs.append(hidden @ w2[e].to(chunk.dtype).T)
        return torch.cat(outputs)


class SharedExpert(nn.Module):
    """A SwiGLU every token passes through (Qwen-MoE's shared expert)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RouterTap:
    """One MoE layer's bookkeeping: its router statistics since they were last taken and its
    load-balancing loss, attached to its output. Held as `router_tap` by our `MoEFeedForward`
    and by the MoE blocks of Hugging Face models (`models.hf`), which is how `moe_layers`
    finds them."""

    def __init__(self, n_experts: int, aux_loss_coef: float):
        self.n_experts = n_experts
        self.aux_loss_coef = aux_loss_coef
        # Each row's weight in the load-balancing loss (None: the batch mean); engines set it.
        self.row_weights: torch.Tensor | None = None
        # Context parallelism's split of each sequence over ranks (None: whole sequences).
        self.split: SequenceSplit | None = None
        # Per training forward since the last `take_router_stats`: assignments each expert
        # accepted, then dropped ones.
        self.forwards: list[torch.Tensor] = []

    def attach(
        self,
        output: torch.Tensor,
        scores: torch.Tensor,
        experts: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Record this training forward's routing (`keep`: the assignments within capacity,
        None for all; padding rows left out; not activation checkpointing's recompute in
        backward, which must not count twice) and return `output`, carrying in backward the
        gradient of the load-balancing loss of `scores` (batch, seq, E) and `experts` (batch,
        seq, k), each row weighted by `row_weights`. Evaluation (no grad): `output` as is."""
        if not (torch.is_grad_enabled() and output.requires_grad):
            return output
        if torch._C._current_graph_task_id() == -1:
            self.forwards.append(self._routing(experts, keep))
        if self.aux_loss_coef <= 0:
            return output
        per_row = load_balancing_loss(scores, experts, self.n_experts, self.split)
        weights = self.row_weights
        if weights is None:
            weights = torch.full_like(per_row, 1.0 / per_row.numel())
        aux = self.aux_loss_coef * (per_row * weights.to(per_row)).sum()
        return AuxLossAutoScaler.apply(output, aux)

    @torch.no_grad()
    def _routing(self, experts: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if self.row_weights is not None:  # a padded layout's padding rows weigh 0
            real = self.row_weights != 0
            experts = experts[real]
            keep = None if keep is None else keep[real]
        kept = experts.flatten() if keep is None else experts[keep]
        accepted = torch.bincount(kept, minlength=self.n_experts)
        return torch.cat((accepted, accepted.new_full((1,), experts.numel() - kept.numel())))


class MoEFeedForward(nn.Module):
    """(batch, seq, dim) -> (batch, seq, dim): the routed experts' weighted sum (+ shared)."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.n_experts = shape.n_experts
        self.top_k = shape.experts_per_token
        self.capacity_factor = shape.capacity_factor
        self.router = nn.Linear(shape.dim, shape.n_experts, bias=False)
        self.experts = GroupedExperts(shape.n_experts, shape.dim, shape.expert_hidden)
        self.shared_expert = (
            SharedExpert(shape.dim, shape.shared_ffn_hidden) if shape.shared_ffn_hidden else None
        )
        self.router_tap = RouterTap(shape.n_experts, shape.router_aux_loss_coef)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        scores, experts, weights = route(self.router(x), self.top_k)
        split = self.router_tap.split
        full_len = seq_len * (split.cp if split is not None else 1)
        capacity = expert_capacity(self.capacity_factor, full_len, self.top_k, self.n_experts)
        keep = capacity_keep(experts, self.n_experts, capacity, split)
        # The kept assignments as flat lists, sorted by expert (stable: position order).
        token_of = torch.arange(batch * seq_len, device=x.device).repeat_interleave(self.top_k)
        kept, expert_of, weight_of = keep.flatten(), experts.flatten(), weights.flatten()
        token_of, expert_of, weight_of = token_of[kept], expert_of[kept], weight_of[kept]
        order = torch.argsort(expert_of, stable=True)
        token_of, weight_of = token_of[order], weight_of[order]
        counts = torch.bincount(expert_of, minlength=self.n_experts)
        flat = x.reshape(-1, dim)
        routed = self.experts(flat[token_of], counts) * weight_of[:, None].to(x.dtype)
        out = torch.zeros_like(flat).index_add(0, token_of, routed).view_as(x)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.router_tap.attach(out, scores, experts, keep)


def moe_layers(model: nn.Module) -> list[RouterTap]:
    """The router taps of `model`'s MoE layers (ours and Hugging Face ones alike)."""
    return [
        m.router_tap
        for m in model.modules()
        if isinstance(getattr(m, "router_tap", None), RouterTap)
    ]


def set_aux_row_weights(model: nn.Module, row_weights: torch.Tensor | None) -> None:
    """Each row's weight in the next forward's load-balancing loss (None: the batch mean)."""
    for tap in moe_layers(model):
        tap.row_weights = row_weights


def take_router_stats(
    model: nn.Module,
    device: torch.device,
    n_experts: int | None = None,
    forwards: int | None = None,
) -> torch.Tensor | None:
    """(E + 1,) on `device`: assignments each expert accepted, then dropped ones, summed
    over this model's MoE layers and their training forwards since the last call (which
    resets them); with `forwards`, each layer's last that many only (a step's micro-batches:
    a pipeline stage's first step also runs a shape-inference forward before them). A model
    part with no MoE layer (a pipeline stage of dense blocks) gives zeros when `n_experts` is
    known, else None, as a dense model does."""
    taps = moe_layers(model)
    taken = []
    for tap in taps:
        taken.extend(tap.forwards[-forwards:] if forwards else tap.forwards)
        tap.forwards = []
    if taken:
        return torch.stack(taken).sum(dim=0)
    n_experts = taps[0].n_experts if taps else n_experts
    if not n_experts:
        return None
    return torch.zeros(n_experts + 1, dtype=torch.long, device=device)


def split_sequences(model: nn.Module, cp_mesh) -> None:
    """Context parallelism for `model`'s MoE layers: each rank holds chunks of every sequence
    (`SequenceSplit`), so capacity and the load-balancing loss count over the cp group."""
    split = SequenceSplit(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())
    for tap in moe_layers(model):
        tap.split = split
