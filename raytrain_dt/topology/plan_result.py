"""What a plan is: the chosen layout (`Candidate`: layout, memory, step time and the reason)
and its alternatives (`Plan`), and the JSON record `plan.json` and the reports read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_dt.topology.cost import StepTime
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.memory import GB, MemoryEstimate


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step_time: StepTime
    reason: str = ""
    host_per_node: float = 0.0  # host bytes its fullest node needs (`host_memory.py`)


@dataclass
class Plan:
    best: Candidate
    alternatives: list[Candidate]
    # Context for reports: model states per rank at the best layout's DP degree and
    # accumulation, TP = PP = 1, as the planned engine holds them at their peak.
    model_states_gb: dict[str, float] = field(default_factory=dict)
    fitting_layouts: int = 0
    memory_budget_gb: float = 0.0

    def to_json(self) -> dict:
        record = _candidate_json(self.best)
        record["model_state_gb_per_rank"] = self.model_states_gb
        record["fitting_layouts"] = self.fitting_layouts
        record["memory_budget_gb"] = self.memory_budget_gb
        record["alternatives"] = [_candidate_json(c) for c in self.alternatives]
        return record


_DIMS_KEYS = ("world_size", "pp", "dp", "tp", "dp_replicate", "dp_shard", "cp", "ep")
_LAYOUT_KEYS = (
    "zero_stage",
    "micro_batch",
    "grad_accum",
    "global_batch",
    "batch_slots",
    "activation_checkpointing",
    "sequence_parallel",
    "offload_optimizer",
    "pp_schedule",
    "virtual_stages",
    "pp_layers",
)


def _candidate_json(c: Candidate) -> dict:
    d, lay = c.layout.dims, c.layout
    gb = c.memory.as_gb()
    return {
        "layout": {
            **{k: getattr(d, k) for k in _DIMS_KEYS},
            **{k: getattr(lay, k) for k in _LAYOUT_KEYS},
        },
        "memory_gb_per_rank": {k: round(v, 3) for k, v in gb.items()},
        "host_memory_gb_per_node": round(c.host_per_node / GB, 3),
        "step_time_s": round(c.step_time.total_s, 6),
        "step_time_breakdown_s": {k: round(v, 6) for k, v in c.step_time.as_dict().items()},
        "reason": c.reason,
    }
