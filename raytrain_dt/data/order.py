"""The deterministic global sample order, and which positions of it each DP rank reads.

The data position of a run is one number, `consumed_samples`. Position p maps to sample
`perm_e[p mod N]` with `e = p // N` and `perm_e` a seeded permutation of the N samples. Step k
consumes positions [k*G, (k+1)*G) for the global batch G, and DP rank r of D reads the r-th
contiguous slice of each step, [floor(r*G/D), floor((r+1)*G/D)). The batch at step k is therefore
the same set of samples, in the same order, whatever D is and however many resizes came before:
that is what makes data exactly-once across elastic resizes.

When D does not divide G the slices differ by one sample, and every rank still reads the same
number of rows per step (its batch slots, so shapes and collectives stay uniform): the rows past
its slice are padding, marked not real, which the engines weight to zero and the ledger skips.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

# How a global batch splits between DP ranks is the layout's arithmetic (the planner prices it).
from raytrain_dt.topology.layout import rank_slice


@lru_cache(maxsize=4)
def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def sample_ids(positions: np.ndarray, num_samples: int, seed: int) -> np.ndarray:
    """Global sample id at each global position."""
    positions = np.asarray(positions, dtype=np.int64)
    epochs, offsets = np.divmod(positions, num_samples)
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        out[mask] = epoch_permutation(num_samples, seed, int(epoch))[offsets[mask]]
    return out


def rank_rows(
    consumed: int, num_steps: int, global_batch: int, dp: int, dp_rank: int, slots: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(positions, real) of the `slots` rows per step (default: ceil(G/dp)) that DP rank
    `dp_rank` reads for `num_steps` steps starting at `consumed`, in order.

    A padding row (real False) repeats the rank's first position of its step: a real sample,
    so shapes and dtypes are those of data, that counts for nothing.
    """
    start, stop = rank_slice(global_batch, dp, dp_rank)
    slots = slots or -(-global_batch // dp)
    if not 0 < stop - start <= slots:
        raise ValueError(
            f"dp rank {dp_rank} of {dp} reads {stop - start} of global batch {global_batch}: "
            f"needs 1 to {slots} (its slots per step)"
        )
    within = np.arange(slots, dtype=np.int64)
    real = within < stop - start
    steps = np.arange(num_steps, dtype=np.int64)[:, None] * global_batch
    positions = consumed + steps + start + np.where(real, within, 0)[None, :]
    return positions.reshape(-1), np.tile(real, num_steps)


def rank_positions(
    consumed: int, num_steps: int, global_batch: int, dp: int, dp_rank: int
) -> np.ndarray:
    """Positions DP rank `dp_rank` reads for `num_steps` steps starting at `consumed`, in order,
    when `dp` divides the global batch (no padding)."""
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
    return rank_rows(consumed, num_steps, global_batch, dp, dp_rank)[0]


def step_of_position(position: int, global_batch: int) -> int:
    return position // global_batch
