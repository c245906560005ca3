"""The checkpoint writer process (`checkpoint/write_process.py`): an async save's bytes written
by a forked process of the rank, from the staging arena it maps.

Each test runs one rank (gloo, world 1) in a process of its own, as the rank actors do: the
writer is forked at the rank's start, and an FSDP2 engine saves through it. What is checked:
- the async save through the writer holds exactly the state a synchronous save holds, the
  writer process wrote its bytes (its own write count), and the digests recorded for the
  commit are those of the files on disk;
- the writer keeps none of the rank's connections open: a socket the rank closes is closed;
- a writer that died fails only the save in flight, and the next save forks a new one;
- the writer maps only the current layout's arena, and none once the layout is released.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import traceback

import pytest
from harness import _tensors, rank_process_context, settle_rank_process

SEQ_LEN = 32


def _in_rank_process(body, *args, start_writer: bool = True, timeout_s: float = 120):
    """Run `body(*args)` in a fresh rank process (world-1 gloo group); its return value. With
    `start_writer`, the writer is forked first, as a rank actor forks it at its start."""
    ctx = rank_process_context()
    answers = ctx.Queue()
    proc = ctx.Process(target=_rank_main, args=(body, args, start_writer, answers), daemon=True)
    proc.start()
    try:
        kind, value = answers.get(timeout=timeout_s)
    except queue.Empty:
        proc.kill()
        raise TimeoutError(f"{body.__name__} gave no answer in {timeout_s} s") from None
    finally:
        proc.join(timeout=30)
    if kind == "error":
        pytest.fail(value)
    return value


def _rank_main(body, args, start_writer: bool, answers) -> None:
    import torch.distributed as dist

    from raytrain_dt.checkpoint.write_process import start_write_process

    settle_rank_process()
    try:
        if start_writer:
            start_write_process()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            answers.put(("ok", body(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        answers.put(("error", traceback.format_exc()))


def _engine(dim: int = 64):
    """An FSDP2 engine over the one rank, on a small Llama, with its AdamW moments (one step)."""
    import dataclasses

    import torch

    from raytrain_dt.accel.device import select_device
    from raytrain_dt.config.schema import TrainConfig
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.fsdp2 import FSDP2Engine
    from raytrain_dt.models.model_spec import llama_spec
    from raytrain_dt.models.presets import ModelShape
    from raytrain_dt.parallel.device_mesh import build_mesh
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims

    device = select_device("fp32")
    layout = Layout(ParallelDims(world_size=1, dp_shard=1), 1, 1, 1)
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=SEQ_LEN))
    shape = ModelShape(
        dim=dim, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256, ffn_hidden=2 * dim
    )
    engine = FSDP2Engine(
        EngineBuild(llama_spec(shape), cfg, layout, build_mesh(layout.dims, "cpu"), device)
    )
    torch.manual_seed(0)
    engine.train_step([torch.randint(0, 256, (1, SEQ_LEN))], 0)
    return engine


def _write_group():
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def _load(directory: str) -> dict:
    """Every tensor of a DCP checkpoint, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = f"{directory}.pt"
    dcp_to_torch_save(directory, target)
    return torch.load(target, weights_only=False)


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}


def _written_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _async_equals_sync(root: str) -> dict:
    from raytrain_dt.checkpoint.digests import FileDigests, digest_tree
    from raytrain_dt.checkpoint.write_process import write_process

    engine = _engine()
    engine.save(f"{root}/sync")
    writer = write_process()
    written_before = _written_bytes(writer.pid)
    digests = FileDigests()
    engine.save_async(f"{root}/async", _write_group(), digests=digests).result()
    return {
        "writer_pid": writer.pid,
        "rank_pid": os.getpid(),
        "writer_wrote": _written_bytes(writer.pid) - written_before,
        "state_bytes": sum(t.numel() * t.element_size() for t in _tensors(engine._stager._staged)),
        "recorded": digests.manifest(),
        "on_disk": digest_tree(f"{root}/async"),
    }


def test_an_async_save_through_the_writer_process_holds_the_synchronous_saves_state(tmp_path):
    import torch

    seen = _in_rank_process(_async_equals_sync, str(tmp_path))
    assert seen["writer_pid"] != seen["rank_pid"]
    # The writer process wrote the state's bytes (DCP's framing adds a little).
    assert seen["writer_wrote"] >= seen["state_bytes"] > 0
    assert seen["recorded"] == seen["on_disk"]
    sync, saved = _flat(_load(str(tmp_path / "sync"))), _flat(_load(str(tmp_path / "async")))
    assert sorted(saved) == sorted(sync)
    for key, value in sync.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(saved[key], value, atol=0, rtol=0, msg=key)
        else:
            assert saved[key] == value, key


def _closed_socket_reaches_its_peer() -> bytes | str:
    from raytrain_dt.checkpoint.write_process import start_write_process

    ours, peer = socket.socketpair()  # a connection the rank holds when the writer forks
    start_write_process()
    ours.close()  # the rank closes its end, as gloo closes a released layout's connections
    peer.settimeout(5)
    try:
        return peer.recv(1)  # b"": the connection is closed
    except TimeoutError:
        return "still open: the writer process holds a copy of the closed end"


def test_the_writer_process_keeps_none_of_the_ranks_connections_open():
    assert _in_rank_process(_closed_socket_reaches_its_peer, start_writer=False) == b""


def _save_after_the_writer_died(root: str) -> dict:
    from raytrain_dt.checkpoint.write_process import write_process

    engine = _engine()
    group = _write_group()
    engine.save_async(f"{root}/first", group).result()
    dead = write_process().pid
    os.kill(dead, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(dead, 0)
    failed = engine.save_async(f"{root}/second", group).exception()
    engine.save_async(f"{root}/third", group).result()
    return {"dead": dead, "failure": repr(failed), "new": write_process().pid}


def test_a_writer_that_died_fails_only_the_save_in_flight(tmp_path):
    import torch

    seen = _in_rank_process(_save_after_the_writer_died, str(tmp_path))
    assert "WriterProcessFailed" in seen["failure"] and "died" in seen["failure"]
    assert seen["new"] != seen["dead"]
    first, third = _flat(_load(str(tmp_path / "first"))), _flat(_load(str(tmp_path / "third")))
    for key, value in first.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(third[key], value, atol=0, rtol=0, msg=key)


def _staging_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("raytrain-dt-staging" in line for line in f)


def _mappings_across_layouts(root: str) -> list[int]:
    import gc
    import time

    from raytrain_dt.checkpoint.write_process import release_write_arenas, write_process

    def mappings() -> int:
        # The child handles a release after its answer: wait for it (bounded).
        deadline = time.monotonic() + 5
        while (count := _staging_mappings(write_process().pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return count

    counts = []
    engine = _engine(dim=64)
    engine.save_async(f"{root}/first", _write_group()).result()
    counts.append(_staging_mappings(write_process().pid))
    engine = _engine(dim=128)  # a new layout: new shards, a new arena
    engine.save_async(f"{root}/second", _write_group()).result()
    counts.append(_staging_mappings(write_process().pid))
    del engine
    gc.collect()
    release_write_arenas()  # as a rank does once its old layout is collected
    counts.append(mappings())
    return counts


def test_the_writer_maps_only_the_current_layouts_arena(tmp_path):
    """One mapping while a layout saves, its predecessor's dropped at its first save; none
    once the layout is released (its staging memory goes back to the host then)."""
    assert _in_rank_process(_mappings_across_layouts, str(tmp_path)) == [1, 1, 0]
