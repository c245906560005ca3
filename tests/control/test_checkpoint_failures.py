"""A run whose every checkpoint save fails says so, as an error, not only as warnings."""

from __future__ import annotations

import logging

from raytrain_dt.checkpoint.store import CheckpointStore
from raytrain_dt.control.checkpoint_tracker import CheckpointTracker
from raytrain_dt.observe.metrics import RunRecorder, read_jsonl
from raytrain_dt.worker.reports import SaveFailedReport


def test_every_save_failing_is_an_error_and_summarised(tmp_path, caplog):
    recorder = RunRecorder(tmp_path, resumed_step=0)
    tracker = CheckpointTracker(CheckpointStore(str(tmp_path / "ckpt")), 2, recorder, 2, 0)
    assert tracker.summary() is None
    with caplog.at_level(logging.WARNING, logger="raytrain_dt.control.checkpoint_tracker"):
        for step in (3, 6):
            tracker.on_report(SaveFailedReport(step, 0, error="s3://b/x: OSError: denied"))
            tracker.on_report(SaveFailedReport(step, 1, error="s3://b/x: OSError: denied"))
    # One record per failed step (not per rank), each an error while none has committed.
    assert [r.levelname for r in caplog.records] == ["ERROR", "ERROR"]
    assert "none committed" in caplog.records[-1].getMessage()
    assert tracker.summary() == (
        "every checkpoint save failed (steps 3, 6): no checkpoint was committed"
    )
    recorder.close()
    failed = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [3, 6]
