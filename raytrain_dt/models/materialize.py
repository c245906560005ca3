"""Meta-device construction and sharded materialization: no rank ever holds the whole model.

A rank builds its model as a skeleton (`parameters_on_meta`: parameters on the meta device, no
memory; buffers such as the rotary table computed for real, they are small), cuts its pipeline
stage, applies tensor parallelism and FSDP to the skeleton, and only then allocates and fills
the parameters it holds (`materialize`): each local shard is read from a `WeightSource` by the
parameter's name in the unsharded model and the global region the shard covers.

Sources:
- `RandomWeights`: the model's initialisation, identical whatever the layout. Each parameter
  is cut into blocks of whole rows (dim 0) of at most `BLOCK_ELEMENTS` values, and block k of
  parameter `name` is drawn from a generator seeded by (run seed, name, k). A rank draws only the
  blocks its shard overlaps, so a shard costs its own size plus one block, never the parameter;
  and the values do not depend on who draws them. Which distribution a parameter gets is the
  model spec's rule (`ModelSpec.param_init`: our decoder's normal(0.02) with depth-scaled
  residual projections and unit norms; transformers' `_init_weights` for `model.hf`).
- `models.hf_weights.DirectoryWeights`: slices of a Hugging Face directory's tensors
  (safetensors' `get_slice`: a rank reads only the bytes of its shards).

The single-process model (`ModelSpec.build`, the tests' reference) is the same skeleton
materialized whole with the same source, so every layout starts from the same weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

# Rows per random block: as many as fit this many values (one row when a row is larger). Part
# of the initialisation's definition: changing it changes every initial weight.
BLOCK_ELEMENTS = 1 << 20
# torch's CheckpointWrapper inserts this into the names of the modules it wraps.
_AC_PREFIX = "_checkpoint_wrapped_module."

# (the spec's options, parameter name in the unsharded model, the module holding it) -> rule
ParamInitRule = Callable[[object, str, nn.Module], "ParamInit"]
Index = tuple[slice, ...]


@dataclass(frozen=True)
class ParamInit:
    """How one parameter starts: `kind` normal (mean 0, `std`), ones or zeros; `zero_rows`
    are set to 0 after drawing (an embedding's padding index)."""

    kind: str
    std: float = 0.0
    zero_rows: tuple[int, ...] = ()

    @staticmethod
    def normal(std: float, zero_rows: tuple[int, ...] = ()) -> ParamInit:
        return ParamInit("normal", std, zero_rows)

    @staticmethod
    def ones() -> ParamInit:
        return ParamInit("ones")

    @staticmethod
    def zeros() -> ParamInit:
        return ParamInit("zeros")


class WeightSource(Protocol):
    def read(
        self, name: str, module: nn.Module, shape: tuple[int, ...], index: Index
    ) -> torch.Tensor:
        """The region `index` (one slice per dim) of the unsharded parameter `name` of global
        `shape`, held by `module`, as an fp32 host tensor."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules constructed inside register their parameters on the meta device (their own
    init then costs nothing) while buffers keep their real values. A parameter assigned twice
    (tied weights) stays one object."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            # Its host storage was never touched (torch.empty): nothing was really allocated.
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def unsharded_name(name: str) -> str:
    """A parameter's name in the unwrapped model (activation checkpointing wraps blocks)."""
    return name.replace(_AC_PREFIX, "")


def unique_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Parameter]]:
    """(name in the unsharded model, owning module, parameter), each parameter once: a tied
    parameter under its first name, as `named_parameters` gives it."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield unsharded_name(f"{prefix}.{leaf}" if prefix else leaf), module, param


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard, sharing its storage: in-place
    updates land in it; any other tensor itself)."""
    from torch.distributed.tensor import DTensor

    # The local shard itself, not `to_local()`: that runs an autograd function per tensor (a
    # third of the training thread's time in staging a copy; nothing here is differentiated).
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def local_region(param: torch.Tensor) -> tuple[torch.Tensor, Index]:
    """The tensor this rank holds of `param` and the region of the global parameter it covers."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    # The same function DCP describes saved shards by: each local shard is one box.
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} is not the region {shape}")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device | str,
    weights: WeightSource,
    buffer_device: torch.device | str | None = None,
) -> None:
    """Allocate this rank's part of every meta parameter of `model` on `device` and fill it
    from `weights`; buffers (computed at construction) move to `buffer_device` (`device` when
    None). Works on a plain module, a pipeline stage, a TP-parallelized and an FSDP-sharded one:
    parameters are addressed by their unsharded names and global regions."""
    buffers = [
        (module, name, buf)
        for module in model.modules()
        for name, buf in module._buffers.items()
        if buf is not None
    ]
    lost = [name for _, name, buf in buffers if buf.is_meta]
    if lost:
        raise ValueError(f"buffer {lost[0]!r} was built on the meta device: its value is lost")
    ties = _tied_parameters(model)
    model.to_empty(device=device)  # FSDP2 re-pads its shards here (`FSDPModule._apply`)
    for module, name, buf in buffers:
        module._buffers[name] = buf.to(buffer_device or device)
    # A meta parameter is replaced per module that holds it, which unties tied weights.
    for module, leaf, (first, first_leaf) in ties:
        module._parameters[leaf] = first._parameters[first_leaf]
    for name, module, param in unique_parameters(model):
        local, index = local_region(param)
        if local.numel():
            local.copy_(weights.read(name, module, tuple(param.shape), index))


def _tied_parameters(model: nn.Module) -> list[tuple[nn.Module, str, tuple[nn.Module, str]]]:
    """(module, name, (module, name) of the parameter's first holder) for every parameter
    that another module holds too."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for leaf, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first:
                ties.append((module, leaf, first[id(param)]))
            else:
                first[id(param)] = (module, leaf)
    return ties


def read_flat(
    weights: WeightSource,
    name: str,
    module: nn.Module,
    shape: tuple[int, ...],
    start: int,
    stop: int,
) -> torch.Tensor:
    """Elements [start, stop) of the flattened parameter (a ZeRO-3 partition): the whole rows
    that cover them are read, then cut."""
    row = math.prod(shape[1:])
    first, last = start // row, -(-stop // row)
    rows = weights.read(
        name, module, shape, (slice(first, last), *(slice(0, n) for n in shape[1:]))
    )
    return rows.reshape(-1)[start - first * row : stop - first * row]


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class RandomWeights:
    """The spec's initialisation drawn block by block (see the module docstring)."""

    def __init__(self, rule: Callable[[str, nn.Module], ParamInit], seed: int):
        self.rule = rule
        self.seed = seed

    def read(
        self, name: str, module: nn.Module, shape: tuple[int, ...], index: Index
    ) -> torch.Tensor:
        if not shape:
            raise ValueError(f"{name}: 0-dimensional parameters are not supported")
        init = self.rule(name, module)
        region = tuple(s.stop - s.start for s in index)
        if init.kind == "ones":
            return torch.ones(region)
        if init.kind == "zeros":
            return torch.zeros(region)
        if init.kind != "normal":
            raise ValueError(f"{name}: unknown initialisation {init.kind!r}")
        out = torch.empty(region)
        first, last = index[0].start, index[0].stop
        per_block = max(1, BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))
        for block in range(first // per_block, -(-last // per_block)):
            lo, hi = block * per_block, min((block + 1) * per_block, shape[0])
            generator = torch.Generator().manual_seed(_block_seed(self.seed, name, block))
            values = torch.empty((hi - lo, *shape[1:])).normal_(0.0, init.std, generator=generator)
            take = slice(max(first, lo) - lo, min(last, hi) - lo)
            out[take.start + lo - first : take.stop + lo - first] = values[(take, *index[1:])]
        for row in init.zero_rows:
            if first <= row < last:
                out[row - first] = 0.0
        return out


def initial_weights(spec, seed: int, init_from: str | None = None) -> WeightSource:
    """Where a run's initial weights come from: `model.init_from` (a Hugging Face Llama
    directory, under our names), the pretrained weights a `model.hf` directory holds, or the
    spec's random initialisation from `seed`."""
    if init_from:
        from raytrain_dt.models.hf_weights import INIT_FROM_KEY, DirectoryWeights, hf_name

        return DirectoryWeights(init_from, INIT_FROM_KEY, rename=hf_name)
    if spec.weights_dir:
        from raytrain_dt.models.hf_weights import DirectoryWeights

        return DirectoryWeights(spec.weights_dir, "model.hf")
    return RandomWeights(spec.init_rule, seed)
