"""Ring attention equals full causal SDPA, forward and gradients, on 1, 2 and 4 cp ranks.

Four spawned gloo ranks build the same random (batch, heads, seq, head_dim) q, k, v; each takes
its load-balanced chunks (`chunk_positions`), runs `RingAttention` over a cp group (the whole
world for cp=4, two pairs for cp=2, each rank alone for cp=1), and compares its output rows and its q/k/v gradient rows
with those of `F.scaled_dot_product_attention` over the whole sequence, within 1e-6 absolute plus
1e-5 relative (fp32 sums in another order), for multi-head and grouped-query (fewer K/V heads)
attention, with the query rows in one tile and in several.
"""

from __future__ import annotations

import traceback

import pytest
from harness import join_served_group, rank_process_context, settle_rank_process

WORLD = 4
ATOL, RTOL = 1e-6, 1e-5
# (heads, kv_heads, query rows per tile): multi-head and grouped-query attention, each local
# sequence in one tile and in tiles of 3 rows (which do not divide it).
CASES = ((4, 4, 256), (4, 2, 256), (4, 4, 3), (4, 2, 3))


def _check_rank(rank: int, port: int, queue) -> None:
    settle_rank_process()
    try:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        from raytrain_dt.parallel import context_parallel
        from raytrain_dt.parallel.context_parallel import Ring, chunk_positions

        join_served_group(rank, WORLD, port, timeout_s=60)
        singles = [dist.new_group([r]) for r in range(WORLD)]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        worst = 0.0
        # A ring of one too: blockwise attention over the whole sequence, no transfer.
        for cp, group in ((1, singles[rank]), (2, pairs[rank // 2]), (4, dist.group.WORLD)):
            ring = Ring(group)
            for heads, kv_heads, tile_rows in CASES:
                context_parallel.TILE_ROWS = tile_rows
                gen = torch.Generator().manual_seed(1000 * cp + heads + kv_heads)
                seq = 8 * cp
                q = torch.randn(2, heads, seq, 16, generator=gen, requires_grad=True)
                k = torch.randn(2, kv_heads, seq, 16, generator=gen, requires_grad=True)
                v = torch.randn(2, kv_heads, seq, 16, generator=gen, requires_grad=True)
                grad_out = torch.randn(2, heads, seq, 16, generator=gen)
                full = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=heads != kv_heads
                )
                full.backward(grad_out)
                pos = chunk_positions(seq, cp, ring.rank)
                local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
                out = ring.attend(*local)
                out.backward(grad_out[:, :, pos])
                pairs_to_check = [(out, full[:, :, pos])] + [
                    (mine.grad, whole.grad[:, :, pos])
                    for mine, whole in zip(local, (q, k, v), strict=True)
                ]
                for mine, expected in pairs_to_check:
                    # fp32 rounding of sums in another order: 1e-6 absolute, 1e-5 relative.
                    excess = (mine - expected).abs() / (ATOL + RTOL * expected.abs())
                    worst = max(worst, float(excess.max()))
        dist.destroy_process_group()
        queue.put((rank, worst, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


@pytest.mark.timeout(120)
def test_ring_attention_equals_full_attention():
    from raytrain_dt.worker.rendezvous import serve_store

    ctx = rank_process_context()
    queue = ctx.Queue()
    store = serve_store("127.0.0.1")
    procs = [ctx.Process(target=_check_rank, args=(r, store.port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=100) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    errors = [err for _, _, err in results if err]
    assert not errors, "\n".join(errors)
    worst = max(w for _, w, _ in results)
    assert worst <= 1.0, worst
