"""Microbenchmark: the CPU one in-memory copy (`worker/peer_copies.py`) costs, in-process.

The state is one rank's share of bench_overhead.py's model (its narrowed `small` preset under
dp_shard=2: half of every parameter, with AdamW's two moments, step counts and
hyperparameters, as the flattened optimizer state dict has them). Each copy is staged into one
of three rotating buffer sets, captured as held tensors, kept, and sent to a Ray actor that
holds it as a peer does (`hold_copy`). Prints the median per copy, after two warm-up copies:
the copying thread's CPU by phase, its wall time, and the holder's CPU.
Run: python bench/bench_copy_cost.py [--copies N]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import ray
import torch

from raytrain_dt.checkpoint.memory_files import capture_copy, copy_metadata, from_wire, to_wire
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


def rank_state() -> dict:
    shapes = {"tok_embeddings.weight": (VOCAB, DIM), "norm.weight": (DIM,)}
    shapes["output.weight"] = (VOCAB, DIM)
    for i in range(LAYERS):
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
        started = time.thread_time()
        self.store.put(tuple(key), from_wire(wire))
        return time.thread_time() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    holder = Holder.remote()
    ray.get(holder.__ray_ready__.remote())
    state, store = rank_state(), CopyStore()
    stagers = [ReusableStager(one_allocation=True) for _ in range(store.keep + 1)]
    metadata: dict[int, object] = {}
    rows = []

    def one(step: int) -> None:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        buffers = step % len(stagers)
        staged = stagers[buffers].stage(state)
        cpu1 = time.thread_time()
        if buffers not in metadata:  # once per buffer set, as `PeerCopier` plans it
            metadata[buffers] = copy_metadata(staged, 0)
        copy = capture_copy(staged, 0, b"", metadata[buffers])
        store.put((1, step, 0), copy)
        cpu2 = time.thread_time()
        held = holder.hold_copy.remote((1, step, 1), to_wire(copy))
        cpu3 = time.thread_time()
        holder_cpu = ray.get(held)
        wall = time.perf_counter() - wall0
        rows.append((cpu3 - cpu0, cpu1 - cpu0, cpu2 - cpu1, cpu3 - cpu2, wall, holder_cpu))

    # On a thread of its own, as the copier's (the training thread's share is `stage`).
    thread = threading.Thread(target=lambda: [one(s) for s in range(args.copies)])
    thread.start()
    thread.join()
    ray.shutdown()
    rows = rows[2:]  # the first copies allocate their buffer sets and plan the metadata

    def ms(column: int) -> float:
        return statistics.median(r[column] for r in rows) * 1e3

    mb = sum(t.nbytes for t in state_tensors(state)) / 1e6
    print(
        f"one copy of {mb:.1f} MB (median of {len(rows)}): copying thread {ms(0):.1f} ms CPU "
        f"(staging {ms(1):.1f}, capture and keep {ms(2):.1f}, send {ms(3):.1f}), "
        f"wall {ms(4):.1f} ms; holder {ms(5):.1f} ms CPU"
    )
    return 0


def state_tensors(state: dict) -> list[torch.Tensor]:
    return [v for part in state.values() for v in part.values() if isinstance(v, torch.Tensor)]


if __name__ == "__main__":
    raise SystemExit(main())
