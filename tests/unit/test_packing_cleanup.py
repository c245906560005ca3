"""A packing of user data that died leaves its temporary directory (partial parts, up to the
dataset's size) under `data.cache_dir`: the next packing on that host removes it, and only it
(`data/user_data.remove_dead_packings`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from raytrain_dt.data.user_data import TMP_PREFIX, remove_dead_packings


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _tmp(root, host: str, pid: int | None, tag: str):
    name = f"{TMP_PREFIX}{host}-{pid}-{tag}" if pid is not None else f"{TMP_PREFIX}{tag}"
    path = root / name
    path.mkdir()
    (path / "part-00000.parquet").write_bytes(b"x" * 100)
    return path


def test_only_a_dead_packing_of_this_host_is_removed(tmp_path) -> None:
    host = socket.gethostname()
    dead = _tmp(tmp_path, host, _dead_pid(), "aa")
    live = _tmp(tmp_path, host, os.getpid(), "bb")  # a packing still running
    other_host = _tmp(tmp_path, f"not-{host}", _dead_pid(), "cc")  # a shared cache_dir
    unnamed = _tmp(tmp_path, host, None, "0123abcd")  # an earlier version's name
    packed = tmp_path / "5f2c9e"  # a finished dataset
    packed.mkdir()

    assert remove_dead_packings(tmp_path) == [dead]
    assert not dead.exists()
    assert all(p.exists() for p in (live, other_host, unnamed, packed))
    assert remove_dead_packings(tmp_path) == []
