"""Ray Data input for one DP rank: positions -> sample ids -> token rows, streamed ahead.

Each DP rank gets its own streaming Ray Data pipeline over exactly the positions it must read
(see `data.order`). Ray Data does the reading in its own tasks and prefetches, so the train
step only pops ready micro-batches. Order is preserved, which the exactly-once guarantee needs.
TP and PP peers of one DP rank build identical pipelines and so see identical batches. Each row
carries `real`: False for a padding row of a layout whose DP degree does not divide the global
batch (see `data.order.rank_rows`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from raytrain_dt.data.order import rank_rows, sample_ids
from raytrain_dt.data.source import TokenDataset


@dataclass(frozen=True)
class DataSlice:
    """What one DP rank reads in one run segment; built by the coordinator, used by workers."""

    dataset: TokenDataset
    shuffle_seed: int
    consumed_samples: int
    num_steps: int
    global_batch: int
    dp: int
    dp_rank: int
    micro_batch: int
    # Rows per step (the layout's micro_batch * grad_accum); 0: global_batch / dp, no padding.
    slots: int = 0

    @property
    def rows_per_step(self) -> int:
        return self.slots or -(-self.global_batch // self.dp)

    @property
    def num_rows(self) -> int:
        return self.num_steps * self.rows_per_step

    def rows(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(global positions, real) of this rank's rows [start, stop) (all rows by default)."""
        steps = -(-(self.num_rows if stop is None else stop) // self.rows_per_step)
        positions, real = rank_rows(
            self.consumed_samples,
            steps,
            self.global_batch,
            self.dp,
            self.dp_rank,
            self.rows_per_step,
        )
        return positions[start:stop], real[start:stop]

    def positions(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Global positions of this rank's rows [start, stop) (all rows by default)."""
        return self.rows(start, stop)[0]


def _fetch(batch: dict[str, np.ndarray], data: DataSlice) -> dict[str, np.ndarray]:
    rows = batch["id"]
    positions, real = data.rows(int(rows[0]), int(rows[-1]) + 1)
    ids = sample_ids(positions, data.dataset.num_samples, data.shuffle_seed)
    return {"position": positions, "sample_id": ids, "tokens": data.dataset.read(ids), "real": real}


def iterate_micro_batches(data: DataSlice, prefetch_batches: int) -> Iterator[dict]:
    """Yield {'position', 'sample_id', 'tokens', 'real'} torch batches of `micro_batch` rows, in
    order."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    if data.num_rows == 0:
        return iter(())
    # Row i of this rank's stream is an arithmetic function of i, so the source is a plain
    # range and no position array is shipped; `_fetch` turns each contiguous run into tokens.
    blocks = max(1, min(64, data.num_rows // 4096))
    ds = ray.data.range(data.num_rows, override_num_blocks=blocks)
    ds = ds.map_batches(
        _fetch,
        fn_kwargs={"data": data},
        batch_size=max(data.micro_batch, 256),
        batch_format="numpy",
        num_cpus=0.25,
    )
    # Ray Data hands over batches of about 256 rows, cut here into micro-batches (views): its
    # per-batch cost (~3 ms on CPU, while the train step holds the GIL) would be a visible share
    # of a short step at one row per micro-batch. Rows per rank are a multiple of micro_batch.
    per_batch = max(1, 256 // data.micro_batch)  # micro-batches per Ray Data batch
    batches = ds.iter_torch_batches(
        batch_size=data.micro_batch * per_batch,
        prefetch_batches=-(-prefetch_batches // per_batch),  # at least as many rows ahead
        drop_last=False,
    )
    return (
        {k: v[start : start + data.micro_batch] for k, v in batch.items()}
        for batch in batches
        for start in range(0, len(batch["tokens"]), data.micro_batch)
    )
