"""A Llama-style decoder: RMSNorm, RoPE, grouped-query causal attention through SDPA, SwiGLU.

Blocks are kept in `layers` (a ModuleDict keyed by index string) so that pipeline stages can
drop the layers they do not own without renumbering, and FSDP/TP plans address them by name.
Parameter names follow the torchtitan/Meta layout; `checkpoint.export` maps them to Hugging
Face names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from raytrain_dt.models.materialize import ParamInit
from raytrain_dt.models.moe import GroupedExperts, MoEFeedForward
from raytrain_dt.models.presets import ModelShape


def rope_cache(shape: ModelShape, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin table of shape (seq_len, head_dim/2, 2), in fp32."""
    half = shape.head_dim // 2
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, half, device=device).float() / half))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by position, pairing the two halves (HF convention)."""
    seq_len = x.shape[1]
    cos = cache[:seq_len, :, 0].repeat(1, 2)[None, :, None, :].to(x.dtype)
    sin = cache[:seq_len, :, 1].repeat(1, 2)[None, :, None, :].to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    # Context parallelism (`parallel.context_parallel.apply_context_parallel`) sets a ring: the
    # layer then holds a slice of the sequence and attends over every cp rank's keys and values.
    ring = None

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.n_heads = shape.n_heads
        self.n_kv_heads = shape.n_kv_heads
        self.head_dim = shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.n_heads * shape.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.n_kv_heads * shape.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.n_kv_heads * shape.head_dim, bias=False)
        self.wo = nn.Linear(shape.n_heads * shape.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 for the head count: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.ring is not None:
            out = self.ring.attend(q, k, v)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
            )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(shape.dim, shape.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(shape.ffn_hidden, shape.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.feed_forward = MoEFeedForward(shape) if shape.is_moe else FeedForward(shape)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaDecoder(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, shape: ModelShape, max_seq_len: int):
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(shape) for i in range(shape.n_layers)}
        )
        self.norm = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.output = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not a parameter and not saved: rebuilt from the shape, so checkpoints stay layout-free.
        self.register_buffer("rope", rope_cache(shape, max_seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds None for the ends it does not own: the first stage takes token
        # ids, later stages take hidden states, and only the last stage produces logits.
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None else self.output(h)


def llama_param_init(shape: ModelShape, name: str, module: nn.Module) -> ParamInit:
    """The decoder's init (`ModelSpec.param_init`): norms 1, normal(0.02) elsewhere, with the
    residual output projections (attention `wo`, MLP and experts' `w2`) scaled down by depth."""
    # By module, not by the parameter's shape: under ZeRO-3 it is an empty partition.
    if isinstance(module, nn.RMSNorm):
        return ParamInit.ones()
    if name.endswith(("wo.weight", "w2.weight")) or (
        isinstance(module, GroupedExperts) and name.endswith(".w2")
    ):
        return ParamInit.normal(0.02 / math.sqrt(2 * shape.n_layers))
    return ParamInit.normal(0.02)


def build_model(shape: ModelShape, max_seq_len: int, seed: int) -> LlamaDecoder:
    """The full model on CPU in this process, with the initial weights of every layout."""
    from raytrain_dt.models.model_spec import llama_spec

    return llama_spec(shape).build(max_seq_len, seed)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of predicting tokens[:, 1:] from logits[:, :-1], in fp32.

    Vocab-sharded DTensor logits (tensor parallelism) give a replicated DTensor loss under
    `loss_parallel`; it is returned as the plain (differentiable) local tensor, so callers
    need not know.
    """
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten().long())
    return loss.to_local() if isinstance(loss, DTensor) else loss
