"""The deterministic global sample order, and which positions of it each DP rank reads.

The data position of a run is one number, `consumed_samples`. Position p maps to sample
`perm_e[p mod N]` with `e = p // N` and `perm_e` a seeded permutation of the N samples. Step k
consumes positions [k*G, (k+1)*G) for the global batch G, and DP rank r of D reads the r-th
contiguous slice of each step. The batch at step k is therefore the same set of samples, in the
same order, whatever D is and however many resizes came before: that is what makes data
exactly-once across elastic resizes.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


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


def rank_positions(
    consumed: int, num_steps: int, global_batch: int, dp: int, dp_rank: int
) -> np.ndarray:
    """Positions DP rank `dp_rank` reads for `num_steps` steps starting at `consumed`, in order."""
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
    per_rank = global_batch // dp
    steps = np.arange(num_steps, dtype=np.int64)[:, None] * global_batch
    within = np.arange(per_rank, dtype=np.int64)[None, :] + dp_rank * per_rank
    return (consumed + steps + within).reshape(-1)


def step_of_position(position: int, global_batch: int) -> int:
    return position // global_batch
