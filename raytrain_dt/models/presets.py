"""Named model shapes, from a CPU-test `tiny` up to 405B, and the arithmetic on a shape.

A `ModelShape` is pure data: the planner reads parameter counts and FLOPs from it without
building anything, so the large presets are used for planning only and never instantiated here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raytrain_dt.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Mixture of experts (0: every block has a dense SwiGLU). A MoE block routes each token to
    # `experts_per_token` (top-k) of `n_experts` SwiGLU experts of inner size `moe_ffn_hidden`
    # (0: ffn_hidden), plus a shared expert of inner size `shared_ffn_hidden` every token
    # passes through (Qwen-MoE; 0: none).
    n_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden: int = 0
    shared_ffn_hidden: int = 0
    # Routing, not parameters: an expert takes at most capacity_factor x tokens x k / n_experts
    # tokens of one sequence (0: no limit), and the load-balancing loss weighs this much.
    capacity_factor: float = 0.0
    router_aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim: {self.dim} is not divisible by model.n_heads={self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads: {self.n_kv_heads} does not divide model.n_heads={self.n_heads}"
            )
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ConfigError(
                f"model.experts_per_token: {self.experts_per_token} must be in 1..model.n_experts"
                f"={self.n_experts}"
            )

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_hidden(self) -> int:
        """Inner size of one routed expert."""
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def expert_params_per_layer(self) -> int:
        """Parameters of one block's routed experts (what expert parallelism splits)."""
        return self.n_experts * 3 * self.dim * self.expert_hidden if self.is_moe else 0

    @property
    def expert_params(self) -> int:
        return self.n_layers * self.expert_params_per_layer

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def params_per_layer(self) -> int:
        kv_dim = self.n_kv_heads * self.head_dim
        attention = self.dim * (self.dim + 2 * kv_dim) + self.dim * self.dim
        if self.is_moe:
            router = self.dim * self.n_experts
            mlp = router + self.expert_params_per_layer + 3 * self.dim * self.shared_ffn_hidden
        else:
            mlp = 3 * self.dim * self.ffn_hidden
        norms = 2 * self.dim
        return attention + mlp + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.embedding_params + self.n_layers * self.params_per_layer + self.dim + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the matmul params a token passes through (the routed
        experts it is sent to, not all of them) plus the attention score/value matmuls."""
        idle_experts = (
            self.n_layers * (self.n_experts - self.experts_per_token) * 3 * self.dim
        ) * self.expert_hidden
        matmul_params = (
            self.num_params
            - self.embedding_params
            + (self.embedding_params if self.tie_embeddings else 0)
            - idle_experts
        )
        attention = 12 * self.n_layers * self.dim * seq_len
        return 6.0 * matmul_params + attention


PRESETS: dict[str, ModelShape] = {
    # ~0.4M parameters with a byte vocabulary: fast enough for CPU tests at 4 ranks.
    "tiny": ModelShape(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=176),
    # ~10.8M parameters: the memory benchmark's model (the overhead benchmark narrows it).
    "small": ModelShape(
        dim=384, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=256, ffn_hidden=1024
    ),
    # tiny with 4 experts (top-2) in every block: the expert-parallel tests' model.
    "moe-tiny": ModelShape(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        ffn_hidden=176,
        n_experts=4,
        experts_per_token=2,
        moe_ffn_hidden=96,
    ),
    "llama-1b": ModelShape(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=8192,
        tie_embeddings=True,
        rope_theta=500000.0,
    ),
    "llama-7b": ModelShape(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, ffn_hidden=11008
    ),
    "llama-13b": ModelShape(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, ffn_hidden=13824
    ),
    "llama-70b": ModelShape(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=28672,
        rope_theta=500000.0,
    ),
    "llama-405b": ModelShape(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=53248,
        rope_theta=500000.0,
    ),
    # Mixtral 8x7B and 8x22B (Mistral AI's configs): 8 experts, top-2, in every block.
    "mixtral-8x7b": ModelShape(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_hidden=14336,
        rope_theta=1e6,
        n_experts=8,
        experts_per_token=2,
    ),
    "mixtral-8x22b": ModelShape(
        dim=6144,
        n_layers=56,
        n_heads=48,
        n_kv_heads=8,
        vocab_size=32768,
        ffn_hidden=16384,
        rope_theta=1e6,
        n_experts=8,
        experts_per_token=2,
    ),
}


def resolve_shape(preset: str, **overrides: object) -> ModelShape:
    """The preset's shape with every non-null override applied."""
    if preset not in PRESETS:
        raise ConfigError(f"model.preset: {preset!r} is not one of {', '.join(PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(PRESETS[preset], **changes)
