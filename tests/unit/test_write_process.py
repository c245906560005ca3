"""Async saves whose shard files the rank's writer process writes (`checkpoint/write_process.py`):
what the rank reports (sizes and SHA-256s) is what is stored, every save loads back the state it
was staged from (the shared staging buffers are reused from save to save), a failed write fails
that save only, and a writer process that died is replaced by the next save."""

import os
import signal
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from raytrain_dt.checkpoint import write_process
from raytrain_dt.checkpoint.digests import FileDigests, digest_tree
from raytrain_dt.checkpoint.staging import ReusableStager
from raytrain_dt.checkpoint.storage import dcp_reader


@pytest.fixture(scope="module")
def group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def _state(value: float) -> dict:
    return {
        "model": {"w": torch.full((64, 32), value), "b": torch.arange(8.0) + value},
        "optim": {"state": {"w": {"exp_avg": torch.full((64, 32), -value)}}, "lr": value},
    }


def _save(state: dict, uri: str, stager: ReusableStager, group) -> FileDigests:
    written = FileDigests()
    response = dcp.async_save(
        state,
        storage_writer=write_process.ProcessWriter(uri, written),
        process_group=group,
        async_stager=stager,
    )
    response.upload_completion.result(timeout=120)
    return written


def _load(uri: str) -> dict:
    loaded = _state(0.0)
    dcp.load(loaded, storage_reader=dcp_reader(uri))
    return loaded


def _assert_equal(loaded: dict, expected: dict) -> None:
    assert torch.equal(loaded["model"]["w"], expected["model"]["w"])
    assert torch.equal(loaded["model"]["b"], expected["model"]["b"])
    exp_avg = loaded["optim"]["state"]["w"]["exp_avg"]
    assert torch.equal(exp_avg, expected["optim"]["state"]["w"]["exp_avg"])
    assert loaded["optim"]["lr"] == expected["optim"]["lr"]


def test_the_writer_process_writes_what_the_rank_reports_and_loads_back(group, tmp_path):
    stager = ReusableStager(background=True)
    for value in (1.0, 2.0):  # the second save reuses the shared buffers with new values
        uri = str(tmp_path / f"step_{int(value)}")
        written = _save(_state(value), uri, stager, group)
        assert write_process.writer_pid() not in (None, os.getpid())
        # The rank's record: every stored file, hashed as written, the shard file included.
        assert written.manifest() == digest_tree(uri)
        assert any(name.endswith(".distcp") for name in written.manifest())
        _assert_equal(_load(uri), _state(value))
    stager.close()


def test_a_failed_write_fails_that_save_and_a_dead_writer_is_replaced(group, tmp_path):
    stager = ReusableStager(background=True)
    _save(_state(1.0), str(tmp_path / "first"), stager, group)
    pid = write_process.writer_pid()
    # The shard file's name is taken by a directory: the writer's open fails.
    (tmp_path / "blocked" / "__0_0.distcp").mkdir(parents=True)
    with pytest.raises(CheckpointException, match="IsADirectoryError"):
        _save(_state(2.0), str(tmp_path / "blocked"), stager, group)
    assert write_process.writer_pid() == pid  # one failed save, the same process goes on
    os.kill(pid, signal.SIGKILL)
    write_process._WRITER._process.wait(timeout=30)
    written = _save(_state(3.0), str(tmp_path / "after"), stager, group)
    assert write_process.writer_pid() not in (None, pid)
    assert written.manifest() == digest_tree(str(tmp_path / "after"))
    _assert_equal(_load(str(tmp_path / "after")), _state(3.0))
    stager.close()
