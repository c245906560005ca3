"""Rank actors kept warm between runs of one driver (`cluster.keep_warm_s`): the next run takes
them instead of starting processes, trains exactly as a run on fresh actors does, logs into its
own run directory, and what is kept is released when its time is up."""

from __future__ import annotations

import os
import time

import pytest
import ray

from raytrain_dt.control import warm_actors
from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR
from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.worker.rank_actor import FLIGHT_RECORDER_FILE_ENV


def _events(run_dir, kind: str) -> list[dict]:
    return [e for e in read_jsonl(f"{run_dir}/events.jsonl") if e["event"] == kind]


def _free_accelerators(expected: float, within_s: float = 30.0) -> float:
    """The cluster's free accelerators once they reach `expected` (placement groups are given
    back asynchronously), or what they were at the deadline."""
    deadline = time.monotonic() + within_s
    while True:
        free = ray.available_resources().get(SIMULATED_ACCELERATOR, 0.0)
        if free >= expected or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def _flight_recorder_files(kept: warm_actors.WarmActors) -> set[str]:
    """Where each kept actor's NCCL flight recorder would dump, read in its own process."""
    refs = [
        slot.handle.__ray_call__.remote(lambda actor: os.environ.get(FLIGHT_RECORDER_FILE_ENV))
        for slot in kept.slots
    ]
    return set(ray.get(refs, timeout=60))


# Several training runs: 160-180 s in the gate beside another worker, over half the default 300.
@pytest.mark.timeout(600)
def test_a_second_run_takes_the_first_runs_actors_and_trains_the_same(
    fresh_actors, make_config, tmp_path
):
    total = ray.cluster_resources()[SIMULATED_ACCELERATOR]
    common = ("trainer.steps=4", "cluster.num_ranks=4", "engine.zero_stage=3")
    first = train(
        make_config(*common, "cluster.keep_warm_s=600", run_dir=tmp_path / "first"),
        show_progress=False,
    )
    (connected,) = _events(first.run_dir, "connected")
    assert connected["warm_actors"] == 0
    # Kept: the four ranks still hold their accelerators after the run.
    assert ray.available_resources().get(SIMULATED_ACCELERATOR, 0.0) == total - 4
    kept = warm_actors.take()
    assert _flight_recorder_files(kept) == {str(tmp_path / "first/logs/nccl_trace_rank_")}
    warm_actors.keep(kept, 600)

    second = train(
        make_config(*common, "cluster.keep_warm_s=600", run_dir=tmp_path / "second"),
        show_progress=False,
    )
    (connected,) = _events(second.run_dir, "connected")
    assert connected["warm_actors"] == 4
    (start,) = _events(second.run_dir, "start")
    assert start["new_actors"] == [0, 1, 2, 3]  # numbered by the run that took them
    # No state of the first run leaks into the second: the same losses, step by step.
    losses = [
        [m["loss"] for m in read_jsonl(f"{r.run_dir}/metrics.jsonl")] for r in (first, second)
    ]
    assert len(losses[1]) == 4 and losses[1] == pytest.approx(losses[0], abs=1e-6)
    # Each actor logs into the run it trains now, and would dump its collectives there.
    logs = sorted((tmp_path / "second" / "logs").glob("actor_*.log"))
    assert [p.name for p in logs] == [f"actor_{i}.log" for i in range(4)]
    assert all("rebound to run" in p.read_text() for p in logs)
    kept = warm_actors.take()
    assert _flight_recorder_files(kept) == {str(tmp_path / "second/logs/nccl_trace_rank_")}
    # Kept for 1 s: then they are released, accelerators and all.
    warm_actors.keep(kept, 1)
    assert _free_accelerators(total) == total
    assert warm_actors.take() is None


# Several training runs: 160-180 s in the gate beside another worker, over half the default 300.
@pytest.mark.timeout(600)
def test_a_smaller_run_keeps_what_it_used_and_other_settings_release_them(
    fresh_actors, make_config, tmp_path
):
    """A run that uses fewer ranks than were kept lets the others go at its first formation
    (its idle actors are those its own decisions leave out) and keeps only its own; actors
    started with other settings (here: CPUs per rank) are not reused, and the run does not
    wait for the accelerators they held."""
    total = ray.cluster_resources()[SIMULATED_ACCELERATOR]
    train(
        make_config(
            "trainer.steps=2",
            "cluster.num_ranks=4",
            "cluster.keep_warm_s=600",
            run_dir=tmp_path / "first",
        ),
        show_progress=False,
    )
    smaller = train(
        make_config("trainer.steps=2", "cluster.keep_warm_s=600", run_dir=tmp_path / "smaller"),
        show_progress=False,
    )
    assert smaller.layout.dims.world_size == 2
    (connected,) = _events(smaller.run_dir, "connected")
    assert connected["warm_actors"] == 4
    kept = warm_actors.take()
    assert kept is not None and len(kept.slots) == 2
    assert _free_accelerators(total - 2) == total - 2  # the two left out were released
    warm_actors.keep(kept, 600)  # for the next run, which must not take them

    other = train(
        make_config(
            "trainer.steps=2",
            "cluster.num_ranks=4",
            "cluster.cpus_per_rank=0.2",
            "cluster.keep_warm_s=0",
            run_dir=tmp_path / "other",
        ),
        show_progress=False,
    )
    (connected,) = _events(other.run_dir, "connected")
    assert connected["warm_actors"] == 0 and other.final_step == 2
    assert other.layout.dims.world_size == 4
    assert _free_accelerators(total) == total and warm_actors.take() is None
