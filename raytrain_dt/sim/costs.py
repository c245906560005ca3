"""What things cost in simulated time and money.

`Costs` holds the recovery costs (the phases the elastic benchmark splits a recovery into:
detection, re-plan, re-form, checkpoint load, first step), checkpoint save/load costs (by default
derived from the model's checkpoint bytes and the storage bandwidth; see `sim/sim_planner.py`) and
prices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.memory import STATE_BYTES


@dataclass(frozen=True)
class Costs:
    # Recovery phases, seconds. Defaults are assumptions for a 1,024-node GPU cluster; the
    # validation test calibrates them from a real run's events.
    detection_s: float = 30.0  # a node lost without notice until the coordinator acts
    replan_s: float = 1.0
    reform_s: float = 60.0  # process groups, mesh, model and optimizer on reused actors
    actor_start_s: float = 60.0  # new processes (new nodes; every process on a cold restart)
    first_step_extra_s: float = 30.0  # the first step after a formation, beyond a normal one
    # The first step of a formation that started actors (a growth onto a new node, a cold
    # restart), beyond a normal one: their first collectives form their connections lazily (on
    # GPUs, NCCL's communicators), their allocators and data readers warm up. None: as above.
    new_actor_first_step_extra_s: float | None = None
    # The re-form of a formation that started actors, in place of `reform_s`: actors counted up
    # once torch is imported still finish their warm-up (torch's lazy imports) before their
    # first process groups form, and the kept ones wait for them there. None: `reform_s`.
    new_actor_reform_s: float | None = None
    # Checkpoints; None derives them from the checkpoint bytes and the bandwidths below.
    ckpt_save_s: float | None = None  # a full, committed write (the JIT save on a notice)
    ckpt_load_s: float | None = None
    ckpt_stall_s: float | None = None  # what an async periodic save blocks (CPU staging)
    storage_gb_per_s: float = 100.0  # aggregate bandwidth of the checkpoint storage
    node_storage_gb_per_s: float = 2.0  # per node
    # DP-only (torchft-like) resize: the quorum change, and a joining replica's state transfer
    # from a peer (runs beside training).
    dp_reconfigure_s: float = 5.0
    dp_join_s: float = 120.0
    # In-memory copies (`checkpoint.memory_every_steps`): a drain's hand-over of the state held
    # in host memory (instead of a durable JIT save), and a re-formation's restore from the
    # surviving copies, own and peers' (instead of the checkpoint load). Copies hide behind the
    # step, so steps cost nothing more.
    memory_copy_s: float = 2.0
    memory_restore_s: float = 5.0
    # Node arrival: from the trace's UP (or a chaos add_node) until the node is usable.
    arrival_lag_s: float = 0.0
    # Prices, $ per GPU-hour.
    spot_usd_per_gpu_h: float = 2.0
    on_demand_usd_per_gpu_h: float = 4.5
    # Measured step times by world size; they replace the step-time model where given.
    step_s_by_world: dict[int, float] = field(default_factory=dict)


def checkpoint_bytes(shape: ModelShape, precision: str) -> float:
    """Params plus optimizer states (gradients are not saved)."""
    p_bytes, _, opt_bytes = STATE_BYTES[precision]
    return float(shape.num_params) * (p_bytes + opt_bytes)
