"""Where a re-formation's seconds go (`control/recovery_timing.py`) and how the simulator is fed
them (`sim/calibrate.py`): the phases add up to the wall time, and the calibration counts each
second once. No Ray, no torch.distributed: a clock and hand-written run files."""

from __future__ import annotations

import json

import pytest

from raytrain_dt.control import recovery_timing
from raytrain_dt.control.recovery_timing import FORMATION_PHASES, RecoveryTimer
from raytrain_dt.sim.calibrate import costs_from_run, measured_timeline


def test_the_phases_and_the_unattributed_rest_add_up_to_the_wall_time(monkeypatch):
    timer = RecoveryTimer()
    timer.cause(100.0)
    timer.decided(100.5, 100.6)  # detection 0.5, re-plan 0.1
    timer.drained(2.0)
    timer.left_layout(0.2)  # the noticed nodes' actors let go
    timer.verified(0.1)
    monkeypatch.setattr(recovery_timing.time, "perf_counter", lambda: 105.0)
    rank_setup = [
        {"process_group_s": 0.2, "model_build_s": 0.4, "checkpoint_load_s": 0.5},
        {"process_group_s": 0.1, "model_build_s": 0.3, "checkpoint_load_s": 0.2, "warm_up_s": 0.1},
    ]
    fields = timer.formed(0.3, rank_setup)

    # Re-form: the teardown, the driver's group formation and the slowest process group.
    assert fields["reform_s"] == pytest.approx(0.2 + 0.3 + 0.2)
    named = sum(fields.get(k, 0.0) for k in FORMATION_PHASES)
    assert named == pytest.approx(0.5 + 0.1 + 2.0 + 0.1 + 0.7 + 0.4 + 0.5 + 0.1)
    assert fields["unattributed_s"] == pytest.approx(5.0 - named)
    assert named + fields["unattributed_s"] == pytest.approx(5.0)


def test_a_formation_without_a_cause_reports_nothing_unattributed(monkeypatch):
    """The first formation has no incident: no clock to attribute against."""
    monkeypatch.setattr(recovery_timing.time, "perf_counter", lambda: 50.0)
    fields = RecoveryTimer().formed(1.0, [{"process_group_s": 0.5}])
    assert "unattributed_s" not in fields
    assert fields["reform_s"] == pytest.approx(1.5)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_calibration_counts_every_second_once(tmp_path):
    """Steps at world 4 every 1.0 s plus a 0.3 s stall after the step-2 save; a notice at step
    3, drained 0.6 s after step 4; a resize with every phase; then steps at world 2 every 0.5 s.
    """
    metrics = [
        {"step": 1, "time": 10.0, "world_size": 4},
        {"step": 2, "time": 11.0, "world_size": 4},
        {"step": 3, "time": 12.3, "world_size": 4},  # 1.0 s + the step-2 save's stall
        {"step": 4, "time": 13.3, "world_size": 4},
        {"step": 5, "time": 17.0, "world_size": 2},
        {"step": 6, "time": 17.5, "world_size": 2},
        {"step": 7, "time": 18.0, "world_size": 2},
    ]
    layout = {"dims": {"world_size": 2}}
    resize = {
        "event": "resize",
        "time": 16.5,
        "new_layout": layout,
        "detection_s": 0.01,
        "replan_s": 0.02,
        "drain_s": 1.0,
        "checkpoint_verify_s": 0.1,
        "reform_s": 0.5,
        "model_build_s": 0.4,
        "checkpoint_load_s": 0.6,
        "warm_up_s": 0.2,
        "data_start_s": 0.05,
        "unattributed_s": 0.25,
    }
    events = [
        {"event": "first_step", "time": 10.0, "step": 1, "first_step_s": 1.0},
        {"event": "checkpoint", "time": 11.5, "step": 2, "stall_s": 0.3},
        {"event": "preemption_notice", "time": 12.3, "step": 3},
        {"event": "drained", "time": 13.9, "step": 4},
        resize,
        {"event": "first_step", "time": 17.0, "step": 5, "first_step_s": 0.5},
        {"event": "transition", "time": 19.0, "new": "finished"},  # after the final save
    ]
    _write(tmp_path / "metrics.jsonl", metrics)
    _write(tmp_path / "events.jsonl", events)

    costs = costs_from_run(tmp_path)
    assert costs.step_s_by_world == pytest.approx({4: 1.0, 2: 0.5})  # the stall left out
    assert costs.ckpt_stall_s == pytest.approx(0.3)
    assert costs.ckpt_save_s == pytest.approx(0.6)  # from step 4's line to `drained`
    # Everything after the drain but the load, which is calibrated apart.
    assert costs.reform_s == pytest.approx(0.1 + 0.5 + 0.4 + 0.2 + 0.05 + 0.25)
    assert costs.ckpt_load_s == pytest.approx(0.6)
    assert costs.replan_s == pytest.approx(0.02)

    # The timeline ends at the last trained step, not at the final save's commit.
    assert measured_timeline(tmp_path) == {"formed": [pytest.approx(6.5)], "end": 8.0}
