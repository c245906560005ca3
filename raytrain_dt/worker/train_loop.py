"""The train loop: pull micro-batches, take an optimizer step, report, checkpoint on schedule.

Runs in a thread inside a rank actor and knows nothing of Ray or of which engine it drives.
Reports go to a callback (the actor's queue); a stop event ends it at the next step boundary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from raytrain_dt.engines.base import Engine
from raytrain_dt.observe.mfu import mfu
from raytrain_dt.worker.reports import RankReport, StepMetrics, StepReport, StoppedReport


@dataclass(frozen=True)
class LoopSpec:
    start_step: int
    end_step: int  # exclusive
    consumed_samples: int
    global_batch: int
    grad_accum: int
    seq_len: int
    checkpoint_every: int
    # Which reports this rank sends: rank 0 sends metrics; one rank per DP group sends ids.
    report_metrics: bool
    report_sample_ids: bool
    # MFU: the model's training FLOPs per token and the peak FLOP/s of one rank (0: no MFU).
    model_flops_per_token: float = 0.0
    peak_flops_per_rank: float = 0.0
    world_size: int = 1


def run_loop(
    engine: Engine,
    batches: Iterator[dict],
    spec: LoopSpec,
    report: Callable[[RankReport], None],
    save_checkpoint: Callable[[int, int], None],
    stop: threading.Event,
    agree_save_requested: Callable[[], tuple[bool, bool]] = lambda: (False, False),
    chaos: Callable[[int], None] = lambda step: None,
    measure_memory: Callable[[], dict] = dict,
    copy_state: Callable[[int, int], None] = lambda step, consumed: None,
) -> int:
    """Train steps [start_step, end_step); returns the number of steps completed in total.

    Every rank reports each step (a `StepReport`) with its memory (`measure_memory`); rank 0
    adds the metrics. `copy_state(step, consumed)` runs at every step boundary (in-memory
    copies, `worker/peer_copies.py`: it decides which boundaries copy).
    """
    consumed = spec.consumed_samples
    tokens_per_step = spec.global_batch * spec.seq_len
    for step in range(spec.start_step, spec.end_step):
        if stop.is_set():
            return step
        chaos(step + 1)  # fault injection for tests: may exit or hang this rank
        started = time.perf_counter()
        micro = [next(batches) for _ in range(spec.grad_accum)]
        data_wait = time.perf_counter() - started
        # `real` marks padding rows of an uneven layout: they weigh nothing and are not samples.
        result = engine.train_step([m["tokens"] for m in micro], step, [m["real"] for m in micro])
        step_time = time.perf_counter() - started
        consumed += spec.global_batch
        metrics = None
        if spec.report_metrics:
            tokens_per_s = tokens_per_step / step_time
            metrics = StepMetrics(
                loss=result.loss,
                lr=result.lr,
                grad_norm=result.grad_norm,
                step_time_s=step_time,
                data_wait_s=data_wait,
                tokens_per_s=tokens_per_s,
                mfu=step_mfu(spec, tokens_per_s),
                global_batch=spec.global_batch,
                router=None if result.router is None else result.router.as_record(),
            )
        sample_ids = None
        if spec.report_sample_ids:
            sample_ids = [int(i) for m in micro for i in m["sample_id"][m["real"]]]
        report(
            StepReport(
                step=step + 1,
                consumed_samples=consumed,
                finished_at=time.time(),
                **measure_memory(),
                metrics=metrics,
                sample_ids=sample_ids,
            )
        )
        completed = step + 1
        # Collective: every rank gets the same answer at the same boundary.
        requested, stop_now = agree_save_requested()
        copy_state(completed, consumed)
        scheduled = spec.checkpoint_every and (
            completed % spec.checkpoint_every == 0 or completed == spec.end_step
        )
        if scheduled or requested or stop_now:
            save_checkpoint(completed, consumed)
        if stop_now:
            report(StoppedReport(completed))
            return completed
    return spec.end_step


def step_mfu(spec: LoopSpec, tokens_per_s: float) -> float | None:
    """The step's model FLOPs utilization; None where the peak FLOP/s is unknown."""
    if not spec.peak_flops_per_rank:
        return None
    return mfu(spec.model_flops_per_token, tokens_per_s, spec.world_size, spec.peak_flops_per_rank)
