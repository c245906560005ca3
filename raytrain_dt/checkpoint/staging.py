"""Reusable CPU staging buffers for async DCP saves (an `AsyncStager` for `dcp.async_save`).

An async save may only stall training for one copy of this rank's shards into memory that
training does not touch. DCP's default stagers make that copy costly: the first allocates
fresh buffers on every save (page faults for the whole state), and for DTensors it
`deepcopy`s the DTensor first, which clones the local shard once more before copying it again.
Here the buffers are allocated once (pinned when the shard lives on an accelerator, so the copy
is a fast DMA) and each later save is a plain `copy_` per shard into them. The staged state
dict wraps the buffers as DTensors with the source's mesh, placements and global shape, so DCP
plans and writes them exactly as it would the live state.

With `background=True` the copy itself runs on a staging thread and `stage` returns a future:
the caller must keep the source tensors unchanged until it resolves (the FSDP2 engine holds its
optimizer step on it), so the copy overlaps the next step's forward and backward. On an
accelerator that overlap needs a stream of its own: a copy queued on the compute stream runs
between the next step's kernels, in its order, and adds its whole time to the step. So the copy
goes on a copy stream that first waits for an event recorded on the compute stream when `stage`
was called (the values as of then), and the staging thread waits for that stream alone, never
for the device, whose queue holds the next step's work.

Reuse is safe only while no write still reads the buffers: the caller keeps one save in flight
(`RankCheckpointer.save` waits for the previous one first).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from raytrain_dt.checkpoint.write_process import SharedHostBuffer
from raytrain_dt.models.materialize import local_shard


class ReusableStager(AsyncStager):
    # stage() returns the copy's future (background) or its result; nothing to wait for after.
    _synchronize_after_execute = False

    def __init__(
        self, background: bool = False, one_allocation: bool = False, shared: bool = False
    ) -> None:
        # `one_allocation`: every buffer a view of one host allocation (an in-memory copy's,
        # which then travels to its peer as one array: Ray copies each array it sends, and
        # sending a hundred small ones cost 30x the CPU of sending one). `shared`: that
        # allocation is memory the checkpoint writer process maps (`write_process.py`), which
        # writes the staged state from it.
        self._one_allocation = one_allocation or shared
        self._shared = shared
        self._arena: _Arena | None = None
        self._staged: Any = None
        self._signature: Any = None
        self._streams: dict[torch.device, Any] = {}  # accelerator -> its copy stream
        # The last state dict's parts (held, so their ids stay theirs) and its (buffer, source)
        # pairs: staging the same parts again reuses the pairs.
        self._parts: list[Any] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="checkpoint-staging") if background else None
        )

    def stage(self, state_dict: dict) -> dict | Future:
        parts = list(state_dict.values())
        if self._copies is not None and _same_objects(parts, self._parts):
            # The same dicts as last time (an engine's live state, `engines/live_state.py`):
            # the same tensors, so the same buffers and pairs; only plain values are taken.
            copies = self._copies
            self._staged = _refresh(state_dict, self._staged, None)
        else:
            signature = _signature(state_dict)
            if signature != self._signature:  # first save, or the layout changed
                self._arena = _Arena(state_dict, self._shared) if self._one_allocation else None
                self._staged = _allocate(state_dict, self._arena or _own_buffer)
                self._signature = signature
            # Plain values (lr, betas, ...) are taken now; tensors are paired with their
            # buffers, as plain local tensors, so the staging thread runs no DTensor code.
            copies = []
            self._staged = _refresh(state_dict, self._staged, copies)
            self._copies, self._parts = copies, parts
        ready = _record_ready(copies)
        if self._executor is None:
            return self._copy(copies, ready)
        return self._executor.submit(self._copy, copies, ready)

    @property
    def signature(self) -> Any:
        """The staged state's structure and every shard's shape, dtype and placement (None
        before the first `stage`): equal signatures, equal layouts."""
        return self._signature

    @property
    def shared_buffer(self):
        """The shared allocation the staged tensors lie in (a `SharedHostBuffer`; None unless
        `shared`, or before the first `stage`)."""
        return self._arena.shared if self._arena is not None else None

    def _copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]], ready: dict) -> dict:
        with torch.no_grad():
            for buffer, source in copies:
                if source.device.type == "cpu":
                    buffer.copy_(source)
            for device, event in ready.items():
                module = torch.get_device_module(device.type)
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = module.Stream(device)
                stream.wait_event(event)
                with module.stream(stream):
                    for buffer, source in copies:
                        if source.device == device:
                            buffer.copy_(source, non_blocking=True)
                # The device->pinned copies must land before the writer reads the buffers.
                stream.synchronize()
        return self._staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for here: callers wait on the future `stage` returned."""

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._staged = self._signature = self._copies = self._arena = None
        self._parts = []


def _signature(obj: Any) -> Any:
    """What the buffers depend on: the structure and every shard's shape, dtype, placement."""
    if isinstance(obj, dict):
        return tuple((key, _signature(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(_signature(v) for v in obj))
    if isinstance(obj, torch.Tensor):
        local = local_shard(obj)
        placement = (obj._spec.placements, obj.shape) if isinstance(obj, DTensor) else None
        return (local.shape, local.dtype, local.device.type, placement)
    return type(obj)


def _record_ready(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Per accelerator among the sources, an event on its current (compute) stream: what the
    copy stream waits for, so it reads the values as of this call."""
    ready = {}
    for device in {source.device for _, source in copies if source.device.type != "cpu"}:
        module = torch.get_device_module(device.type)
        event = module.Event()
        event.record(module.current_stream(device))
        ready[device] = event
    return ready


def _own_buffer(local: torch.Tensor) -> torch.Tensor:
    """A host buffer for `local` (pinned when it lives on an accelerator: a fast DMA)."""
    return torch.empty(local.shape, dtype=local.dtype, pin_memory=local.device.type != "cpu")


class _Arena:
    """One host allocation for every tensor of `state_dict`, handed out as aligned views in
    the order `_allocate` asks for them (pinned if any tensor lives on an accelerator); with
    `shared`, one another process can map (`SharedHostBuffer`)."""

    ALIGN = 64  # bytes: every dtype's view may start at any multiple

    def __init__(self, state_dict: dict, shared: bool = False):
        tensors = list(_local_tensors(state_dict))
        total = sum(self._aligned(t.numel() * t.element_size()) for t in tensors)
        accelerator = next((t.device.type for t in tensors if t.device.type != "cpu"), "cpu")
        self.shared = None
        if shared:
            self.shared = SharedHostBuffer(total, pinned_for=accelerator)
            self.flat = self.shared.flat
        else:
            self.flat = torch.empty(total, dtype=torch.uint8, pin_memory=accelerator != "cpu")
        self._offset = 0

    def _aligned(self, nbytes: int) -> int:
        return -(-nbytes // self.ALIGN) * self.ALIGN

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        nbytes = local.numel() * local.element_size()
        view = self.flat[self._offset : self._offset + nbytes]
        self._offset += self._aligned(nbytes)
        return view.view(local.dtype).view(local.shape)


def _local_tensors(obj: Any):
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _local_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _local_tensors(value)
    elif isinstance(obj, torch.Tensor):
        yield local_shard(obj)


def _allocate(obj: Any, new_buffer) -> Any:
    if isinstance(obj, dict):
        return {key: _allocate(value, new_buffer) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_allocate(v, new_buffer) for v in obj)
    if not isinstance(obj, torch.Tensor):
        return obj
    buffer = new_buffer(local_shard(obj))
    if not isinstance(obj, DTensor):
        return buffer
    # The source's spec (mesh, placements, global shape) around the host buffer, as DCP's own
    # CPU staging builds it. Not `DTensor.from_local`: that moves a local tensor onto the
    # mesh's device, which would put every staging buffer in accelerator memory.
    return DTensor(buffer, obj._spec, requires_grad=False)


def _same_objects(parts: list[Any], previous: list[Any]) -> bool:
    return len(parts) == len(previous) and all(a is b for a, b in zip(parts, previous))


def _refresh(source: Any, staged: Any, copies: list | None) -> Any:
    """`staged` with `source`'s plain values, each tensor's (buffer, source) added to `copies`
    (unless None: the pairs are known)."""
    if isinstance(source, dict):
        for key, value in source.items():
            staged[key] = _refresh(value, staged[key], copies)
        return staged
    if isinstance(source, (list, tuple)):
        return type(source)(_refresh(v, target, copies) for v, target in zip(source, staged))
    if isinstance(source, torch.Tensor):
        if copies is not None:
            copies.append((local_shard(staged), local_shard(source).detach()))
        return staged
    return source
