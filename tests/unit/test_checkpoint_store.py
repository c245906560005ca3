"""The checkpoint store: atomic commit records, damage detection, fallback, retention."""

from __future__ import annotations

import logging

import pytest

from raytrain_dt.checkpoint.store import COMMIT_FILE, CheckpointStore


def _write_step(root, step: int, payload: bytes = b"x" * 100) -> None:
    step_dir = root / f"step_{step}"
    (step_dir / "rng").mkdir(parents=True)
    (step_dir / "__0_0.distcp").write_bytes(payload)
    (step_dir / "__1_0.distcp").write_bytes(payload[::-1])
    (step_dir / ".metadata").write_bytes(b"meta")
    (step_dir / "rng" / "rank_0.pt").write_bytes(b"rng")


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(str(tmp_path))


def test_commit_records_every_file_with_size_and_checksum(tmp_path, store):
    _write_step(tmp_path, 4)
    ref = store.commit(4, {"step": 4, "consumed_samples": 32})
    assert ref.committed and ref.consumed_samples == 32
    assert set(ref.record["files"]) == {
        "__0_0.distcp",
        "__1_0.distcp",
        ".metadata",
        "rng/rank_0.pt",
    }
    assert ref.record["files"]["__0_0.distcp"]["size"] == 100
    assert store.problems(ref) == []
    assert store.latest_valid().step == 4


def test_uncommitted_checkpoints_are_never_loaded(tmp_path, store):
    _write_step(tmp_path, 4)
    store.commit(4, {"consumed_samples": 32})
    _write_step(tmp_path, 8)  # shards written, but no commit record: an interrupted save
    assert [r.step for r in store.list()] == [4, 8]
    assert [r.step for r in store.committed()] == [4]
    assert store.latest_valid().step == 4


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp: missing"),
        (
            lambda d: (d / "__0_0.distcp").write_bytes(b"x" * 50),
            "__0_0.distcp: size 50 != 100 recorded",
        ),
        (lambda d: (d / "__0_0.distcp").write_bytes(b"y" * 100), "__0_0.distcp: checksum mismatch"),
    ],
    ids=["deleted", "truncated", "corrupted"],
)
def test_damaged_newest_falls_back_with_a_warning_naming_the_file(
    tmp_path, store, caplog, damage, expected
):
    for step in (4, 8):
        _write_step(tmp_path, step)
        store.commit(step, {"consumed_samples": step * 8})
    damage(tmp_path / "step_8")
    with caplog.at_level(logging.WARNING):
        ref = store.latest_valid()
    assert ref.step == 4
    assert expected in caplog.text and "skipping checkpoint step 8" in caplog.text


def test_retention_keeps_last_n_every_kth_newest_and_in_flight(tmp_path, store):
    for step in (2, 4, 6, 8, 10, 12):
        _write_step(tmp_path, step)
        store.commit(step, {})
    _write_step(tmp_path, 1)  # abandoned, older than the newest commit
    _write_step(tmp_path, 14)  # being written now
    deleted = store.prune(keep_last=2, keep_every=4, in_flight={14})
    assert [r.step for r in store.list()] == [4, 8, 10, 12, 14]
    assert len(deleted) == 3
    assert (tmp_path / "step_14" / "__0_0.distcp").exists()
    # keep_last=0 still never deletes the newest committed checkpoint.
    store.prune(keep_last=0)
    assert [r.step for r in store.committed()] == [12]


def test_commit_record_is_written_atomically(tmp_path, store):
    _write_step(tmp_path, 3)
    store.commit(3, {})
    assert (tmp_path / "step_3" / COMMIT_FILE).exists()
    assert not (tmp_path / "step_3" / (COMMIT_FILE + ".tmp")).exists()
