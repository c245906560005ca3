"""The typed configuration schema: one dataclass per section, the single source of every setting.

Recipes in conf/ and CLI dotlist overrides are merged onto these dataclasses by
`raytrain_dt.config.load`; OmegaConf enforces key names and types, and
`raytrain_dt.config.validation` ranges and cross-field rules. Nothing else in the code base
defines a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunConfig:
    # Name of the run; the default run.dir is runs/<name>.
    name: str = "run"
    # Where everything the run writes goes: config, logs, metrics, checkpoints.
    dir: str = "runs/${run.name}"
    # Seed of the initial weights (identical on every rank) and of the ranks' random state.
    seed: int = 1234


@dataclass
class ModelConfig:
    # A named preset from raytrain_dt.models.presets; the fields below override it when set.
    preset: str = "tiny"
    # Hidden size (the model's width).
    dim: int | None = None
    # Transformer blocks.
    n_layers: int | None = None
    # Attention heads; must divide model.dim.
    n_heads: int | None = None
    # Key/value heads (grouped-query attention); must divide model.n_heads.
    n_kv_heads: int | None = None
    # Vocabulary size; at least 256, the byte tokenizer's ids.
    vocab_size: int | None = None
    # Inner size of the SwiGLU feed-forward block.
    ffn_hidden: int | None = None
    # Share the output projection's weights with the token embedding.
    tie_embeddings: bool | None = None
    # Mixture of experts: experts per MoE block (0: dense SwiGLU blocks), e.g. preset moe-tiny.
    n_experts: int | None = None
    # Experts each token is routed to (top-k).
    experts_per_token: int | None = None
    # Inner size of each expert's SwiGLU; 0 means model.ffn_hidden.
    moe_ffn_hidden: int | None = None
    # Tokens an expert takes per sequence: capacity_factor x tokens x experts_per_token /
    # n_experts; a token's assignments past that are dropped (and counted). 0: no capacity.
    capacity_factor: float | None = None
    # Weight of the router's load-balancing auxiliary loss, added to the training loss.
    router_aux_loss_coef: float | None = None
    # Initial weights for a fresh run: a directory of Hugging Face-format Llama safetensors
    # (`ckpt consolidate` output) whose config.json matches this shape. Ignored on resume.
    init_from: str | None = None
    # A Hugging Face causal LM instead of the preset: a local directory (its weights are loaded
    # when it has any) or a model type such as `llama` (random init; nothing is downloaded).
    hf: str | None = None
    # Fields set on that model's transformers config, e.g. {num_hidden_layers: 2}.
    hf_config: dict[str, Any] = field(default_factory=dict)
    # auto: load the directory's weights when it has them; random; weights.
    hf_init: str = "auto"


@dataclass
class DataConfig:
    # A directory of parquet files with an int32 list column `tokens` (see `prepare-data`);
    # local, or s3://BUCKET/PREFIX (read with pyarrow's S3 filesystem, docs/cloud.md).
    path: str = "data/stdlib_tokens"
    # Tokens per training sequence; must match the prepared dataset.
    seq_len: int = 128
    # Text files to tokenize when `path` does not exist yet; null means the Python stdlib corpus.
    text_glob: str | None = None
    # Seed of the per-epoch global sample permutation; the data order depends on nothing else.
    shuffle_seed: int = 0
    # Micro-batches each rank's Ray Data iterator keeps ready ahead of the train step.
    prefetch_batches: int = 4
    # Your own data instead of `path`: parquet, JSONL or text files (a file, directory or glob)
    # or a `datasets` directory (save_to_disk); files may be on s3:// (a file, prefix or glob).
    # Tokenized and packed into seq_len sequences once, into a token dataset cached under
    # cache_dir by a hash of the source and settings.
    source: str | None = None
    # auto (from file names), parquet, json, text or hf.
    format: str = "auto"
    # The column with each document's text (tokenized by `tokenizer`).
    text_column: str = "text"
    # A column with each document's token ids instead; when set, text_column is not read.
    token_column: str | None = None
    # bytes (UTF-8 bytes, vocabulary 256) or a local Hugging Face tokenizer directory.
    tokenizer: str = "bytes"
    # Where packed user datasets are cached; null: run.dir/data_cache.
    cache_dir: str | None = None


@dataclass
class TrainerConfig:
    # Optimizer steps in total; a resumed run continues up to this step.
    steps: int = 20
    # Sequences per optimizer step: the one number that defines the math. Kept across resizes.
    global_batch: int = 8
    # Fraction by which the global batch may drop while nodes are missing, in [0, 1): the planner
    # may train (1 - t) x global_batch <= B' <= global_batch samples per step when B' fits the
    # ranks better. The loss is normalised per real sample. 0: the exact batch, always.
    batch_tolerance: float = 0.0
    # Per-rank sequences per forward pass; derived from global_batch and the DP degree when null.
    micro_batch: int | None = None
    # Micro-steps per optimizer step; derived when null.
    grad_accum: int | None = None
    # Peak learning rate: linear warm-up to it, then cosine decay to lr x min_lr_ratio at the last
    # step.
    lr: float = 3e-3
    # Final learning rate as a fraction of trainer.lr, in [0, 1].
    min_lr_ratio: float = 0.1
    # Steps of linear warm-up from lr/warmup_steps to lr; at most trainer.steps.
    warmup_steps: int = 5
    # AdamW decoupled weight decay, on matrices only (not norms).
    weight_decay: float = 0.1
    # AdamW decay of the first moment, in [0, 1).
    beta1: float = 0.9
    # AdamW decay of the second moment, in [0, 1).
    beta2: float = 0.95
    # AdamW epsilon (the test recipe uses 1e-6: see conf/test.yaml).
    eps: float = 1e-8
    # Clip the global gradient norm to this; 0 disables clipping.
    grad_clip: float = 1.0
    # Recompute each block's activations in the backward pass (less memory, more compute). true
    # forces it; false leaves it to the planner.
    activation_checkpointing: bool = False
    # The driver logs rank 0's step metrics (loss, tokens/s, MFU, memory) every N steps.
    log_every: int = 10
    # Also write TensorBoard event files to run.dir/tensorboard (metrics.jsonl is always written).
    tensorboard: bool = False


@dataclass
class ParallelConfig:
    # Tensor-parallel degree, within a node. Every degree in this section is chosen by the planner
    # when null, and pinned when set.
    tp: int | None = None
    # Pipeline stages, placed across nodes.
    pp: int | None = None
    # Data-parallel replicas of the (sharded) model: HSDP's replicate dimension.
    dp_replicate: int | None = None
    # Data-parallel ranks one model replica is sharded across (FSDP/ZeRO).
    dp_shard: int | None = None
    # Pipeline schedule: gpipe, 1f1b, or interleaved (1F1B with parallel.virtual_stages per rank).
    pp_schedule: str = "1f1b"
    # Pipeline stages per rank, for the interleaved schedule.
    virtual_stages: int = 1
    # Blocks per pipeline stage, e.g. [7, 8, 8, 7] (pp x virtual_stages entries summing to
    # model.n_layers); null: balanced by cost, the end stages carrying the embedding and head.
    pp_layers: list[int] | None = None
    # With tensor parallelism, also split norms and residuals along the sequence (Megatron SP).
    sequence_parallel: bool = False
    # Context-parallel degree: each sequence is split over cp ranks (2 x cp load-balanced causal
    # chunks; data.seq_len must divide into them) that run ring attention and read the same
    # samples.
    cp: int | None = None
    # Expert-parallel degree (MoE models): each MoE block's experts are split over ep of the
    # dp_shard ranks, which exchange tokens by all-to-all; must divide model.n_experts and the
    # dp_shard degree.
    ep: int | None = None


@dataclass
class EngineConfig:
    # fsdp2 (torch FSDP2/DTensor: every layout) or deepspeed (ZeRO 1-3 data parallel, and
    # ZeRO-1 with pipeline stages; no tensor parallelism).
    name: str = "fsdp2"
    # 0 (plain data parallel), 1, 2 or 3; chosen by the planner when null. FSDP2 maps 0 to
    # replicate (DDP), 1 and 2 to grad-op sharding (reshard_after_forward=False), 3 to full.
    zero_stage: int | None = None
    # Keep optimizer state in CPU memory (needs zero_stage >= 1). true forces it; false leaves it to
    # the planner.
    offload_optimizer: bool = False
    # auto: bf16 compute with fp32 master weights on GPU, fp32 on CPU.
    precision: str = "auto"
    # When FSDP2 at zero_stage 2/3 reduces gradients under accumulation. final: only the last
    # micro-step reduce-scatters (full unsharded gradients are held between micro-steps: less
    # traffic, more memory); every: each micro-step reduce-scatters (sharded gradients only);
    # auto: the planner picks final where it fits. Stages 0/1 and pipeline stages always sync
    # at the final micro-step; DeepSpeed ZeRO-2/3 always reduce every micro-step.
    grad_sync: str = "auto"


@dataclass
class ClusterConfig:
    # Ray address to join; null means RAY_ADDRESS, and without that an embedded local instance.
    address: str | None = None
    # The ranks' compute device: cuda (nccl), cpu (gloo), emulated (a device type of its own in
    # host memory whose collectives refuse host tensors as NCCL does: CPU CI's stand-in for a
    # GPU, built by `make install`) or auto (cuda where the ranks see one, else cpu).
    device: str = "auto"
    # Embedded instance only: simulated nodes and accelerators on each.
    local_nodes: int = 1
    # Embedded instance only: accelerators on each simulated node.
    accelerators_per_node: int = 2
    # The Ray resource that stands for one accelerator. Null: GPU where GPUs exist, else a
    # custom resource the embedded instance declares (and a real CPU cluster must declare).
    accelerator_resource: str | None = None
    # Ranks to run; null means every accelerator the cluster has.
    num_ranks: int | None = None
    # Ray CPUs each rank actor reserves.
    cpus_per_rank: float = 0.5
    # Ray CPUs reserved with each rank, on its node, for its Ray Data input pipeline's tasks
    # (in the rank's placement-group bundle, beside cpus_per_rank).
    data_cpus_per_rank: float = 0.25
    # What the planner assumes per accelerator. Null: read from the cluster (GPU defaults to
    # 80 GB H100s; CPU "accelerators" get the node's Ray memory divided among them).
    memory_per_accelerator_gb: float | None = None
    # Peak dense TFLOP/s of one accelerator, for the planner and MFU. Null: by device name for
    # known GPUs (raytrain_dt/observe/mfu.py), else an H100; a CPU "accelerator" assumes 0.1.
    peak_tflops: float | None = None
    # Seconds to wait for the placement group before giving up with a clear message.
    placement_timeout_s: float = 60.0
    # Host memory of one node, GB, that the planner fits offloaded states, async checkpoint
    # staging buffers and the rank processes into. Null: Ray's `memory` of the smallest node.
    host_memory_gb: float | None = None
    # Names of driver environment variables the rank actors get with the driver's values (e.g.
    # [AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY] where nodes have no instance role). Nothing
    # else of the driver's environment is passed on: Ray keeps an actor's environment in the GCS
    # and shows it in the dashboard. comm.env sets values of its own.
    forward_env: list[str] = field(default_factory=list)
    # Seconds a finished run's healthy rank actors stay up for the next run of the same driver
    # (the Python API called again: a sweep, a notebook), which then skips their start (a
    # process importing torch: seconds each). They hold their accelerators meanwhile, so 0
    # (the default) releases them when the run ends. Reused only by a run with the same
    # resource, CPUs per rank, device and actor environment.
    keep_warm_s: float = 0.0


@dataclass
class CheckpointConfig:
    # Save every N optimizer steps; 0 disables periodic saves.
    every_steps: int = 10
    # Null means run.dir/checkpoints.
    dir: str | None = None
    # Retention: the newest `keep_last` committed checkpoints, plus every step that is a
    # multiple of `keep_every` (0: none). Two by default, so a damaged newest has a fallback.
    keep_last: int = 2
    # Also keep every checkpoint whose step is a multiple of this (0: none).
    keep_every: int = 0
    # Stage shards to CPU and write them in the background (DCP async save).
    async_save: bool = True
    # Where an async save's bytes are written: "process", a writer process forked at each
    # rank's start, whose GIL is its own (a writer thread takes the GIL from the training
    # thread, which on a GPU launches the kernels); "thread", DCP's writer thread in the rank.
    async_writer: str = "process"
    # Every N steps each rank copies its state into host memory, its own and a peer's on
    # another node, in the background: a failure resumes from the copies without rollback
    # (FSDP2; DeepSpeed resumes from durable checkpoints). 0 disables the copies. null (the
    # default): 1 where the ranks have GPUs (a device-to-host copy beside the step, the rest on
    # the host's own cores), 0 on CPU ranks, where a copy competes with the step for the same
    # cores (each copy costs a rank of bench/bench_overhead.py about 18 ms of CPU, 14% of its
    # step's) (`memory_copy_interval`).
    memory_every_steps: int | None = None
    # GB/s one rank is assumed to write (and read) its share of a checkpoint at, until a commit
    # has measured it: what save, drain and load deadlines are sized with. Conservative.
    assumed_write_gbps: float = 0.1


def memory_copy_interval(checkpoint: CheckpointConfig, on_gpu: bool) -> int:
    """Steps between in-memory copies: `checkpoint.memory_every_steps`, its null (the default)
    resolved for ranks on GPUs or not (see the key's comment)."""
    if checkpoint.memory_every_steps is None:
        return 1 if on_gpu else 0
    return checkpoint.memory_every_steps


@dataclass
class ElasticConfig:
    # Bounds on the nodes the run uses; below min_nodes it waits (up to wait_timeout_s), then
    # fails with the latest checkpoint intact. Null max_nodes: every node the cluster offers.
    min_nodes: int = 1
    # At most this many nodes; null: every node the cluster offers. When set, the coordinator also
    # asks the autoscaler for that many.
    max_nodes: int | None = None
    # Failure restarts before the run gives up (a repeating failure at one step stops sooner).
    max_restarts: int = 5
    # Same step failing this many times in a row is reported as deterministic, not retried.
    max_failures_at_step: int = 2
    # Seconds to wait for capacity (below elastic.min_nodes, or nodes no layout fits), before
    # stopping.
    wait_timeout_s: float = 300.0
    # The least time without a completed step that counts as a hang: the group is torn down.
    # The bound in force is the larger of this and elastic.hang_step_multiple x the p99 of the
    # recent step times (before those are measured: the planner's step-time estimate).
    hang_timeout_s: float = 60.0
    # A hang is no step for this many times the p99 of the layout's recent step times; at least 1.
    hang_step_multiple: float = 5.0
    # Seconds a formation may take (placement, actor start, process group, build) before it
    # counts as failed, plus the time a resumed checkpoint takes to load at the write rate.
    formation_timeout_s: float = 900.0
    # Grow only after new capacity has stayed this long (hysteresis against flapping nodes).
    grow_stable_s: float = 2.0
    # Node-local spot notice endpoint, polled by every rank (404 = no notice). `{node_id}` is
    # replaced by the Ray node id (lets one loopback server play several simulated nodes).
    # Null disables the watcher.
    spot_notice_url: str | None = "http://169.254.169.254/latest/meta-data/spot/instance-action"
    # After SIGTERM a rank reports a preemption notice and exits by itself this much later.
    sigterm_grace_s: float = 60.0


@dataclass
class CommConfig:
    """NCCL/Gloo settings for the rank actors (see raytrain_dt/control/comm_env.py)."""

    # Collective timeout given to init_process_group (torch's default is 30 minutes).
    timeout_s: float = 600.0
    # Inter-node transport for NCCL: auto (NCCL detects: EFA plugin, InfiniBand, else sockets),
    # ib (InfiniBand with GPUDirect RDMA) or socket (TCP only, InfiniBand off).
    network: str = "auto"
    # Network interface for NCCL and Gloo traffic between nodes (e.g. ens5); null: NCCL's
    # choice and the host's address for Gloo. Single-node runs use loopback.
    socket_ifname: str | None = None
    # NCCL_ALGO (e.g. Ring, Tree); null leaves it to NCCL's tuner.
    algo: str | None = None
    # NCCL_PROTO (LL, LL128, Simple); null leaves it to NCCL's tuner.
    proto: str | None = None
    # NCCL_BUFFSIZE in bytes; null keeps NCCL's 4 MiB.
    buffsize_bytes: int | None = None
    # TORCH_NCCL_BLOCKING_WAIT: raise a timed-out collective in the train thread (debugging).
    blocking_wait: bool = False
    # NCCL_DEBUG level: VERSION, WARN, INFO or TRACE.
    debug: str = "WARN"
    # Collectives kept by torch's NCCL flight recorder, dumped to run.dir/logs on a timeout.
    trace_buffer: int = 2000
    # Extra environment variables for the rank actors; they win over everything above.
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class MlflowConfig:
    """Logged by the driver (`observe/trackers.py`): the resolved config as params, per step
    loss, lr, grad norm, tokens/s, MFU and world size, and per event recoveries and goodput."""

    # MLflow tracking server (http://HOST:5000) or store (sqlite:///mlflow.db) to log the run
    # to; null: no MLflow. Needs the mlflow package (`pip install "raytrain_dt[trackers]"`);
    # credentials come from MLflow's own environment variables (MLFLOW_TRACKING_TOKEN, ...).
    tracking_uri: str | None = None
    # Experiment the run is logged under; created when it does not exist.
    experiment: str = "raytrain_dt"
    # Name of the MLflow run; null: run.name. A driver that resumes the run directory logs to
    # the same MLflow run.
    run_name: str | None = None


@dataclass
class WandbConfig:
    """Logged by the driver, as for MLflow; W&B plots the metrics against `step`."""

    # Log the run to Weights & Biases. Needs the wandb package (`raytrain_dt[trackers]`).
    enabled: bool = False
    # online (needs `wandb login` or WANDB_API_KEY), offline (files under metrics.wandb.dir
    # only, no network; upload later with `wandb sync`) or disabled; null: W&B's own choice
    # (WANDB_MODE, else online).
    mode: str | None = None
    # W&B project.
    project: str = "raytrain_dt"
    # W&B entity (user or team); null: the account's default.
    entity: str | None = None
    # Name of the W&B run; null: run.name. A driver that resumes the run directory logs to the
    # same W&B run.
    run_name: str | None = None
    # Where W&B keeps its files (a wandb/ folder in it); null: run.dir.
    dir: str | None = None


@dataclass
class MetricsConfig:
    """Experiment trackers the driver logs the run to, besides metrics.jsonl (see
    docs/observability.md); none by default."""

    # MLflow, on when metrics.mlflow.tracking_uri is set.
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # Weights & Biases, on when metrics.wandb.enabled is true.
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ChaosAction:
    """Deterministic fault injection for tests and demos."""

    # The step at whose boundary the action fires.
    at_step: int = 1
    # kill_rank | kill_node | preempt_node | add_node | hang_rank | kill_rank_mid_save (the rank
    # dies while writing the checkpoint of at_step, after its shards, before the save completes)
    action: str = "kill_rank"
    # A rank for kill_rank/hang_rank; for node actions the node holding that rank.
    target: int = 0
    # step: at the boundary of at_step | forming: during the first (re)formation once the run
    # has begun at_step: kill_node after the actors are placed and before they set up;
    # kill_rank as that rank (of the new layout) begins joining its peers | joined: kill_rank
    # in that formation once every peer has joined, as the process groups form
    at: str = "step"


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
    comm: CommConfig = field(default_factory=CommConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    chaos: list[ChaosAction] = field(default_factory=list)
    # Seconds added to every step while chaos is configured, so that faults a few steps apart
    # play out one after another (a node arrival takes seconds; tiny CPU steps take 0.1 s).
    chaos_step_delay_s: float = 0.0
    # Continue from the newest intact checkpoint in the run's checkpoint directory (a fresh
    # start when there is none), so a restarted driver or resubmitted job picks the run up.
    # false refuses to start over a run directory that already has checkpoints.
    resume: bool = True
