"""Microbenchmark: what one async save costs the rank's process, per GB, robust to host load.

One rank's state of bench_checkpoint.py's model (its ZeRO-3 shard of the parameters and both
AdamW moments, ~350 MB) is saved with `dcp.async_save` and the engine's `ReusableStager`, as
the FSDP2 engine saves it, several times; the state's tensors change between saves. For each
save it measures CPU seconds (user + system, from getrusage/procfs, so other processes' load
does not count) of the rank's process, all its threads, and of the writer process:

- `thread`: DCP's writer in the rank's process (`storage.dcp_writer`, the previous path);
- `process`: the shard files written by the rank's writer process (`write_process.py`).

Both hash every byte (`digests.FileDigests`) and fsync. The first save of each (allocation,
the process's start) is not counted. The rank's GIL is measured from outside, e.g.
`py-spy record --gil -r 250 -f raw -o gil.txt -- python bench/bench_async_write.py --writer
process`: samples of the save's threads holding it.

Target: the process writer cuts the rank process's CPU per GB saved at least by half.
Prints one line per writer; exits 1 when the target is missed.
Run: python bench/bench_async_write.py [--saves N] [--writer thread,process]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from raytrain_dt.checkpoint import write_process
from raytrain_dt.checkpoint.digests import FileDigests
from raytrain_dt.checkpoint.staging import ReusableStager
from raytrain_dt.checkpoint.storage import dcp_writer

# bench_checkpoint.py's model: (dim, layers, vocab, ffn); one of its two ranks' halves.
DIM, LAYERS, VOCAB, FFN = 512, 8, 32000, 1408
TARGET_CUT = 0.5


def rank_state() -> dict:
    shapes = [(VOCAB, DIM), (VOCAB, DIM), (DIM,)]
    for _ in range(LAYERS):
        shapes += [(DIM, DIM)] * 4 + [(FFN, DIM), (FFN, DIM), (DIM, FFN), (DIM,), (DIM,)]
    state = {}
    for i, shape in enumerate(shapes):
        half = (max(1, shape[0] // 2), *shape[1:])
        state[f"layer{i}"] = {
            "param": torch.randn(half),
            "exp_avg": torch.randn(half),
            "exp_avg_sq": torch.rand(half),
        }
    return state


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(writer: str, state: dict, root: str, saves: int) -> dict:
    stager = ReusableStager(background=True)
    group = dist.new_group(backend="gloo")
    rank_s, writer_s, wall_s = [], [], []
    for i in range(saves + 1):
        for layer in state.values():
            layer["param"].add_(1.0)  # a new state each save, as after a step
        uri = f"{root}/{writer}_{i}"
        storage_writer = (
            write_process.ProcessWriter(uri, FileDigests())
            if writer == "process"
            else dcp_writer(uri, FileDigests())
        )
        pid = write_process.writer_pid()
        rank0, writer0, started = own_cpu(), process_cpu(pid), time.perf_counter()
        response = dcp.async_save(
            state, storage_writer=storage_writer, async_stager=stager, process_group=group
        )
        response.upload_completion.result()
        if i == 0:  # allocation, the writer process's start
            continue
        wall_s.append(time.perf_counter() - started)
        rank_s.append(own_cpu() - rank0)
        writer_s.append(process_cpu(write_process.writer_pid()) - writer0)
    stager.close()
    return {
        "rank_cpu_s": statistics.median(rank_s),
        "writer_cpu_s": statistics.median(writer_s),
        "wall_s": statistics.median(wall_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--writer", default="thread,process")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as inside the rank actors
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    state = rank_state()
    gb = sum(t.nbytes for layer in state.values() for t in layer.values()) / 1e9
    found = {}
    with tempfile.TemporaryDirectory(prefix="bench_async_write_") as root:
        for writer in args.writer.split(","):
            found[writer] = m = measure(writer, state, root, args.saves)
            print(
                f"{writer:8s}: {gb:.3f} GB per save; rank process CPU {m['rank_cpu_s']:.3f} s "
                f"({m['rank_cpu_s'] / gb:.2f} s/GB), writer process CPU {m['writer_cpu_s']:.3f} s "
                f"({m['writer_cpu_s'] / gb:.2f} s/GB), wall {m['wall_s']:.3f} s "
                f"(median of {args.saves}; load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    dist.destroy_process_group()
    if {"thread", "process"} <= found.keys():
        cut = 1 - found["process"]["rank_cpu_s"] / found["thread"]["rank_cpu_s"]
        met = cut >= TARGET_CUT
        print(
            f"{'PASS' if met else 'FAIL'}: the process writer cuts the rank's CPU per save by "
            f"{cut:.0%} (target >= {TARGET_CUT:.0%})"
        )
        return 0 if met else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
