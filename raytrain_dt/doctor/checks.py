"""The doctor's checks. Each takes what it needs and returns `Check`s; none raises for a
problem it finds (a failure is a FAIL line), so one broken part never hides the others.

The training checks run the product itself (`control.coordinator.train`) on a tiny model:
one run per device with FSDP2 and a rank killed mid-run (a training step, then the elastic
recovery that must reuse every survivor), and one with DeepSpeed.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.doctor.result import Check, failed, passed, skipped

# An all-reduce this large is bandwidth-bound on NVLink and InfiniBand alike (nccl-tests
# reaches its bus-bandwidth plateau by 256 MB); host-memory devices get a smaller one.
ALLREDUCE_BYTES = {"cuda": 256 << 20, "emulated": 16 << 20, "cpu": 16 << 20}
ALLREDUCE_ITERATIONS = 10
PROBE_TIMEOUT_S = 120.0
# The training checks' run: long enough to kill a rank after a committed checkpoint and train
# on after the recovery.
TRAIN_STEPS, KILL_AT_STEP = 4, 2


@dataclass(frozen=True)
class Probes:
    """One probe actor per accelerator node (two on a one-node cluster), and their facts."""

    handles: list
    facts: list[dict]

    def close(self) -> None:
        import ray

        for handle in self.handles:
            ray.kill(handle)


def start_probes(resource: str, cpus_per_rank: float, max_nodes: int = 8) -> Probes:
    """Place the probes on distinct accelerator nodes (each pinned to its node). Rank actors
    this driver kept warm from an earlier run (`cluster.keep_warm_s`) are released first:
    they hold the accelerators the probes need."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_dt.control import warm_actors
    from raytrain_dt.control.actor_slots import rank_actor_options
    from raytrain_dt.control.cluster import alive_nodes
    from raytrain_dt.doctor.collective_probe import CollectiveProbe

    warm_actors.release_kept()

    nodes = alive_nodes(resource)[:max_nodes]
    # One node: two ranks on it where it has two accelerators, so a collective still runs.
    places = [n.node_id for n in nodes]
    if len(nodes) == 1 and nodes[0].accelerators >= 2:
        places *= 2
    probe_cls = ray.remote(CollectiveProbe)
    handles = [
        probe_cls.options(
            **rank_actor_options(resource, cpus_per_rank),
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote()
        for node_id in places
    ]
    facts = ray.get([h.facts.remote() for h in handles], timeout=PROBE_TIMEOUT_S)
    return Probes(handles, facts)


def check_versions(probes: Probes) -> Check:
    """The same Python, torch (CUDA, NCCL), Ray and DeepSpeed on every node."""
    keys = ("python", "torch", "cuda", "nccl", "ray", "deepspeed")
    seen = {k: sorted({str(f[k]) for f in probes.facts}) for k in keys}
    first = probes.facts[0]
    figures = {k: first[k] for k in keys}
    summary = (
        f"torch {first['torch']} (CUDA {first['cuda'] or '-'}, NCCL {first['nccl'] or '-'}), "
        f"ray {first['ray']}, deepspeed {first['deepspeed']}, Python {first['python']}"
    )
    mixed = [f"{k}: {' / '.join(v)}" for k, v in seen.items() if len(v) > 1]
    if mixed:
        return failed(
            "versions",
            f"nodes differ ({'; '.join(mixed)}): install one environment "
            "on every node (the cluster's setup_commands)",
            **figures,
        )
    nodes = len({f["node_id"] for f in probes.facts})
    return passed("versions", f"{summary} on {nodes} node(s)", **figures)


def check_accelerators(resource: str, kind: str, probes: Probes) -> Check:
    """What Ray sees per node, and for CUDA that each probe's process sees its GPU."""
    from raytrain_dt.control.cluster import alive_nodes

    nodes = alive_nodes(resource)
    per_node = {n.node_id[:12]: n.accelerators for n in nodes}
    name = f"accelerators[{kind}]"
    if not nodes:
        return failed(
            name,
            f"Ray reports no node with {resource} resources; start the "
            "workers with their accelerators (ray start --num-gpus)",
        )
    shown = ", ".join(f"{node} x{count}" for node, count in per_node.items())
    if kind == "cuda":
        if resource != "GPU":
            return failed(name, "the Ray cluster has no GPUs (cluster.device=cuda)")
        blind = [f["node_id"][:12] for f in probes.facts if f["gpus_visible"] < 1]
        if blind:
            return failed(
                name,
                f"Ray assigned a GPU but torch sees none on {', '.join(blind)}: "
                "CUDA driver or CUDA_VISIBLE_DEVICES",
                nodes=per_node,
            )
    return passed(name, f"{len(nodes)} node(s) with {resource}: {shown}", nodes=per_node)


def check_all_reduce(kind: str, probes: Probes) -> Check:
    """A timed all-reduce over the probes, on the device and backend a rank would use."""
    import ray

    name = f"all_reduce[{kind}]"
    world = len(probes.handles)
    if world < 2:
        return skipped(name, "one accelerator in the cluster: nothing to all-reduce with")
    size = ALLREDUCE_BYTES[kind]
    master = (probes.facts[0]["ip"], ray.get(probes.handles[0].serve_store.remote()))
    try:
        results = ray.get(
            [
                h.all_reduce.remote(
                    kind, master, rank, world, size, ALLREDUCE_ITERATIONS, PROBE_TIMEOUT_S
                )
                for rank, h in enumerate(probes.handles)
            ],
            timeout=PROBE_TIMEOUT_S * 2,
        )
    except Exception as exc:  # a hang, a dead probe, a backend that would not start
        return failed(name, f"the all-reduce did not complete: {_first_line(exc)}")
    seconds = max(r["seconds"] for r in results)
    algbw = size / seconds / 1e9
    busbw = algbw * 2 * (world - 1) / world
    figures = {
        "ranks": world,
        "bytes": size,
        "seconds": seconds,
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
    }
    nodes = len({f["node_id"] for f in probes.facts})
    if not all(r["correct"] for r in results):
        return failed(name, "the all-reduce returned a wrong sum", **figures)
    return passed(
        name,
        f"{size >> 20} MiB over {world} ranks on {nodes} node(s): bus bandwidth "
        f"{busbw:.2f} GB/s ({seconds * 1e3:.1f} ms)",
        **figures,
    )


def check_training(kind: str, base: Callable[..., TrainConfig], ranks: int) -> list[Check]:
    """One FSDP2 run that loses a rank mid-run (a step, then a recovery that reuses every
    survivor) and one DeepSpeed run, each a real `train` on the device."""
    checks = []
    step_name, reuse_name = f"train_step[fsdp2, {kind}]", f"reuse_after_killed_rank[{kind}]"
    chaos = [f"chaos=[{{at_step: {KILL_AT_STEP}, action: kill_rank, target: 1}}]"]
    run = _train(base(kind, "fsdp2", *(chaos if ranks >= 2 else [])))
    if isinstance(run, Check):
        checks += [failed(step_name, run.detail), skipped(reuse_name, "no run to look at")]
    else:
        checks.append(_steps_check(step_name, run))
        checks.append(
            _reuse_check(reuse_name, run)
            if ranks >= 2
            else skipped(reuse_name, "needs two accelerators")
        )
    run = _train(base(kind, "deepspeed"))
    name = f"train_step[deepspeed, {kind}]"
    checks.append(failed(name, run.detail) if isinstance(run, Check) else _steps_check(name, run))
    return checks


def _train(cfg: TrainConfig):
    """The run's events, or a FAIL naming why it did not finish."""
    from raytrain_dt.control.coordinator import train
    from raytrain_dt.observe.metrics import read_jsonl

    try:
        result = train(cfg, show_progress=False)
    except Exception as exc:
        return failed("train", f"training failed: {_first_line(exc)} (see {cfg.run.dir})")
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    return result, events, metrics


def _steps_check(name: str, run) -> Check:
    result, _, metrics = run
    losses = [m["loss"] for m in metrics if "loss" in m]
    if result.final_step != TRAIN_STEPS or not losses or not all(map(math.isfinite, losses)):
        return failed(
            name, f"stopped at step {result.final_step} of {TRAIN_STEPS} with losses {losses}"
        )
    return passed(
        name, f"{TRAIN_STEPS} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", losses=losses
    )


def _reuse_check(name: str, run) -> Check:
    _, events, _ = run
    start = next((e for e in events if e["event"] == "start"), None)
    resize = next((e for e in events if e["event"] == "resize"), None)
    if start is None or resize is None:
        return failed(name, "the killed rank caused no re-formation (no resize event)")
    survivors = set(start["pids"]) - {start["pids"][1]}
    kept = survivors & set(resize["pids"])
    figures = {
        "survivors": len(survivors),
        "kept": len(kept),
        "form_s": resize["form_s"],
        "setup_s": resize["setup_s"],
    }
    if kept != survivors:
        return failed(
            name,
            f"{len(kept)} of {len(survivors)} survivors reused; the others were "
            "replaced (a survivor stuck in a collective: see docs/gpu.md)",
            **figures,
        )
    return passed(
        name, f"all {len(survivors)} survivor(s) reused after rank 1 was killed", **figures
    )


@dataclass(frozen=True)
class RecipePlan:
    """The recipe planned on the cluster's nodes: the topology it saw and the best candidate,
    or why nothing fits."""

    topology: object | None
    best: object | None  # topology.plan_result.Candidate
    refusal: str = ""


def plan_recipe(recipe: TrainConfig, resource: str) -> RecipePlan:
    from raytrain_dt.control.cluster import alive_nodes
    from raytrain_dt.errors import PlanningError
    from raytrain_dt.models.model_spec import model_spec
    from raytrain_dt.topology.nodes import planning_topology
    from raytrain_dt.topology.run_plan import choose_layout

    nodes = alive_nodes(resource)
    if not nodes:
        return RecipePlan(None, None, f"no node with {resource}: nothing to plan on")
    world = min(recipe.cluster.num_ranks or 10**9, sum(n.accelerators for n in nodes))
    topology = planning_topology(recipe.cluster, resource, nodes, world)
    shape = model_spec(recipe).shape
    try:
        return RecipePlan(topology, choose_layout(recipe, shape, topology, resource == "GPU").best)
    except PlanningError as exc:
        return RecipePlan(topology, None, f"the recipe does not fit this cluster: {exc}")


def check_host_memory(plan: RecipePlan) -> Check:
    """The host memory the planned layout's fullest node needs (offloaded states, async-save
    staging, the rank processes) against the smallest node's."""
    if plan.topology is None:
        return skipped("host_memory", plan.refusal)
    if plan.best is None:
        return failed("host_memory", plan.refusal)
    need, have = plan.best.host_per_node, plan.topology.host_memory_per_node
    layout = plan.best.layout.describe()
    if not have:
        return skipped(
            "host_memory",
            "Ray reports no memory for the nodes; set cluster.host_memory_gb to check",
        )
    return passed(
        "host_memory",
        f"{_gb(need)} per node for {layout} of {_gb(have)} on the smallest node",
        need_bytes=need,
        per_node_bytes=have,
        layout=layout,
    )


def check_disk(checkpoint_dir: str, checkpoint_bytes: float, keep: int) -> Check:
    """Room for the checkpoints a run keeps, plus the one being written."""
    from raytrain_dt.checkpoint.storage import Location

    need = checkpoint_bytes * (keep + 1)
    location = Location.parse(checkpoint_dir)
    if not location.is_local:
        return passed(
            "disk",
            f"checkpoints go to {checkpoint_dir}: no local disk needed ({_gb(need)} kept)",
            need_bytes=need,
        )
    probe = Path(location.path)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    figures = {"need_bytes": need, "free_bytes": free}
    if free < need:
        return failed(
            "disk",
            f"{checkpoint_dir}: {_gb(free)} free, the run keeps {keep} "
            f"checkpoints of {_gb(checkpoint_bytes)} plus one in flight ({_gb(need)}); "
            "set checkpoint.dir to larger storage or lower checkpoint.keep_last",
            **figures,
        )
    return passed("disk", f"{_gb(free)} free at {probe} for {_gb(need)} of checkpoints", **figures)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _first_line(exc: BaseException) -> str:
    # A RayTaskError's text opens with the remote frame; the exception the actor raised is
    # its `cause`.
    exc = getattr(exc, "cause", None) or exc
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
