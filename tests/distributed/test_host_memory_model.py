"""The host memory model against what the FSDP2 engine really holds and writes: an async
save's staging buffers are the rank's share of the checkpoint that `rank_checkpoint_bytes`
prices (sharded or replicated), and a checkpoint's tensors are the model's `checkpoint_bytes`.
"""

from __future__ import annotations

import math

import pytest
from matrix import cfg, pool
from test_engine_matrix import LAYOUTS

from raytrain_dt.control.run_setup import model_shape
from raytrain_dt.topology.host_memory import checkpoint_bytes, rank_checkpoint_bytes


def _tensor_bytes(checkpoint_dir: str) -> int:
    """The bytes of every tensor DCP's metadata records (its files add a per-tensor framing:
    about 5 kB per tensor, 30% of this tiny model's files, noise for a real one's)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata.values()
    return sum(
        math.prod(m.size) * m.properties.dtype.itemsize
        for m in entries
        if isinstance(m, TensorStorageMetadata)
    )


@pytest.mark.parametrize("name", ["ddp", "fsdp2-full"])
def test_async_save_stages_the_share_the_model_prices(pool, cfg, tmp_path, name):
    layout = LAYOUTS[name]
    result = pool.run(cfg, layout, 2, async_save_dir=str(tmp_path / "ckpt"), async_save_after=1)
    shape = model_shape(cfg)
    share = rank_checkpoint_bytes(shape, layout, engine="fsdp2", precision="fp32")
    # Optimizer step counters (one scalar per parameter tensor) are all the model leaves out.
    assert result.staged_bytes == pytest.approx(share, rel=1e-3)
    whole = checkpoint_bytes(shape, engine="fsdp2", precision="fp32")
    assert _tensor_bytes(str(tmp_path / "ckpt")) == pytest.approx(whole, rel=1e-3)
    assert share == (whole if name == "ddp" else whole / 2)
