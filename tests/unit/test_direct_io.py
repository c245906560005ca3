"""Checkpoint files written around the page cache (`checkpoint/direct_io.py`) hold exactly the
bytes written, whatever their sizes against the alignment and the block; a filesystem without
`O_DIRECT` gets an ordinary file with the same bytes; a DCP save through them reloads equal and
verifies."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from raytrain_dt.checkpoint import direct_io
from raytrain_dt.checkpoint.digests import FileDigests, verify_files
from raytrain_dt.checkpoint.direct_io import ALIGN, BLOCK, DirectFile, open_for_writing
from raytrain_dt.checkpoint.storage import dcp_reader, dcp_writer


def _pieces(seed: int) -> list[bytes]:
    """Writes of awkward sizes: tiny, unaligned, a block and more, spanning block edges."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, ALIGN - 1, 3, BLOCK, BLOCK - 5, 2 * BLOCK + 17, 0, 4097]
    return [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes()
        for n in sizes
    ]


def test_a_direct_file_holds_exactly_the_bytes_written(tmp_path):
    path = tmp_path / "shard.distcp"
    pieces = _pieces(0)
    with open_for_writing(path) as f:
        assert isinstance(f, DirectFile)  # this test's filesystem takes O_DIRECT
        offsets = []
        for piece in pieces:
            offsets.append(f.tell())
            assert f.write(memoryview(piece)) == len(piece)
    expected = b"".join(pieces)
    assert path.read_bytes() == expected  # the padded tail is cut off
    assert offsets[-1] == len(expected) - len(pieces[-1])
    # An exact multiple of the alignment: no tail to pad.
    with open_for_writing(tmp_path / "aligned") as f:
        f.write(expected[: 3 * ALIGN])
    assert (tmp_path / "aligned").read_bytes() == expected[: 3 * ALIGN]


def test_a_filesystem_without_o_direct_gets_an_ordinary_file(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    path = tmp_path / "shard"
    with open_for_writing(path) as f:
        assert not isinstance(f, DirectFile)
        for piece in _pieces(1):
            f.write(piece)
    assert path.read_bytes() == b"".join(_pieces(1))


def test_another_error_opening_is_raised(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_for_writing(tmp_path / "missing_dir" / "shard")


def test_a_dcp_save_written_direct_reloads_equal_and_verifies(tmp_path):
    state = {f"w{i}": torch.randn(1000 + 333 * i) for i in range(5)}
    state["big"] = torch.randn(BLOCK // 4 + 3)  # spans a block edge
    digests = FileDigests()
    uri = str(tmp_path / "step_1")
    dcp.save(state, storage_writer=dcp_writer(uri, digests), no_dist=True)
    assert verify_files(uri, digests.manifest()) == []
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=dcp_reader(uri), no_dist=True)
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor), key
