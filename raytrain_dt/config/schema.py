"""The typed configuration schema: one dataclass per section, the single source of every setting.

Recipes in conf/ and CLI dotlist overrides are merged onto these dataclasses by
`raytrain_dt.config.load`; OmegaConf enforces key names and types, and `validate()` here
enforces ranges and cross-field rules. Nothing else in the code base defines a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raytrain_dt.errors import ConfigError


@dataclass
class RunConfig:
    name: str = "run"
    # Where everything the run writes goes: config, logs, metrics, checkpoints.
    dir: str = "runs/${run.name}"
    seed: int = 1234


@dataclass
class ModelConfig:
    # A named preset from raytrain_dt.models.presets; the fields below override it when set.
    preset: str = "tiny"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    ffn_hidden: int | None = None
    tie_embeddings: bool | None = None


@dataclass
class DataConfig:
    # A directory of parquet files with an int32 list column `tokens` (see `prepare-data`).
    path: str = "data/stdlib_tokens"
    seq_len: int = 128
    # Text files to tokenize when `path` does not exist yet; null means the Python stdlib corpus.
    text_glob: str | None = None
    # Seed of the per-epoch global sample permutation; the data order depends on nothing else.
    shuffle_seed: int = 0
    # Micro-batches each rank's Ray Data iterator keeps ready ahead of the train step.
    prefetch_batches: int = 4


@dataclass
class TrainerConfig:
    steps: int = 20
    # Sequences per optimizer step: the one number that defines the math. Kept across resizes.
    global_batch: int = 8
    # Per-rank sequences per forward pass; derived from global_batch and the DP degree when null.
    micro_batch: int | None = None
    # Micro-steps per optimizer step; derived when null.
    grad_accum: int | None = None
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    log_every: int = 1


@dataclass
class ParallelConfig:
    # Each degree is chosen by the planner when null, and pinned when set.
    tp: int | None = None
    pp: int | None = None
    dp_replicate: int | None = None
    dp_shard: int | None = None
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False


@dataclass
class EngineConfig:
    name: str = "fsdp2"
    # 0 (plain data parallel), 1, 2 or 3; chosen by the planner when null. FSDP2 maps 0 to
    # replicate (DDP), 1 and 2 to grad-op sharding (reshard_after_forward=False), 3 to full.
    zero_stage: int | None = None
    offload_optimizer: bool = False
    # auto: bf16 compute with fp32 master weights on GPU, fp32 on CPU.
    precision: str = "auto"


@dataclass
class ClusterConfig:
    # Ray address to join; null means RAY_ADDRESS, and without that an embedded local instance.
    address: str | None = None
    # Embedded instance only: simulated nodes and accelerators on each.
    local_nodes: int = 1
    accelerators_per_node: int = 2
    # The Ray resource that stands for one accelerator. Null: GPU where GPUs exist, else a
    # custom resource the embedded instance declares (and a real CPU cluster must declare).
    accelerator_resource: str | None = None
    # Ranks to run; null means every accelerator the cluster has.
    num_ranks: int | None = None
    cpus_per_rank: float = 0.5
    # What the planner assumes per accelerator. Null: read from the cluster (GPU defaults to
    # 80 GB H100s; CPU "accelerators" get the node's Ray memory divided among them).
    memory_per_accelerator_gb: float | None = None
    peak_tflops: float | None = None
    # Seconds to wait for the placement group before giving up with a clear message.
    placement_timeout_s: float = 60.0


@dataclass
class CheckpointConfig:
    # Save every N optimizer steps; 0 disables periodic saves.
    every_steps: int = 10
    # Null means run.dir/checkpoints.
    dir: str | None = None
    # Retention: the newest `keep_last` committed checkpoints, plus every step that is a
    # multiple of `keep_every` (0: none). Two by default, so a damaged newest has a fallback.
    keep_last: int = 2
    keep_every: int = 0
    # Stage shards to CPU and write them in the background (DCP async save).
    async_save: bool = True


@dataclass
class ElasticConfig:
    # Bounds on the nodes the run uses; below min_nodes it waits (up to wait_timeout_s), then
    # fails with the latest checkpoint intact. Null max_nodes: every node the cluster offers.
    min_nodes: int = 1
    max_nodes: int | None = None
    # Failure restarts before the run gives up (a repeating failure at one step stops sooner).
    max_restarts: int = 5
    # Same step failing this many times in a row is reported as deterministic, not retried.
    max_failures_at_step: int = 2
    wait_timeout_s: float = 300.0
    # No completed step for this long while training: the group is hung and is torn down.
    hang_timeout_s: float = 60.0
    # Grow only after new capacity has stayed this long (hysteresis against flapping nodes).
    grow_stable_s: float = 2.0
    # Node-local spot notice endpoint (AWS: http://169.254.169.254/latest/meta-data/spot/
    # instance-action); null disables the watcher.
    spot_notice_url: str | None = None


@dataclass
class ChaosAction:
    """Deterministic fault injection for tests and demos."""

    at_step: int = 1
    # kill_rank | kill_node | preempt_node | add_node | hang_rank
    action: str = "kill_rank"
    # A rank for kill_rank/hang_rank; for node actions the node holding that rank.
    target: int = 0


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    chaos: list[ChaosAction] = field(default_factory=list)
    # Seconds added to every step while chaos is configured, so that faults a few steps apart
    # play out one after another (a node arrival takes seconds; tiny CPU steps take 0.1 s).
    chaos_step_delay_s: float = 0.0
    # Continue from the newest intact checkpoint in the run's checkpoint directory (a fresh
    # start when there is none), so a restarted driver or resubmitted job picks the run up.
    # false refuses to start over a run directory that already has checkpoints.
    resume: bool = True


_CHOICES: dict[str, tuple[Any, ...]] = {
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved"),
    "engine.name": ("fsdp2", "deepspeed"),
    "engine.zero_stage": (None, 0, 1, 2, 3),
    "engine.precision": ("auto", "fp32", "bf16"),
}

# Accepted by the schema (the planner reasons about them) but not yet run by the engines.
_NOT_YET: dict[str, tuple[Any, ...]] = {
    "engine.name": ("fsdp2", "deepspeed"),
}

CHAOS_ACTIONS = ("kill_rank", "kill_node", "preempt_node", "add_node", "hang_rank")

_POSITIVE = (
    "data.seq_len",
    "data.prefetch_batches",
    "trainer.steps",
    "trainer.global_batch",
    "trainer.micro_batch",
    "trainer.grad_accum",
    "trainer.log_every",
    "parallel.tp",
    "parallel.pp",
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "parallel.virtual_stages",
    "cluster.local_nodes",
    "cluster.accelerators_per_node",
    "cluster.num_ranks",
    "cluster.cpus_per_rank",
    "cluster.memory_per_accelerator_gb",
    "cluster.peak_tflops",
    "cluster.placement_timeout_s",
    "elastic.min_nodes",
    "elastic.max_nodes",
    "elastic.max_failures_at_step",
    "elastic.wait_timeout_s",
    "elastic.hang_timeout_s",
    "checkpoint.keep_last",
    "model.dim",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.vocab_size",
    "model.ffn_hidden",
)

_NON_NEGATIVE = (
    "trainer.lr",
    "trainer.warmup_steps",
    "trainer.weight_decay",
    "trainer.grad_clip",
    "checkpoint.every_steps",
    "checkpoint.keep_every",
    "elastic.max_restarts",
    "elastic.grow_stable_s",
)


def _get(cfg: TrainConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Range and cross-field checks; raises ConfigError naming the key at fault."""
    for key, allowed in _CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")
    for key in _POSITIVE:
        value = _get(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    for key in _NON_NEGATIVE:
        value = _get(cfg, key)
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    t = cfg.trainer
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"trainer.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
    for key in ("trainer.beta1", "trainer.beta2"):
        if not 0.0 <= _get(cfg, key) < 1.0:
            raise ConfigError(f"{key}: must be in [0, 1), got {_get(cfg, key)}")
    if t.warmup_steps > t.steps:
        raise ConfigError(f"trainer.warmup_steps: {t.warmup_steps} exceeds trainer.steps={t.steps}")
    if t.micro_batch and t.grad_accum and t.global_batch % (t.micro_batch * t.grad_accum):
        raise ConfigError(
            f"trainer.global_batch: {t.global_batch} is not a multiple of "
            f"trainer.micro_batch x trainer.grad_accum = {t.micro_batch * t.grad_accum}"
        )
    for key, supported in _NOT_YET.items():
        if _get(cfg, key) not in supported:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} is not supported by this version yet")
    for i, action in enumerate(cfg.chaos):
        if action.action not in CHAOS_ACTIONS:
            raise ConfigError(
                f"chaos[{i}].action: {action.action!r} is not one of {', '.join(CHAOS_ACTIONS)}"
            )
        if action.at_step < 1:
            raise ConfigError(f"chaos[{i}].at_step: must be >= 1, got {action.at_step}")
    if cfg.chaos_step_delay_s < 0:
        raise ConfigError(f"chaos_step_delay_s: must be >= 0, got {cfg.chaos_step_delay_s}")
    e = cfg.elastic
    if e.max_nodes is not None and e.max_nodes < e.min_nodes:
        raise ConfigError(f"elastic.max_nodes: {e.max_nodes} < elastic.min_nodes={e.min_nodes}")
    if cfg.data.seq_len < 2:
        raise ConfigError(f"data.seq_len: must be >= 2, got {cfg.data.seq_len}")
    return cfg
