"""`emuccl`: the emulated accelerator's collective backend, with NCCL's contract.

Every tensor handed to it must live on the emulated device, or the call raises, as NCCL raises
on a host tensor. The data then moves through gloo on host copies. Two more of NCCL's
behaviours matter to the worker and are kept:

- `abort()` unblocks a rank waiting in a collective whose peer is gone (ncclCommAbort). gloo
  itself cannot be interrupted, so each gloo work is waited on a thread of the group's own
  while the caller watches an abort flag; an aborted group raises in the waiting thread and is
  never used again.
- errors (a dead peer, the collective timeout) raise in the calling rank; the process lives.

It is a Python `ProcessGroup` (torch's c10d calls its methods for the eager API and for the
functional collectives DTensor uses); a gloo backend registered under it gives it its name.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import threading

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo, _create_work_from_future

from raytrain_dt.accel.emulated import BACKEND, DEVICE_TYPE

_WAIT_SLICE_S = 0.05  # how often a blocked wait looks at the abort flag


class CommunicatorAborted(RuntimeError):
    """The group was aborted while (or before) this collective ran."""


class EmulatedCollectives(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._gloo = ProcessGroupGloo(store, rank, size, timeout)
        self._register_backend(
            torch.device(DEVICE_TYPE), dist.ProcessGroup.BackendType.CUSTOM, self._gloo
        )
        self._aborted = threading.Event()
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=BACKEND)

    @classmethod
    def create(cls, store, rank: int, size: int, timeout: datetime.timedelta):
        """The creator `dist.Backend.register_backend` calls for every new group."""
        return cls(store, rank, size, timeout)

    def getBackendName(self) -> str:  # c10d's name for it
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # --- NCCL's behaviour ---------------------------------------------------------------------
    def abort(self) -> None:
        self._aborted.set()

    def shutdown(self) -> None:
        self._aborted.set()
        self._waiter.shutdown(wait=False)

    def _run(self, op: str, outputs: list[torch.Tensor], work_fn) -> dist.Work:
        """Run `work_fn` (a gloo call on host copies) and copy its results into `outputs`."""
        if self._aborted.is_set():
            raise CommunicatorAborted(f"{BACKEND}: {op} on a group that was aborted")
        work = work_fn()
        self._wait(op, work)
        return _done(outputs)

    def _wait(self, op: str, work) -> None:
        """`work.wait()` on this group's waiter thread, while this thread watches for an abort.

        Some gloo works (reduce-scatter) neither complete nor offer a future until waited, so
        the wait itself must run somewhere that an abort can walk away from. An aborted wait
        stays on the waiter thread, which the group never uses again.
        """
        waiting = self._waiter.submit(work.wait)
        while True:
            try:
                waiting.result(timeout=_WAIT_SLICE_S)  # raises the collective's own error
                return
            except concurrent.futures.TimeoutError:
                if self._aborted.is_set():
                    raise CommunicatorAborted(
                        f"{BACKEND}: {op} interrupted: the group was aborted"
                    ) from None

    # --- collectives --------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or c10d.AllreduceOptions()
        host = _to_host("allreduce", tensors)
        return self._run(
            "allreduce",
            tensors,
            lambda: _then_copy(self._gloo.allreduce(host, opts), host, tensors),
        )

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or c10d.AllreduceCoalescedOptions()
        host = _to_host("allreduce_coalesced", tensors)
        return self._run(
            "allreduce_coalesced",
            tensors,
            lambda: _then_copy(self._gloo.allreduce_coalesced(host, opts), host, tensors),
        )

    def broadcast(self, tensors, opts=None):
        opts = opts or c10d.BroadcastOptions()
        host = _to_host("broadcast", tensors)
        return self._run(
            "broadcast",
            tensors,
            lambda: _then_copy(self._gloo.broadcast(host, opts), host, tensors),
        )

    def reduce(self, tensors, opts=None):
        opts = opts or c10d.ReduceOptions()
        host = _to_host("reduce", tensors)
        return self._run(
            "reduce", tensors, lambda: _then_copy(self._gloo.reduce(host, opts), host, tensors)
        )

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        host_in = _to_host("allgather", inputs)
        host_out = [_to_host("allgather", outs) for outs in output_lists]
        flat_out = [t for outs in output_lists for t in outs]
        flat_host = [t for outs in host_out for t in outs]
        return self._run(
            "allgather",
            flat_out,
            lambda: _then_copy(self._gloo.allgather(host_out, host_in, opts), flat_host, flat_out),
        )

    def _allgather_base(self, output, input, opts=None):
        opts = opts or c10d.AllgatherOptions()
        host_out, host_in = _to_host("all_gather_into_tensor", [output, input])
        return self._run(
            "all_gather_into_tensor",
            [output],
            lambda: _then_copy(
                self._gloo._allgather_base(host_out, host_in, opts), [host_out], [output]
            ),
        )

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        host_out = _to_host("allgather_into_tensor_coalesced", outputs)
        host_in = _to_host("allgather_into_tensor_coalesced", inputs)

        def gather_each():
            works = [self._gloo._allgather_base(o, i, opts) for o, i in zip(host_out, host_in)]
            for work in works[:-1]:
                self._wait("allgather_into_tensor_coalesced", work)
            return _then_copy(works[-1], host_out, outputs)

        return self._run("allgather_into_tensor_coalesced", outputs, gather_each)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        host_out = _to_host("reduce_scatter", outputs)
        host_in = [_to_host("reduce_scatter", ins) for ins in input_lists]
        return self._run(
            "reduce_scatter",
            outputs,
            lambda: _then_copy(
                self._gloo.reduce_scatter(host_out, host_in, opts), host_out, outputs
            ),
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        host_out, host_in = _to_host("reduce_scatter_tensor", [output, input])
        return self._run(
            "reduce_scatter_tensor",
            [output],
            lambda: _then_copy(
                self._gloo._reduce_scatter_base(host_out, host_in, opts), [host_out], [output]
            ),
        )

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        host_out = _to_host("reduce_scatter_tensor_coalesced", outputs)
        host_in = _to_host("reduce_scatter_tensor_coalesced", inputs)

        def scatter_each():
            works = [self._gloo._reduce_scatter_base(o, i, opts) for o, i in zip(host_out, host_in)]
            for work in works[:-1]:
                self._wait("reduce_scatter_tensor_coalesced", work)
            return _then_copy(works[-1], host_out, outputs)

        return self._run("reduce_scatter_tensor_coalesced", outputs, scatter_each)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or c10d.AllToAllOptions()
        host_out, host_in = _to_host("all_to_all_single", [output, input])
        return self._run(
            "all_to_all_single",
            [output],
            lambda: _then_copy(
                self._gloo.alltoall_base(
                    host_out, host_in, output_split_sizes, input_split_sizes, opts
                ),
                [host_out],
                [output],
            ),
        )

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllToAllOptions()
        host_out = _to_host("all_to_all", outputs)
        host_in = _to_host("all_to_all", inputs)
        return self._run(
            "all_to_all",
            outputs,
            lambda: _then_copy(self._gloo.alltoall(host_out, host_in, opts), host_out, outputs),
        )

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.GatherOptions()
        host_in = _to_host("gather", inputs)
        host_out = [_to_host("gather", outs) for outs in output_lists]
        flat_out = [t for outs in output_lists for t in outs]
        flat_host = [t for outs in host_out for t in outs]
        return self._run(
            "gather",
            flat_out,
            lambda: _then_copy(self._gloo.gather(host_out, host_in, opts), flat_host, flat_out),
        )

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ScatterOptions()
        host_out = _to_host("scatter", outputs)
        host_in = [_to_host("scatter", ins) for ins in input_lists]
        return self._run(
            "scatter",
            outputs,
            lambda: _then_copy(self._gloo.scatter(host_out, host_in, opts), host_out, outputs),
        )

    # Point-to-point works are returned in flight: a pipeline schedule posts its sends and
    # receives together and waits for them afterwards (`batch_isend_irecv`), so waiting inside
    # `send` would deadlock two stages that both send first.
    def send(self, tensors, dst: int, tag: int = 0):
        host = _to_host("send", tensors)
        return _InFlight(self, "send", self._gloo.send(host, dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        host = _to_host("recv", tensors)
        return _InFlight(self, "recv", _then_copy(self._gloo.recv(host, src, tag), host, tensors))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        host_in = _to_host("allgather_coalesced", inputs)
        host_out = [_to_host("allgather_coalesced", outs) for outs in output_lists]
        flat_out = [t for outs in output_lists for t in outs]
        flat_host = [t for outs in host_out for t in outs]

        def gather_each():
            works = [self._gloo.allgather([o], [i], opts) for o, i in zip(host_out, host_in)]
            for work in works[:-1]:
                self._wait("allgather_coalesced", work)
            return _then_copy(works[-1], flat_host, flat_out)

        return self._run("allgather_coalesced", flat_out, gather_each)

    def barrier(self, opts=None):
        # NCCL's barrier is an all-reduce of one element on the accelerator.
        flag = torch.zeros(
            1, device=torch.device(DEVICE_TYPE, torch.accelerator.current_device_index())
        )
        return self.allreduce([flag])

    # torch.distributed's eager API calls the same collectives by these names; torch's C++
    # (functional collectives, DTensor) by the ones above.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base


def _to_host(op: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of `tensors`, which must all live on the emulated device (NCCL's rule)."""
    for tensor in tensors:
        if tensor.device.type != DEVICE_TYPE:
            raise RuntimeError(
                f"{BACKEND}: {op} got a tensor on {tensor.device}; like NCCL, this backend "
                f"takes only tensors on the accelerator ({DEVICE_TYPE})"
            )
    return [tensor.detach().to("cpu") for tensor in tensors]


class _CopyBack:
    """A gloo work whose host results are copied into the device tensors once it is waited."""

    def __init__(self, work, host, device):
        self.work, self.host, self.device = work, host, device

    def wait(self) -> None:
        self.work.wait()
        with torch.no_grad():
            for target, result in zip(self.device, self.host, strict=True):
                target.copy_(result)


class _InFlight(dist.distributed_c10d.Work):
    """A work still running on gloo; `wait` waits for it as the group's collectives do."""

    def __init__(self, group: EmulatedCollectives, op: str, work):
        super().__init__()
        if group._aborted.is_set():
            raise CommunicatorAborted(f"{BACKEND}: {op} on a group that was aborted")
        self._group, self._op, self._work = group, op, work

    def wait(self, timeout=None) -> bool:
        self._group._wait(self._op, self._work)
        return True


def _then_copy(work, host, device) -> _CopyBack:
    return _CopyBack(work, host, device)


def _done(outputs: list[torch.Tensor]) -> dist.Work:
    future = torch.futures.Future()
    future.set_result(outputs)
    return _create_work_from_future(future)
