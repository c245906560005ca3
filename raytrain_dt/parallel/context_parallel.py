"""Context parallelism: each sequence split across the cp ranks, attention computed as a ring.

The split is the load-balanced causal one: a sequence of length S is cut into 2·cp chunks of
S/(2·cp) positions, and cp rank i holds chunks i and 2·cp-1-i, so every rank gets the same share
of the causal attention work (an early chunk attends to little, its mirror to much).
`chunk_positions` gives a rank's global positions; `shard_batch` cuts the token ids a rank feeds
its model and the labels (the next token of each of its positions) its loss reads.

Ring attention (`RingAttention`) is exact blockwise attention: the K/V of every rank travel once
around the cp ring (point-to-point on the cp group, device tensors, each shift posted before the
block in hand is computed so transfer and compute overlap), and the partial results are merged
by the online softmax (running max and log-sum-exp), accumulated in fp32. The split makes every
block but a rank's own one half-live and unmasked (`_live_part`): only that half is computed, and
only the own block needs the causal mask of global positions. Scores are computed explicitly per
block (no fused kernel), in tiles of `TILE_ROWS` query rows, which bounds the transient score
matrices. The backward pass sends the K/V round again, recomputing each block's probabilities
from the saved log-sum-exp, while the gradients of each block's K/V travel with it and arrive at
their owner after the last hop. Grouped-query attention (fewer K/V heads than query heads) is
handled by expanding K/V per block and summing their gradients back over each group.

torch's own context-parallel API (`torch.distributed.tensor.experimental.context_parallel`) is
not used: it intercepts only the CUDA SDPA kernels (flash, efficient, cuDNN), not the CPU one, so
it cannot run on CPU and gloo, where the suite checks every layout against the single-process run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from raytrain_dt.models.moe import split_sequences

# The label of a position with no next token (the sequence's last): cross-entropy skips it.
IGNORE_INDEX = -100
# Point-to-point tags, so the K/V and their gradients in flight at once never cross.
_KV_TAG = 0
_GRAD_TAG = 1
# Query rows attended at once: bounds each block's transient (rows x keys) score matrices.
TILE_ROWS = 256


def chunk_positions(
    seq_len: int, cp: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions cp rank `cp_rank` holds: chunks cp_rank and 2·cp-1-cp_rank."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"parallel.cp: {cp} does not split data.seq_len={seq_len} into 2 x cp equal chunks"
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    mirror = 2 * cp - 1 - cp_rank
    second = torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)
    return torch.cat((first, second))


def shard_batch(tokens: torch.Tensor, cp: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) of this cp rank's positions in (batch, seq) `tokens`: the labels are
    the next token of each position, `IGNORE_INDEX` at the sequence's last."""
    positions = chunk_positions(tokens.shape[1], cp, cp_rank, tokens.device)
    last = torch.full_like(tokens[:, :1], IGNORE_INDEX)
    labels = torch.cat((tokens[:, 1:], last), dim=1)
    return tokens[:, positions], labels[:, positions]


@dataclass(frozen=True)
class ContextShardLoss:
    """The loss of a cp rank's positions, scaled so gradients average to the reference's.

    The local cross-entropy *sum* over the labelled positions, divided by the global count of
    labelled positions of these rows (rows · (seq_len - 1)) and multiplied by cp: FSDP averages
    gradients over dp_shard·cp ranks (and dp_replicate), so the cp factor cancels that division
    and the sum over the cp ranks is the rows' mean loss, the single-process one. The padded
    layout's per-row form (`engines.micro_loss`) calls it row by row, which keeps the same scale.
    """

    seq_len: int
    cp: int

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten().long(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        # Vocab-sharded logits (TP's loss_parallel) give a replicated DTensor sum.
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        return loss * (self.cp / (labels.shape[0] * (self.seq_len - 1)))


class Ring:
    """This rank's place on the cp ring: its group, index, size and neighbours."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: torch.Tensor, tag: int) -> _Shift:
        """Send `tensor` to the next rank and receive the previous rank's (in flight)."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor, self._next, self.group, tag),
                dist.P2POp(dist.irecv, received, self._prev, self.group, tag),
            ]
        )
        return _Shift(works, received)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's (batch, heads, 2·chunk, head_dim) q over the K/V
        of every rank's positions; the output has q's shape and dtype."""
        if q.is_meta:  # a pipeline stage's shape inference: no data, so no ring
            return torch.empty_like(q)
        return RingAttention.apply(q, k, v, self)


class _Shift:
    def __init__(self, works: list, received: torch.Tensor):
        self._works = works
        self._received = received

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self._received


def _expand(kv: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a (2, batch, kv_heads, len, dim) block, fp32, one head per query head
    (query head h reads K/V head h // groups, as SDPA's enable_gqa)."""
    kv = kv.float()
    if groups > 1:
        kv = kv.repeat_interleave(groups, dim=2)
    return kv[0], kv[1]


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """A per-query-head (batch, heads, len, dim) gradient summed onto its K/V head."""
    if groups == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.view(b, h // groups, groups, n, d).sum(dim=2)


def _live_part(rank: int, owner: int, local_len: int) -> tuple[slice, slice, bool]:
    """Which of this rank's query rows attend to which of `owner`'s key columns, and whether
    that part needs the causal mask. Under the load-balanced split only the own block is
    diagonal: a lower-indexed owner's first chunk precedes both of ours and its mirror chunk
    follows both (all rows, first half of the keys, unmasked); a higher-indexed owner's chunks
    both follow our first chunk and precede our mirror (second half of the rows, all keys)."""
    everything, chunk = slice(None), local_len // 2
    if owner == rank:
        return everything, everything, True
    if owner < rank:
        return everything, slice(0, chunk), False
    return slice(chunk, local_len), everything, False


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        local_len = q.shape[2]
        groups = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        causal = _causal_mask(local_len, ring, q.device)
        qf = q.float()
        rows = q.shape[:3]
        running_max = torch.full(rows, -math.inf, dtype=torch.float32, device=q.device)
        running_sum = torch.zeros(rows, dtype=torch.float32, device=q.device)
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = torch.stack((k, v))
        for step in range(ring.size):
            shift = ring.shift(block, _KV_TAG) if step < ring.size - 1 else None
            q_rows, k_cols, masked = _live_part(
                ring.rank, (ring.rank - step) % ring.size, local_len
            )
            k_b, v_b = _expand(block[:, :, :, k_cols], groups)
            for tile in _row_tiles(q_rows, local_len):
                scores = (qf[:, :, tile] @ k_b.transpose(-1, -2)) * scale
                if masked:
                    scores = scores.masked_fill(causal[tile], -math.inf)
                # The first block is this rank's own, which holds every query's diagonal: each
                # row's max is finite from then on, so the rescaling never sees -inf - -inf.
                old_max = running_max[:, :, tile]
                new_max = torch.maximum(old_max, scores.amax(dim=-1))
                rescale = torch.exp(old_max - new_max)
                probs = torch.exp(scores - new_max.unsqueeze(-1))
                del scores
                running_sum[:, :, tile] = running_sum[:, :, tile] * rescale + probs.sum(dim=-1)
                acc[:, :, tile] = acc[:, :, tile] * rescale.unsqueeze(-1) + probs @ v_b
                running_max[:, :, tile] = new_max
                del probs
            if shift is not None:
                block = shift.wait()
        out = acc / running_sum.unsqueeze(-1)
        lse = running_max + torch.log(running_sum)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        local_len = q.shape[2]
        groups = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        causal = _causal_mask(local_len, ring, q.device)
        qf, dout = q.float(), grad_out.float()
        # D_i = sum_j P_ij dP_ij = dO_i . O_i (the softmax backward's row term).
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(qf)
        block = torch.stack((k, v))
        # The gradient of the block in hand, travelling with it: after the last hop it is home.
        grad_block = torch.zeros(block.shape, dtype=torch.float32, device=q.device)
        grad_shift = None
        for step in range(ring.size):
            shift = ring.shift(block, _KV_TAG) if step < ring.size - 1 else None
            q_rows, k_cols, masked = _live_part(
                ring.rank, (ring.rank - step) % ring.size, local_len
            )
            k_b, v_b = _expand(block[:, :, :, k_cols], groups)
            grad_k = torch.zeros_like(k_b)
            grad_v = torch.zeros_like(v_b)
            for tile in _row_tiles(q_rows, local_len):
                q_t, dout_t = qf[:, :, tile], dout[:, :, tile]
                scores = (q_t @ k_b.transpose(-1, -2)) * scale
                if masked:
                    scores = scores.masked_fill(causal[tile], -math.inf)
                probs = torch.exp(scores - lse[:, :, tile].unsqueeze(-1))
                del scores
                grad_v += probs.transpose(-1, -2) @ dout_t
                grad_scores = probs * (dout_t @ v_b.transpose(-1, -2) - delta[:, :, tile])
                del probs
                dq[:, :, tile] += (grad_scores @ k_b) * scale
                grad_k += (grad_scores.transpose(-1, -2) @ q_t) * scale
                del grad_scores
            if grad_shift is not None:
                grad_block = grad_shift.wait()
            grad_block[:, :, :, k_cols] += torch.stack(
                (_fold(grad_k, groups), _fold(grad_v, groups))
            )
            if ring.size > 1:
                grad_shift = ring.shift(grad_block, _GRAD_TAG)
            if shift is not None:
                block = shift.wait()
        # A ring of one (blockwise attention without a split) keeps its own gradients.
        grad_kv = grad_block if grad_shift is None else grad_shift.wait()
        return dq.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None


def _row_tiles(rows: slice, local_len: int) -> list[slice]:
    """`rows` of the local queries in tiles of at most `TILE_ROWS`: a block's transient score
    matrices then hold TILE_ROWS rows, not the whole local sequence's."""
    start, stop, _ = rows.indices(local_len)
    return [slice(i, min(i + TILE_ROWS, stop)) for i in range(start, stop, TILE_ROWS)]


def _causal_mask(local_len: int, ring: Ring, device: torch.device) -> torch.Tensor:
    """True where a key of this rank's own block follows the query (global positions)."""
    pos = chunk_positions(local_len * ring.size, ring.size, ring.rank, device)
    return pos.unsqueeze(0) > pos.unsqueeze(1)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Make the Llama decoder (or one of its pipeline stages) run on this rank's positions:
    its rotary table becomes the rows of those positions, so neither a pipeline stage nor
    TP's sequence split needs positions passed per step, and each attention attends over the
    cp ring. Call before tensor parallelism (sequence parallelism then splits the local part)."""
    cp = cp_mesh.size()
    positions = chunk_positions(seq_len, cp, cp_mesh.get_local_rank())
    model.rope = model.rope[positions.to(model.rope.device)]
    ring = Ring(cp_mesh.get_group())
    for block in model.layers.values():
        block.attention.ring = ring
    split_sequences(model, cp_mesh)
