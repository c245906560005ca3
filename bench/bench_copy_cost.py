"""Microbenchmark: the CPU one in-memory copy (`worker/peer_copies.py`) costs, in-process.

The state is one rank's share of bench_overhead.py's model (its narrowed `small` preset under
dp_shard=2: half of every parameter, with AdamW's two moments, step counts and
hyperparameters, as the flattened optimizer state dict has them). Each copy is staged into one
of three rotating buffer sets, captured as held tensors, kept, and sent to a Ray actor that
holds it as a peer does (`hold_copy`). Reports the median per copy, after two warm-up copies:
the copying thread's CPU by phase, its wall time, and the holder process's CPU.

Each size is measured twice: the layout (DCP metadata, tensor placement) sent with the first
copy only, as `PeerCopier` sends it, and with every copy, as it was sent before. Its pickling
costs in proportion to the shards' count, so the second size has the model's blocks (29
tensors each) multiplied: a rank of a 100B+ model holds thousands of tensors.
Writes bench/results/copy_cost.json.
Run: python bench/bench_copy_cost.py [--copies N] [--layers 4,64]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from raytrain_dt.checkpoint.memory_files import capture_copy, copy_metadata, to_wire
from raytrain_dt.checkpoint.staging import ReusableStager
from raytrain_dt.worker.peer_copies import CopyStore

DIM, LAYERS, FFN, VOCAB, DP_SHARD = 256, 4, 688, 256, 2  # bench_overhead.py's model and layout
ADAMW_GROUP = {
    "lr": 1e-3,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "weight_decay": 0.1,
    "amsgrad": False,
    "foreach": None,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


def rank_state(layers: int = LAYERS) -> dict:
    shapes = {"tok_embeddings.weight": (VOCAB, DIM), "norm.weight": (DIM,)}
    shapes["output.weight"] = (VOCAB, DIM)
    for i in range(layers):
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"layers.{i}.attention.{name}.weight"] = (DIM, DIM)
        shapes[f"layers.{i}.feed_forward.w1.weight"] = (FFN, DIM)
        shapes[f"layers.{i}.feed_forward.w2.weight"] = (DIM, FFN)
        shapes[f"layers.{i}.feed_forward.w3.weight"] = (FFN, DIM)
        shapes[f"layers.{i}.attention_norm.weight"] = (DIM,)
        shapes[f"layers.{i}.ffn_norm.weight"] = (DIM,)
    model = {k: torch.randn((v[0] // DP_SHARD, *v[1:])) for k, v in shapes.items()}
    optim: dict = {}
    for name, param in model.items():
        optim[f"state.{name}.exp_avg"] = torch.randn_like(param)
        optim[f"state.{name}.exp_avg_sq"] = torch.rand_like(param)
        optim[f"state.{name}.step"] = torch.tensor(5.0)
        optim.update({f"param_groups.{name}.{k}": v for k, v in ADAMW_GROUP.items()})
    return {"model": model, "optim": optim}


@ray.remote(num_cpus=0)
class Holder:
    """A peer's side of `RankWorker.hold_copy`."""

    def __init__(self):
        self.store = CopyStore()

    def hold_copy(self, key, wire) -> float:
        """The holder process's CPU clock once the copy is held (a None key: the clock
        alone): between two copies its process does nothing else, so the difference is one
        copy's whole cost to it (Ray receiving and unpickling the call included)."""
        if key is not None:
            self.store.hold(tuple(key), wire)
        return time.process_time()


def measure(layers: int, layout_every_copy: bool, copies: int) -> dict:
    """One case: `copies` copies of a rank's state at `layers` blocks to a fresh holder; the
    medians per copy after two warm-up copies (they allocate and plan)."""
    holder = Holder.remote()
    ray.get(holder.__ray_ready__.remote())
    state, store = rank_state(layers), CopyStore()
    stagers = [ReusableStager(one_allocation=True) for _ in range(store.keep + 1)]
    metadata: dict = {}
    rows, sent, holder_clock = [], [None], [ray.get(holder.hold_copy.remote(None, None))]

    def one(step: int) -> None:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        buffers = step % len(stagers)
        staged = stagers[buffers].stage(state)
        cpu1 = time.thread_time()
        if not metadata:  # once per layout, as `PeerCopier` plans it
            metadata["planned"] = copy_metadata(staged, 0)
        copy = capture_copy(staged, 0, b"", metadata["planned"])
        store.put((1, step, 0), copy)
        cpu2 = time.thread_time()
        wire = to_wire(copy, known=sent[0])  # the layout the holder has: sent once
        held = holder.hold_copy.remote((1, step, 0), wire)
        cpu3 = time.thread_time()
        clock = ray.get(held)
        holder_cpu, holder_clock[0] = clock - holder_clock[0], clock
        if not layout_every_copy:
            sent[0] = wire["layout"] or sent[0]
        wall = time.perf_counter() - wall0
        rows.append((cpu3 - cpu0, cpu1 - cpu0, cpu2 - cpu1, cpu3 - cpu2, wall, holder_cpu))

    # On a thread of its own, as the copier's (the training thread's share is `stage`).
    thread = threading.Thread(target=lambda: [one(s) for s in range(copies)])
    thread.start()
    thread.join()
    ray.kill(holder)
    rows = rows[2:]

    def ms(column: int) -> float:
        return round(statistics.median(r[column] for r in rows) * 1e3, 1)

    case = {
        "blocks": layers,
        "tensors": len(state_tensors(state)),
        "state_mb": round(sum(t.nbytes for t in state_tensors(state)) / 1e6, 1),
        "layout_sent": "with every copy (before)" if layout_every_copy else "once per layout",
        "copy_thread_cpu_ms": ms(0),
        "staging_ms": ms(1),
        "capture_and_keep_ms": ms(2),
        "send_ms": ms(3),
        "holder_cpu_ms": ms(5),
        "wall_ms": ms(4),
    }
    print(case, flush=True)
    return case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=14)
    parser.add_argument(
        "--layers",
        default=f"{LAYERS},64",
        help="comma-separated blocks of the model (29 tensors per block, the shards' count)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cases = [
            measure(int(layers), every, args.copies)
            for layers in args.layers.split(",")
            for every in (False, True)
        ]
    finally:
        ray.shutdown()
    common.write_result(
        "copy_cost",
        "In-memory copy: CPU per copy of one rank's state (issue 19)",
        shlex.join(["python", *sys.argv]),
        "none here (bench_overhead.py holds issue 19's step-time target): where a copy's "
        "CPU goes, which a host whose cores train pays out of its steps",
        cases,
        notes=(
            f"bench_overhead.py's model (dim {DIM}, dp_shard={DP_SHARD}: one rank's half of "
            f"every parameter and both AdamW moments) at {args.layers} blocks; {args.copies} "
            "copies per case, medians after two warm-up copies; the copying thread's CPU "
            "(staging into the rotating buffer set, capture and keep, send: Ray's pickling "
            "and put), the holder process's CPU (Ray receiving the call, unpickling, copying "
            "into its own memory), and the wall time to the holder's answer; one process "
            "and one holder actor on this host"
        ),
    )
    return 0


def state_tensors(state: dict) -> list[torch.Tensor]:
    return [v for part in state.values() for v in part.values() if isinstance(v, torch.Tensor)]


if __name__ == "__main__":
    raise SystemExit(main())
