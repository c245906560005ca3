"""The doctor's probe actor: one per node, it reports the node's software and times an
all-reduce across the nodes on the device under test.

The all-reduce goes through the same device and backend choice as a rank's (`accel.device`),
so `emulated` exercises `emuccl` and `cuda` NCCL. Bus bandwidth follows nccl-tests: algorithm
bandwidth (bytes / time) x 2(n-1)/n, the traffic each link carries in a ring all-reduce.
"""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import time

import torch
import torch.distributed as dist

from raytrain_dt.accel.device import ray_accelerator_index, ray_device_kind, select_device


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def software_versions() -> dict:
    """What must match on every node: Python, torch (with its CUDA and NCCL), Ray, DeepSpeed."""
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "ray": _version("ray"),
        "deepspeed": _version("deepspeed"),
        "gpus_visible": torch.cuda.device_count() if cuda else 0,
    }


class CollectiveProbe:
    def __init__(self):
        self._ip = socket.gethostbyname(socket.gethostname())
        self._served: dist.TCPStore | None = None  # as rank 0 of the next all-reduce

    def facts(self) -> dict:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": self._ip,
            **software_versions(),
        }

    def serve_store(self) -> int:
        """Serve the all-reduce's rendezvous store, as its rank 0 (`rendezvous.serve_store`):
        the port, for the other probes."""
        from raytrain_dt.worker.rendezvous import serve_store

        self._served = serve_store(self._ip)
        return self._served.port

    def all_reduce(
        self,
        kind: str,
        master: tuple[str, int],
        rank: int,
        world: int,
        size_bytes: int,
        iterations: int,
        timeout_s: float,
    ) -> dict:
        """Time an all-reduce of a `size_bytes` fp32 buffer over the group (mean of
        `iterations`), after a warm-up whose sum is checked (each rank contributes rank + 1)."""
        import datetime

        device = select_device("fp32", ray_device_kind(kind), ray_accelerator_index())
        device.activate()
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store, self._served = self._served, None
        else:
            store = dist.TCPStore(master[0], master[1], is_master=False, timeout=timeout)
        dist.init_process_group(
            device.backend, store=store, rank=rank, world_size=world, timeout=timeout
        )
        try:
            buffer = torch.full((size_bytes // 4,), float(rank + 1), device=device.torch_device)
            # The warm-up sets up connections and the communicator (both lazy) and is checked.
            dist.all_reduce(buffer)
            correct = bool((buffer[:1024] == world * (world + 1) / 2).all().item())
            buffer.zero_()  # zeros stay zeros: the timed sums never overflow
            sync = device.module.synchronize if device.module else (lambda: None)
            sync()
            started = time.perf_counter()
            for _ in range(iterations):
                dist.all_reduce(buffer)
            sync()
            seconds = (time.perf_counter() - started) / iterations
        finally:
            dist.destroy_process_group()
        return {"seconds": seconds, "correct": correct}
