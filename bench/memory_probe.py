"""Instrumentation for the memory benchmark: hooks on the real engines (FSDP2 and DeepSpeed)
that count the bytes of LOCAL shards a rank holds at the optimizer step and, for FSDP2, at its
peaks in forward and backward (`bench_memory.py` compares them with the planner's model).
"""

from __future__ import annotations


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _fsdp_groups(model):
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield group


def _fsdp_params(model):
    for group in _fsdp_groups(model):
        yield from group.fsdp_params


def _accumulating_grad_bytes(model) -> int:
    """Gradient bytes held between micro-batches: sharded `.grad`s plus FSDP2's unsharded ones.

    As for parameters, an unsharded parameter may stand in the module for its shard, so the
    FSDP params are asked for both and `model.parameters()` only for the others.
    """
    fsdp_params = list(_fsdp_params(model))
    managed = {id(fp.sharded_param) for fp in fsdp_params}
    managed |= {id(fp._unsharded_param) for fp in fsdp_params if hasattr(fp, "_unsharded_param")}
    total = sum(
        _nbytes(p.grad) for p in model.parameters() if p.grad is not None and id(p) not in managed
    )
    for fp in fsdp_params:
        if fp.sharded_param.grad is not None:
            total += _nbytes(fp.sharded_param.grad)
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and unsharded.grad is not None:
            total += _nbytes(unsharded.grad)
        if getattr(fp, "unsharded_accumulated_grad", None) is not None:
            total += _nbytes(fp.unsharded_accumulated_grad)
    return total


def _held_param_bytes(model) -> int:
    """Parameter bytes held now: every local shard plus every all-gathered (unsharded) copy.

    While unsharded, FSDP2 registers the unsharded tensor on the module in place of the shard,
    so the shards are counted through the FSDP params, not `model.parameters()`.
    """
    fsdp_params = list(_fsdp_params(model))
    managed = {id(fp.sharded_param) for fp in fsdp_params}
    managed |= {id(fp._unsharded_param) for fp in fsdp_params if hasattr(fp, "_unsharded_param")}
    total = sum(_nbytes(p) for p in model.parameters() if id(p) not in managed)
    for fp in fsdp_params:
        total += _nbytes(fp.sharded_param)
        if fp.sharded_state.name == "UNSHARDED":
            total += _nbytes(fp._unsharded_param)
    # A prefetched block's all-gather has landed but is not unsharded (waited on) yet.
    for group in _fsdp_groups(model):
        pending = getattr(group, "_all_gather_result", None)
        if pending is not None and not group.is_unsharded:
            total += _nbytes(pending.all_gather_output)
    return total


def _noting(note, method):
    def noted(*args, **kwargs):
        note()
        return method(*args, **kwargs)

    return noted


def _watch_gradient_sync(owner, model, out: dict) -> None:
    sync = owner.set_requires_gradient_sync
    calls = []

    def sync_hook(flag, *args, **kwargs):
        if calls:
            held = _accumulating_grad_bytes(model())
            out["accum_grads"] = max(out["accum_grads"] or 0, held)
        calls.append(flag)
        return sync(flag, *args, **kwargs)

    owner.set_requires_gradient_sync = sync_hook


def instrument_fsdp2(engine, out: dict) -> None:
    """Counts held parameters around every block's forward and backward, gradients between
    micro-steps, and all three states right after the optimizer step."""
    import torch

    def note_params(*_):
        out["fwd_params"] = max(out["fwd_params"] or 0, _held_param_bytes(engine.model))

    def after_forward(module, inputs, output):
        note_params()

    def note_backward():
        # Before a block's reduce-scatter its own and the prefetched block are unsharded, and
        # so is its gradient.
        note_params()
        held = _accumulating_grad_bytes(engine.model)
        out["accum_grads"] = max(out["accum_grads"] or 0, held)

    for group in _fsdp_groups(engine.model):
        group.post_backward = _noting(note_backward, group.post_backward)

    hooked = list(engine.model.layers.values())
    if engine.pipeline is None:
        hooked.append(engine.model)
    for module in hooked:
        module.register_forward_hook(after_forward)

    # Every call after a micro-step's backward sees that micro-step's unsynced gradients
    # (the schedule itself switches sync off per stage under pipeline parallelism).
    owners = (
        [engine.model]
        if engine.pipeline is None
        else [stage.submod for stage in engine.pipeline.stages]
    )
    for owner in owners:
        _watch_gradient_sync(owner, lambda: engine.model, out)

    zero_grad = engine.optimizer.zero_grad

    def measure_then_zero(*args, **kwargs):
        params = list(engine.model.parameters())
        out["params"] = sum(_nbytes(p) for p in params)
        out["grads"] = sum(_nbytes(p.grad) for p in params if p.grad is not None)
        out["optim"] = sum(
            _nbytes(v)
            for state in engine.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        out["local_numel"] = sum(_local(p).numel() for p in params)
        return zero_grad(*args, **kwargs)

    engine.optimizer.zero_grad = measure_then_zero


def instrument_deepspeed(engine, out: dict) -> None:
    """Counts every tensor storage DeepSpeed holds at its inner optimizer steps (one per param
    group; the max is kept) and after the first micro-step's backward (under a pipeline: before
    the accumulated gradients are reduced).

    Parameters are the module's (ZeRO-3: each rank's `ds_tensor` partition); the optimizer is
    the inner optimizer's state plus the fp32 master partitions (ZeRO keeps them in
    `single_partition_of_fp32_groups` or `fp32_partitioned_groups_flat`); gradients are every
    other tensor the ZeRO optimizer holds in its attributes (partitions, accumulators).
    """
    import torch

    ds = engine.engine
    zero_optimizer = ds.optimizer
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)

    def count() -> dict:
        seen: set[int] = set()

        def take(tensors) -> int:
            total = 0
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.numel() == 0:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        module_params = list(ds.module.parameters())
        masters = [p for group in inner.param_groups for p in group["params"]]
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            masters += list(getattr(zero_optimizer, name, []))
        state = [v for s in inner.state.values() for v in s.values()]
        return {
            "params": take(getattr(p, "ds_tensor", p) for p in module_params),
            "optim": take(state + masters),
            "grads": take(
                [p.grad for p in module_params + masters] + list(_tensors_in(vars(zero_optimizer)))
            ),
        }

    step = inner.step

    def measure_after_step(*args, **kwargs):
        result = step(*args, **kwargs)
        for key, value in count().items():
            out[key] = max(out.get(key, 0), value)
        return result

    inner.step = measure_after_step
    backward = ds.backward

    def measure_after_backward(*args, **kwargs):
        result = backward(*args, **kwargs)
        if not ds.is_gradient_accumulation_boundary():
            out["accum_grads"] = max(out["accum_grads"] or 0, count()["grads"])
        return result

    ds.backward = measure_after_backward
    if getattr(engine, "pipeline", None) is not None:
        # The schedule runs backward outside DeepSpeed; what it accumulated is held until
        # ZeRO-1 reduces it into the partitions.
        reduce = zero_optimizer.reduce_gradients

        def measure_before_reduce(*args, **kwargs):
            out["accum_grads"] = max(out["accum_grads"] or 0, count()["grads"])
            return reduce(*args, **kwargs)

        zero_optimizer.reduce_gradients = measure_before_reduce


def _tensors_in(value, depth: int = 0):
    """Tensors reachable through dicts, lists and tuples (not through other objects)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item, depth + 1)
