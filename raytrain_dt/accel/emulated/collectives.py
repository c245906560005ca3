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

    def _call(self, op: str, method: str, *args, outputs: tuple[int, ...] = (0,)) -> dist.Work:
        """gloo's `method` on host copies of `args` (tensors, lists of them, lists of lists;
        anything else, such as the options, as it is); once it is done, the host results at
        the argument positions `outputs` are copied into the device tensors given there."""
        host_args = self._to_host(op, args)
        self._wait(op, getattr(self._gloo, method)(*host_args))
        for i in outputs:
            _copy_into(args[i], host_args[i])
        return _done([t for i in outputs for t in _flat(args[i])])

    def _each(self, op: str, method: str, outputs, inputs, opts) -> dist.Work:
        """A coalesced collective as gloo's single-tensor `method` per (output, input) pair."""
        host_out, host_in = self._to_host(op, (outputs, inputs))
        for out, inp in zip(host_out, host_in, strict=True):
            self._wait(op, getattr(self._gloo, method)(out, inp, opts))
        _copy_into(outputs, host_out)
        return _done(list(outputs))

    def _to_host(self, op: str, args) -> list:
        if self._aborted.is_set():
            raise CommunicatorAborted(f"{BACKEND}: {op} on a group that was aborted")
        return [_host_copy(op, arg) for arg in args]

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

    # --- collectives: the names torch's C++ calls (functional collectives, DTensor) ----------
    def allreduce(self, tensors, opts=None):
        return self._call("allreduce", "allreduce", tensors, opts or c10d.AllreduceOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or c10d.AllreduceCoalescedOptions()
        return self._call("allreduce_coalesced", "allreduce_coalesced", tensors, opts)

    def broadcast(self, tensors, opts=None):
        return self._call("broadcast", "broadcast", tensors, opts or c10d.BroadcastOptions())

    def reduce(self, tensors, opts=None):
        return self._call("reduce", "reduce", tensors, opts or c10d.ReduceOptions())

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        return self._call("allgather", "allgather", output_lists, inputs, opts)

    def _allgather_base(self, output, input, opts=None):
        opts = opts or c10d.AllgatherOptions()
        return self._call("all_gather_into_tensor", "_allgather_base", output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        return self._each(
            "all_gather_into_tensor_coalesced", "_allgather_base", outputs, inputs, opts
        )

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        for outputs, tensor in zip(output_lists, inputs, strict=True):
            self._call("allgather_coalesced", "allgather", [outputs], [tensor], opts)
        return _done([t for outputs in output_lists for t in outputs])

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        return self._call("reduce_scatter", "reduce_scatter", outputs, input_lists, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        return self._call("reduce_scatter_tensor", "_reduce_scatter_base", output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        return self._each(
            "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", outputs, inputs, opts
        )

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or c10d.AllToAllOptions()
        return self._call(
            "all_to_all_single",
            "alltoall_base",
            output,
            input,
            output_split_sizes,
            input_split_sizes,
            opts,
        )

    def alltoall(self, outputs, inputs, opts=None):
        return self._call("all_to_all", "alltoall", outputs, inputs, opts or c10d.AllToAllOptions())

    def gather(self, output_lists, inputs, opts=None):
        return self._call("gather", "gather", output_lists, inputs, opts or c10d.GatherOptions())

    def scatter(self, outputs, input_lists, opts=None):
        return self._call("scatter", "scatter", outputs, input_lists, opts or c10d.ScatterOptions())

    def barrier(self, opts=None):
        # NCCL's barrier is an all-reduce of one element on the accelerator.
        index = torch.accelerator.current_device_index()
        return self.allreduce([torch.zeros(1, device=torch.device(DEVICE_TYPE, index))])

    # Point-to-point works are returned in flight: a pipeline schedule posts its sends and
    # receives together and waits for them afterwards (`batch_isend_irecv`), so waiting inside
    # `send` would deadlock two stages that both send first.
    def send(self, tensors, dst: int, tag: int = 0):
        (host,) = self._to_host("send", (tensors,))
        return _InFlight(self, "send", self._gloo.send(host, dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        (host,) = self._to_host("recv", (tensors,))
        return _InFlight(self, "recv", self._gloo.recv(host, src, tag), (tensors, host))

    # torch.distributed's eager API calls the same collectives by these names.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base


def _host_copy(op: str, arg):
    """`arg` with every tensor replaced by a host copy; each must live on the emulated device
    (NCCL's rule)."""
    if isinstance(arg, torch.Tensor):
        if arg.device.type != DEVICE_TYPE:
            raise RuntimeError(
                f"{BACKEND}: {op} got a tensor on {arg.device}; like NCCL, this backend "
                f"takes only tensors on the accelerator ({DEVICE_TYPE})"
            )
        return arg.detach().to("cpu")
    if isinstance(arg, (list, tuple)):
        return [_host_copy(op, item) for item in arg]
    return arg


def _copy_into(device, host) -> None:
    with torch.no_grad():
        for target, result in zip(_flat(device), _flat(host), strict=True):
            target.copy_(result)


def _flat(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    return [t for item in arg for t in _flat(item)]


class _InFlight(dist.distributed_c10d.Work):
    """A gloo work still running; `wait` waits for it as the group's collectives do, then
    copies a receive's host buffers (`copy_back`: device, host) into the device tensors."""

    def __init__(self, group: EmulatedCollectives, op: str, work, copy_back=None):
        super().__init__()
        self._group, self._op, self._work, self._copy_back = group, op, work, copy_back

    def wait(self, timeout=None) -> bool:
        self._group._wait(self._op, self._work)
        if self._copy_back is not None:
            _copy_into(*self._copy_back)
        return True


def _done(outputs: list[torch.Tensor]) -> dist.Work:
    future = torch.futures.Future()
    future.set_result(outputs)
    return _create_work_from_future(future)
