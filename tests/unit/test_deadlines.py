"""Deadlines: the hang bound (the floor, the p99 of a rolling window, the planner's estimate
before the first steps, a save in flight), the save and drain bounds from the checkpoint's
size and the write rate, the formation bound, the leave bound (a survivor's step), and the
defaults against a 5-minute step."""

from __future__ import annotations

import pytest

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.config.validation import validate
from raytrain_dt.control.deadlines import (
    FIRST_STEP_WARMUP,
    LEAVE_FLOOR_S,
    SAVE_FIXED_S,
    SAVE_HEADROOM,
    STEP_WINDOW,
    Deadlines,
    p99,
)
from raytrain_dt.errors import ConfigError
from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.host_memory import checkpoint_bytes
from raytrain_dt.topology.layout import Topology
from raytrain_dt.topology.planner import plan

GB = 1e9


def _deadlines(floor=60.0, multiple=5.0, formation=900.0, rate_gbps=0.1) -> Deadlines:
    return Deadlines(floor, multiple, formation, rate_gbps * GB)


def _steps(deadlines: Deadlines, durations: list[float], start: float | None = 1000.0) -> float:
    """Steps finishing one after another, each `durations[i]` after the previous one (after a
    first at `start`; None: the steps go on from the last); returns the last one's time."""
    at = deadlines._last_step_at if start is None else start
    if start is not None:
        deadlines.step_finished(at)
    for duration in durations:
        at += duration
        deadlines.step_finished(at)
    return at


def test_p99_is_the_nearest_rank() -> None:
    assert p99([7.0]) == 7.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(10, 0, -1)]) == 10.0  # fewer than 100: the largest
    assert p99([1.0] * 296 + [40.0, 50.0, 60.0, 70.0]) == 40.0  # the top 1% (3 of 300) left out


def test_fast_steps_are_held_to_the_floor() -> None:
    d = _deadlines(floor=60)
    d.formed(predicted_step_s=0.1, setup_s=2.0, world_size=8, checkpoint_bytes=1 * GB)
    _steps(d, [0.5] * 10)
    bound = d.hang_bound()
    assert (bound.seconds, bound.basis) == (60.0, "hang_timeout_s")
    assert "p99 step 0.50s" in bound.detail


def test_a_survivor_has_a_step_to_leave_its_layout() -> None:
    """A loop told to leave ends at its next step boundary: it is given the p99 step (the
    planned first step before one is measured), never less than the floor. A fixed grace would
    drop a healthy survivor of a slow step as stuck."""
    d = _deadlines()
    assert (d.leave_bound().seconds, d.leave_bound().basis) == (LEAVE_FLOOR_S, "leave")
    d.formed(predicted_step_s=4.0, setup_s=2.0, world_size=8, checkpoint_bytes=1 * GB)
    assert d.leave_bound().seconds == pytest.approx(FIRST_STEP_WARMUP * 4.0)
    _steps(d, [0.1] * 20)
    assert d.leave_bound().seconds == LEAVE_FLOOR_S  # fast steps: the floor
    _steps(d, [0.1] * 90 + [7.0] * 10, start=None)
    bound = d.leave_bound()
    assert bound.seconds == pytest.approx(7.0) and "p99 step 7.00s" in bound.detail
    d.formed(predicted_step_s=None, setup_s=2.0, world_size=8, checkpoint_bytes=1 * GB)
    assert d.leave_bound().seconds == LEAVE_FLOOR_S  # a new layout is timed afresh


def test_slow_steps_get_a_multiple_of_their_p99() -> None:
    d = _deadlines(floor=60, multiple=5)
    d.formed(predicted_step_s=200.0, setup_s=30.0, world_size=64, checkpoint_bytes=1 * GB)
    _steps(d, [300.0] * 20 + [310.0])
    bound = d.hang_bound()
    assert bound.basis == "p99" and bound.seconds == pytest.approx(5 * 310.0)


def test_the_window_forgets_old_steps() -> None:
    d = _deadlines(floor=1.0, multiple=5)
    d.formed(predicted_step_s=None, setup_s=0.0, world_size=1, checkpoint_bytes=0.0)
    _steps(d, [100.0] * 50 + [2.0] * STEP_WINDOW)
    assert d.hang_bound().seconds == pytest.approx(10.0)
    _steps(d, [2.0] * 98 + [3.0, 4.0], start=None)  # 100 more: only they count
    assert d.hang_bound().seconds == pytest.approx(5 * 3.0)  # 99th of the last 100


def test_first_steps_are_bounded_by_the_planners_estimate_and_the_setup() -> None:
    """Before a layout has timed a step, the bound comes from the plan's step estimate (70B on
    8 x 8 H100s: about 72 s), with headroom for the first step, plus the measured set-up."""
    topo = Topology(8, 8, memory_per_accelerator=80e9)
    planned = plan(PRESETS["llama-70b"], topo, global_batch=1024, seq_len=4096)
    step = planned.best.step_time.total_s
    assert 60 < step < 90
    d = _deadlines(floor=60, multiple=5)
    d.formed(predicted_step_s=step, setup_s=240.0, world_size=64, checkpoint_bytes=1 * GB)
    expected = 5 * FIRST_STEP_WARMUP * step + 240.0
    for finished in ([], [1000.0]):  # no step yet; one step (no interval yet)
        for at in finished:
            d.step_finished(at)
        bound = d.hang_bound()
        assert bound.basis == "plan" and bound.seconds == pytest.approx(expected)
    d.step_finished(1000.0 + 75.0)
    assert d.hang_bound().basis == "p99" and d.hang_bound().seconds == pytest.approx(375.0)
    # A re-formation times its steps afresh: its first steps are bounded by its own plan.
    d.formed(predicted_step_s=150.0, setup_s=100.0, world_size=32, checkpoint_bytes=1 * GB)
    bound = d.hang_bound()
    assert bound.basis == "plan" and bound.seconds == pytest.approx(5 * 2 * 150.0 + 100.0)


def test_without_an_estimate_the_first_steps_get_the_floor_or_the_setup() -> None:
    d = _deadlines(floor=60)
    d.formed(predicted_step_s=None, setup_s=10.0, world_size=1, checkpoint_bytes=0.0)
    assert d.hang_bound().seconds == 60.0
    d.formed(predicted_step_s=None, setup_s=500.0, world_size=1, checkpoint_bytes=0.0)
    assert (d.hang_bound().seconds, d.hang_bound().basis) == (500.0, "plan")


def test_save_bound_from_the_checkpoint_size_and_the_assumed_rate() -> None:
    d = _deadlines(rate_gbps=0.1)
    size = checkpoint_bytes(PRESETS["llama-70b"], engine="fsdp2", precision="bf16")
    assert size == pytest.approx(70.55e9 * 12, rel=1e-3)  # fp32 params + Adam moments
    d.formed(predicted_step_s=72.0, setup_s=0.0, world_size=64, checkpoint_bytes=size)
    save = d.save_bound()
    share = size / 64
    assert save.seconds == pytest.approx(SAVE_HEADROOM * share / 0.1e9 + SAVE_FIXED_S)
    assert "checkpoint.assumed_write_gbps" in save.detail


def test_save_bound_follows_the_measured_size_and_the_slowest_recent_rate() -> None:
    d = _deadlines(rate_gbps=0.1)
    d.formed(predicted_step_s=1.0, setup_s=0.0, world_size=4, checkpoint_bytes=100 * GB)
    d.checkpoint_committed(8 * GB, write_s=4.0)  # 2 GB per rank in 4 s: 0.5 GB/s
    assert d.save_bound().seconds == pytest.approx(SAVE_HEADROOM * 2 * GB / 0.5e9 + SAVE_FIXED_S)
    d.checkpoint_committed(8 * GB, write_s=8.0)  # a slower commit: 0.25 GB/s
    d.checkpoint_committed(8 * GB, write_s=2.0)
    assert d.write_rate()[0] == pytest.approx(0.25e9)
    assert "measured at the last 3 commits" in d.save_bound().detail
    # The measured size outlives a re-formation; the rate is per rank, so more ranks save faster.
    d.formed(predicted_step_s=1.0, setup_s=0.0, world_size=8, checkpoint_bytes=100 * GB)
    assert d.save_bound().seconds == pytest.approx(SAVE_HEADROOM * 1 * GB / 0.25e9 + SAVE_FIXED_S)


def test_a_save_in_flight_extends_the_hang_bound_and_a_drain_adds_its_own() -> None:
    d = _deadlines(floor=60)
    d.formed(predicted_step_s=1.0, setup_s=0.0, world_size=2, checkpoint_bytes=2 * GB)
    _steps(d, [1.0] * 5)
    save = d.save_bound().seconds
    assert save == pytest.approx(SAVE_HEADROOM * 1 * GB / 0.1e9 + SAVE_FIXED_S)
    assert d.hang_bound(saving=True).seconds == pytest.approx(60.0 + save)
    drain = d.drain_bound(saving=True)
    assert drain.basis == "drain" and drain.seconds == pytest.approx(60.0 + 2 * save)
    assert d.drain_bound().seconds == pytest.approx(60.0 + save)


def test_formation_bound_adds_the_load_of_the_checkpoint_it_resumes_from() -> None:
    d = _deadlines(formation=900, rate_gbps=0.1)
    assert d.formation_bound(8, resuming=False, checkpoint_bytes=80 * GB).seconds == 900.0
    resumed = d.formation_bound(8, resuming=True, checkpoint_bytes=80 * GB)
    assert resumed.seconds == pytest.approx(900 + SAVE_HEADROOM * 10 * GB / 0.1e9 + SAVE_FIXED_S)
    assert resumed.basis == "formation" and "elastic.formation_timeout_s" in resumed.detail
    d.formed(predicted_step_s=1.0, setup_s=0.0, world_size=8, checkpoint_bytes=80 * GB)
    d.checkpoint_committed(16 * GB, write_s=2.0)  # 2 GB per rank at 1 GB/s
    resumed = d.formation_bound(4, resuming=True, checkpoint_bytes=80 * GB)
    assert resumed.seconds == pytest.approx(900 + SAVE_HEADROOM * 4 * GB / 1e9 + SAVE_FIXED_S)


def test_the_defaults_suit_a_five_minute_step() -> None:
    """405B's planned step is minutes, not the 60 s floor: neither its first steps nor its
    steady steps, nor steps 3x slower than the floor, are a hang under the defaults."""
    d = Deadlines.from_config(TrainConfig())
    topo = Topology(128, 8, memory_per_accelerator=80e9)
    step = plan(PRESETS["llama-405b"], topo, global_batch=1024, seq_len=4096).best.step_time.total_s
    d.formed(
        predicted_step_s=step,
        setup_s=300.0,
        world_size=1024,
        checkpoint_bytes=checkpoint_bytes(PRESETS["llama-405b"]),
    )
    assert d.hang_bound().seconds > 2 * step + 300
    _steps(d, [300.0] * 10)
    assert d.hang_bound().seconds == pytest.approx(1500.0)
    floor = TrainConfig().elastic.hang_timeout_s
    d.formed(predicted_step_s=1.0, setup_s=5.0, world_size=8, checkpoint_bytes=1 * GB)
    _steps(d, [3 * floor] * 10)
    assert d.hang_bound().seconds > 3 * floor and d.hang_bound().basis == "p99"
    # The drain of a 405B checkpoint (4.9 TB over 1024 ranks) at the assumed 0.1 GB/s.
    d.formed(
        predicted_step_s=step,
        setup_s=0.0,
        world_size=1024,
        checkpoint_bytes=checkpoint_bytes(PRESETS["llama-405b"]),
    )
    _steps(d, [300.0] * 10)
    assert d.drain_bound().seconds == pytest.approx(1500.0 + 3 * 4.756e9 / 0.1e9 + 10, rel=1e-3)


@pytest.mark.parametrize(
    ("key", "value"),
    [("hang_step_multiple", 0.5), ("formation_timeout_s", 0.0), ("hang_timeout_s", -1.0)],
)
def test_deadline_keys_are_validated(key, value) -> None:
    cfg = TrainConfig()
    setattr(cfg.elastic, key, value)
    with pytest.raises(ConfigError, match=f"^elastic.{key}: "):
        validate(cfg)
    cfg = TrainConfig()
    cfg.checkpoint.assumed_write_gbps = 0.0
    with pytest.raises(ConfigError, match="^checkpoint.assumed_write_gbps: "):
        validate(cfg)
