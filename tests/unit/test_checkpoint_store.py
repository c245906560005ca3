"""The checkpoint store and file digests: commits from the ranks' reports without reading a
checkpoint byte, damage found by the driver's listing or by the ranks' checksums, fallback,
retention, and DCP writers that hash what they write."""

from __future__ import annotations

import builtins
import io
import logging

import pytest

from raytrain_dt.checkpoint.digests import (
    FileDigests,
    digest_tree,
    verification_shares,
    verify_files,
)
from raytrain_dt.checkpoint.store import COMMIT_FILE, CheckpointStore, merge_manifests
from raytrain_dt.errors import CheckpointError


def _write_step(root, step: int, payload: bytes = b"x" * 100) -> dict[int, dict]:
    """Two ranks' shards, as they write them; returns what each reports: {rank: files}."""
    step_dir = root / f"step_{step}"
    (step_dir / "rng").mkdir(parents=True)
    written = {
        0: {"__0_0.distcp": payload, ".metadata": b"meta", "rng/rank_0.pt": b"rng"},
        1: {"__1_0.distcp": payload[::-1], "rng/rank_1.pt": b"rng1"},
    }
    reports = {}
    for rank, files in written.items():
        digests = FileDigests()
        for name, data in files.items():
            (step_dir / name).write_bytes(data)
            digests.add_bytes(name, data)
        reports[rank] = digests.manifest()
    return reports


def _commit(store, root, step: int, state: dict | None = None):
    return store.commit(step, state or {}, merge_manifests(_write_step(root, step)))


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(str(tmp_path))


def test_commit_records_every_reported_file_with_size_and_checksum(tmp_path, store):
    reports = _write_step(tmp_path, 4)
    stored = digest_tree(str(tmp_path / "step_4"))
    ref = store.commit(4, {"step": 4, "consumed_samples": 32}, merge_manifests(reports))
    assert ref.committed and ref.consumed_samples == 32
    assert ref.record["files"] == stored == {**reports[0], **reports[1]}
    assert set(ref.record["files"]) == {
        "__0_0.distcp",
        "__1_0.distcp",
        ".metadata",
        "rng/rank_0.pt",
        "rng/rank_1.pt",
    }
    assert ref.record["files"]["__0_0.distcp"]["size"] == 100
    assert store.problems(ref) == []
    assert verify_files(ref.uri, ref.record["files"]) == []
    assert store.latest_valid().step == 4


def test_manifests_record_xxh3_and_sha256_manifests_of_earlier_versions_still_verify(tmp_path):
    import hashlib

    import xxhash

    reports = _write_step(tmp_path, 4)
    entry = reports[0]["__0_0.distcp"]
    assert entry == {"size": 100, "xxh3_128": xxhash.xxh3_128(b"x" * 100).hexdigest()}
    step_dir = tmp_path / "step_4"
    older = {  # as a version hashing with SHA-256 recorded the same files
        name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for name in ("__0_0.distcp", ".metadata")
        for data in [(step_dir / name).read_bytes()]
    }
    assert verify_files(str(step_dir), older) == []
    (step_dir / "__0_0.distcp").write_bytes(b"y" * 100)  # same size, other bytes
    for manifest in (older, reports[0]):
        problems = verify_files(str(step_dir), manifest)
        assert problems == [f"{step_dir}/__0_0.distcp: checksum mismatch"]
    unnamed = {"__0_0.distcp": {"size": 100, "md5": "00"}}
    assert verify_files(str(step_dir), unnamed) == [
        f"{step_dir}/__0_0.distcp: no checksum recorded (one of xxh3_128, sha256)"
    ]


def test_commit_and_latest_valid_read_no_checkpoint_byte(tmp_path, store, monkeypatch):
    reports = _write_step(tmp_path, 4)
    opened = []
    real_open = builtins.open

    def spying_open(file, mode="r", *args, **kwargs):
        opened.append((str(file), mode))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spying_open)
    monkeypatch.setattr(io, "open", spying_open)
    store.commit(4, {}, merge_manifests(reports))
    assert store.latest_valid().step == 4
    monkeypatch.undo()
    step_dir = str(tmp_path / "step_4")
    touched = [(f, m) for f, m in opened if f.startswith(step_dir)]
    # The commit record written, then read back by the listing of checkpoints; nothing else.
    assert {f.removeprefix(step_dir + "/") for f, _ in touched} == {
        COMMIT_FILE + ".tmp",
        COMMIT_FILE,
    }
    assert all("r" not in m for f, m in touched if f.endswith(".tmp"))


def test_commit_refuses_files_missing_or_resized_since_the_report(tmp_path, store):
    reports = _write_step(tmp_path, 4)
    (tmp_path / "step_4" / "__1_0.distcp").unlink()
    (tmp_path / "step_4" / ".metadata").write_bytes(b"metadata")
    with pytest.raises(CheckpointError) as err:
        store.commit(4, {}, merge_manifests(reports))
    assert "__1_0.distcp: missing" in str(err.value)
    assert ".metadata: size 8 != 4 recorded" in str(err.value)
    assert not (tmp_path / "step_4" / COMMIT_FILE).exists()
    with pytest.raises(CheckpointError, match="no rank reported a file"):
        store.commit(4, {}, {})


def test_files_no_rank_reported_are_left_out_with_a_warning(tmp_path, store, caplog):
    reports = _write_step(tmp_path, 4)
    (tmp_path / "step_4" / "__3_0.distcp").write_bytes(b"left by an earlier, larger layout")
    with caplog.at_level(logging.WARNING):
        ref = store.commit(4, {}, merge_manifests(reports))
    assert "__3_0.distcp" not in ref.record["files"]
    assert "1 files no rank reported writing" in caplog.text and "__3_0.distcp" in caplog.text


def test_merge_refuses_two_ranks_reporting_one_file_differently():
    same = {"a": {"size": 1, "sha256": "00"}}
    assert merge_manifests({0: same, 1: dict(same), 2: {"b": {"size": 2, "sha256": "11"}}}) == {
        "a": {"size": 1, "sha256": "00"},
        "b": {"size": 2, "sha256": "11"},
    }
    with pytest.raises(CheckpointError, match="a: ranks 0 and 3 report different contents"):
        merge_manifests({0: same, 3: {"a": {"size": 1, "sha256": "ff"}}})


def test_uncommitted_checkpoints_are_never_loaded(tmp_path, store):
    _commit(store, tmp_path, 4, {"consumed_samples": 32})
    _write_step(tmp_path, 8)  # shards written, but no commit record: an interrupted save
    assert [r.step for r in store.list()] == [4, 8]
    assert [r.step for r in store.committed()] == [4]
    assert store.latest_valid().step == 4


DAMAGE = {
    "deleted": (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp: missing"),
    "truncated": (
        lambda d: (d / "__0_0.distcp").write_bytes(b"x" * 50),
        "__0_0.distcp: size 50 != 100 recorded",
    ),
    "corrupted": (
        lambda d: (d / "__0_0.distcp").write_bytes(b"y" * 100),
        "__0_0.distcp: checksum mismatch",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_the_ranks_find_every_damaged_file_in_their_shares(tmp_path, store, damage):
    ref = _commit(store, tmp_path, 8)
    damage_fn, expected = DAMAGE[damage]
    damage_fn(tmp_path / "step_8")
    shares = verification_shares(ref.record["files"], 3)
    found = [line for share in shares for line in verify_files(ref.uri, share)]
    assert found == [f"{ref.uri}/{expected}"]


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_driver_listing_skips_a_damaged_newest_with_a_warning_naming_the_file(
    tmp_path, store, caplog, damage
):
    for step in (4, 8):
        _commit(store, tmp_path, step, {"consumed_samples": step * 8})
    damage_fn, expected = DAMAGE[damage]
    damage_fn(tmp_path / "step_8")
    with caplog.at_level(logging.WARNING):
        ref = store.latest_valid()
    assert ref.step == 4
    assert expected in caplog.text and "skipping checkpoint step 8" in caplog.text


def test_a_corrupted_newest_found_by_the_ranks_is_skipped_until_committed_again(
    tmp_path, store, caplog
):
    for step in (4, 8):
        _commit(store, tmp_path, step)
    DAMAGE["corrupted"][0](tmp_path / "step_8")
    newest = store.latest_valid()
    assert newest.step == 8  # same size: only a checksum tells, and the driver reads no byte
    problems = verify_files(newest.uri, newest.record["files"])
    with caplog.at_level(logging.WARNING):
        store.mark_damaged(newest, problems)
        assert store.latest_valid().step == 4
    assert "__0_0.distcp: checksum mismatch" in caplog.text
    assert "skipping checkpoint step 8" in caplog.text
    # Re-trained and saved again, step 8 is a new checkpoint.
    (tmp_path / "step_8" / COMMIT_FILE).unlink()
    for path in sorted((tmp_path / "step_8").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (tmp_path / "step_8").rmdir()
    _commit(store, tmp_path, 8)
    assert store.latest_valid().step == 8


def test_verification_shares_hold_every_file_once_balanced_by_bytes():
    files = {
        f"f{i}": {"size": size, "sha256": ""}
        for i, size in enumerate([100, 90, 80, 10, 10, 10, 5, 1, 1])
    }
    shares = verification_shares(files, 3)
    names = [name for share in shares for name in share]
    assert sorted(names) == sorted(files)
    assert [sum(f["size"] for f in share.values()) for share in shares] == [105, 101, 101]
    assert verification_shares({}, 2) == [{}, {}]


def test_retention_keeps_last_n_every_kth_newest_and_in_flight(tmp_path, store):
    for step in (2, 4, 6, 8, 10, 12):
        _commit(store, tmp_path, step)
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
    _commit(store, tmp_path, 3)
    assert (tmp_path / "step_3" / COMMIT_FILE).exists()
    assert not (tmp_path / "step_3" / (COMMIT_FILE + ".tmp")).exists()


def test_a_dcp_writer_hashes_what_it_writes(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from raytrain_dt.checkpoint.storage import dcp_writer

    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3), "lr": 0.5}
    written = FileDigests()
    dcp.save(state, storage_writer=dcp_writer(str(tmp_path / "step_1"), written), no_dist=True)
    # Every file, `.metadata` under its final name (it is written as .metadata.tmp, renamed),
    # with exactly the size and SHA-256 of what is stored.
    assert written.manifest() == digest_tree(str(tmp_path / "step_1"))
    assert set(written.manifest()) == {".metadata", "__0_0.distcp"}
