"""Host memory model and the planner's host check: offload, checkpoint staging, device memory
on the host and the process, per rank and per node; layouts that do not fit a node's host
memory are refused with one line naming the key; `plan --host-mem-gb`; `cluster.host_memory_gb`.
(tests/distributed/test_host_memory_model.py checks the staging and checkpoint sizes against
what the engine really stages and saves.)"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from raytrain_dt.config.schema import ClusterConfig, TrainConfig
from raytrain_dt.config.validation import validate
from raytrain_dt.errors import ConfigError, PlanningError
from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.host_memory import (
    RANK_PROCESS_HOST_BYTES,
    checkpoint_bytes,
    host_bytes_per_node,
    host_bytes_per_rank,
    offloaded_bytes,
    rank_checkpoint_bytes,
)
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.memory import estimate_memory
from raytrain_dt.topology.nodes import NodeInfo, planning_topology
from raytrain_dt.topology.parallel_dims import ParallelDims
from raytrain_dt.topology.plan_cli import add_plan_arguments, run_plan
from raytrain_dt.topology.planner import plan

GB = 1e9
SEVEN_B = PRESETS["llama-7b"]
N = SEVEN_B.num_params


def _layout(world=8, tp=1, pp=1, dp_replicate=1, dp_shard=8, zero=3, offload=False) -> Layout:
    dims = ParallelDims(
        world_size=world, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp
    )
    return Layout(dims, zero, 1, 1, offload_optimizer=offload)


@pytest.mark.parametrize(
    ("engine", "precision", "per_param"),
    [
        ("fsdp2", "bf16", 12),
        ("fsdp2", "fp32", 12),
        ("deepspeed", "bf16", 14),
        ("deepspeed", "fp32", 16),
    ],
)
def test_checkpoint_bytes_per_engine(engine, precision, per_param) -> None:
    """FSDP2 saves fp32 shards and Adam moments; DeepSpeed the module in the compute dtype and
    an fp32 master copy with the moments (even at fp32)."""
    assert checkpoint_bytes(SEVEN_B, engine=engine, precision=precision) == N * per_param


def test_a_rank_stages_its_share_of_the_checkpoint() -> None:
    whole = checkpoint_bytes(SEVEN_B)
    assert rank_checkpoint_bytes(SEVEN_B, _layout()) == pytest.approx(whole / 8)
    # Replicated states (plain DP) are staged whole on every rank.
    plain = _layout(dp_replicate=8, dp_shard=1, zero=0)
    assert rank_checkpoint_bytes(SEVEN_B, plain) == pytest.approx(whole)
    # TP slices every stage; the heaviest pipeline stage carries the head.
    assert rank_checkpoint_bytes(SEVEN_B, _layout(world=8, tp=2, dp_shard=4)) == pytest.approx(
        whole / 8
    )
    stage = rank_checkpoint_bytes(SEVEN_B, _layout(world=8, pp=2, dp_shard=4))
    assert whole / 8 < stage < whole / 8 * 1.05


def test_offload_puts_the_sharded_states_on_the_host() -> None:
    plain, off = _layout(), _layout(offload=True)
    assert offloaded_bytes(SEVEN_B, plain) == 0
    # FSDP2's CPUOffloadPolicy: fp32 parameter, gradient and Adam shards, 16 B/param.
    assert offloaded_bytes(SEVEN_B, off) == pytest.approx(N * 16 / 8)
    # ZeRO-Offload: fp32 master and moments (12 B) and the fp32 gradient partition (4 B).
    assert offloaded_bytes(SEVEN_B, off, engine="deepspeed") == pytest.approx(N * 16 / 8)


def test_host_bytes_per_rank_by_cause() -> None:
    layout = _layout()
    rank = host_bytes_per_rank(SEVEN_B, layout)
    assert rank.staging == pytest.approx(N * 12 / 8) and rank.offload == 0 and rank.device == 0
    assert rank.process == RANK_PROCESS_HOST_BYTES
    assert rank.total == pytest.approx(N * 12 / 8 + RANK_PROCESS_HOST_BYTES)
    # Sync saves stage nothing; DeepSpeed saves synchronously whatever the setting.
    assert host_bytes_per_rank(SEVEN_B, layout, async_save=False).staging == 0
    assert host_bytes_per_rank(SEVEN_B, layout, engine="deepspeed").staging == 0
    offloaded = host_bytes_per_rank(SEVEN_B, _layout(offload=True), device_bytes=3 * GB)
    assert offloaded.total == pytest.approx(N * (16 + 12) / 8 + 3 * GB + RANK_PROCESS_HOST_BYTES)
    assert "offload" in offloaded.describe() and "device memory 3.0" in offloaded.describe()


def test_a_node_holds_its_ranks_sum() -> None:
    layout = _layout(world=16, dp_shard=16)
    topo = Topology(2, 8)
    per_rank = host_bytes_per_rank(SEVEN_B, layout).total
    assert host_bytes_per_node(SEVEN_B, layout, topo, seq_len=4096) == pytest.approx(8 * per_rank)
    # A world smaller than a node puts only its ranks there.
    small = _layout(world=4, dp_shard=4)
    assert host_bytes_per_node(SEVEN_B, small, topo, seq_len=4096) == pytest.approx(
        4 * host_bytes_per_rank(SEVEN_B, small).total
    )
    # On cpu and emulated devices the accelerator memory is host RAM as well.
    on_host = dataclasses.replace(topo, device_memory_on_host=True)
    device = estimate_memory(SEVEN_B, layout, seq_len=4096).total
    assert host_bytes_per_node(SEVEN_B, layout, on_host, seq_len=4096) == pytest.approx(
        8 * (per_rank + device)
    )


def _plan(host_gb: float, **kw):
    topo = Topology(1, 8, memory_per_accelerator=80e9, host_memory_per_node=host_gb * GB)
    return plan(SEVEN_B, topo, global_batch=256, seq_len=4096, **kw)


def test_the_planner_keeps_to_the_host_memory_it_is_given() -> None:
    unchecked = _plan(0)  # 0: host memory unknown, not checked
    need = unchecked.best.host_per_node
    assert need == pytest.approx(
        host_bytes_per_node(SEVEN_B, unchecked.best.layout, Topology(1, 8), seq_len=4096)
    )
    assert _plan(need / GB + 1).best.layout == unchecked.best.layout
    # Short of that, a layout whose ranks stage less (more sharded) is chosen, if any fits.
    tighter = _plan(need / GB - 1)
    assert tighter.best.host_per_node <= need - 1 * GB
    assert all(c.host_per_node <= (need - 1 * GB) for c in tighter.alternatives)
    assert tighter.to_json()["host_memory_gb_per_node"] == pytest.approx(
        tighter.best.host_per_node / GB, abs=1e-3
    )


def test_nothing_fitting_the_host_is_one_line_naming_the_key_need_and_capacity() -> None:
    with pytest.raises(PlanningError) as err:
        _plan(40)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("nothing fits in host memory")
    assert "cluster.host_memory_gb / --host-mem-gb" in msg and "a node has 40.0 GB" in msg
    # The need is the leanest layout's. The node stages the whole checkpoint however its ranks
    # split it, so the fewest ranks whose accelerators hold the model (2) pay for the fewest
    # processes.
    leanest = (N * 12 + 2 * RANK_PROCESS_HOST_BYTES) / GB
    assert f"needs {leanest:.1f} GB per node (2 ranks x" in msg
    # Without the staging copy (sync saves) the same host fits.
    assert _plan(40, async_save=False).best.host_per_node <= 40 * GB


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


def test_cli_host_mem_gb(capsys) -> None:
    assert _cli(["--model", "llama-7b", "--nodes", "1", "--host-mem-gb", "40"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing fits in host memory" in err
    assert "--host-mem-gb" in err and "40.0 GB" in err
    assert _cli(["--model", "llama-7b", "--nodes", "1", "--host-mem-gb", "512"]) == 0
    out = capsys.readouterr().out
    assert "host memory per node (GB)" in out and " of 512" in out
    assert _cli(["--model", "llama-7b", "--nodes", "1", "--host-mem-gb", "0"]) == 2
    assert "--host-mem-gb: must be > 0" in capsys.readouterr().err


def test_the_run_plans_with_the_configured_or_the_smallest_nodes_memory() -> None:
    nodes = [NodeInfo("a", 2, memory_bytes=30 * GB), NodeInfo("b", 2, memory_bytes=20 * GB)]
    detected = planning_topology(ClusterConfig(), "accelerator", nodes, 4)
    assert detected.host_memory_per_node == 20 * GB and detected.device_memory_on_host
    configured = planning_topology(ClusterConfig(host_memory_gb=512), "GPU", nodes, 4)
    assert configured.host_memory_per_node == 512 * GB and not configured.device_memory_on_host
    cfg = TrainConfig()
    cfg.cluster.host_memory_gb = -1.0
    with pytest.raises(ConfigError, match="^cluster.host_memory_gb: "):
        validate(cfg)


def test_in_memory_copies_are_planned_and_refused_with_one_line() -> None:
    layout = _layout()
    shard = rank_checkpoint_bytes(SEVEN_B, layout)
    copies = host_bytes_per_rank(SEVEN_B, layout, memory_copies=True)
    # A staging buffer, then its own copy and its peer's for the newest two steps.
    assert copies.memory_copies == pytest.approx(5 * shard)
    assert copies.total == pytest.approx(host_bytes_per_rank(SEVEN_B, layout).total + 5 * shard)
    assert (
        host_bytes_per_rank(SEVEN_B, layout, engine="deepspeed", memory_copies=True).memory_copies
        == 0
    )
    # 7B's state is 84 GB per node: with the copies (x6 with staging) not in 400 GB of host.
    assert _plan(400).best.host_per_node <= 400 * GB
    with pytest.raises(PlanningError) as err:
        _plan(400, memory_copies=True)
    msg = str(err.value)
    assert "\n" not in msg and "in-memory copies (checkpoint.memory_every_steps)" in msg
    assert _plan(600, memory_copies=True).best.host_per_node <= 600 * GB
