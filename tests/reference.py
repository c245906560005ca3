"""Single-process references that the distributed runs are checked against.

Plain torch, no process group, no Ray, no accumulation: the whole global batch in one forward,
so it shares no parallel machinery with what it checks. It reads the same samples from the
dataset through the same documented global order.
"""

from __future__ import annotations

import numpy as np
import torch

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.data.order import sample_ids
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.engines.optim import build_adamw, set_lr
from raytrain_dt.engines.schedule import lr_at
from raytrain_dt.models.llama import next_token_loss
from raytrain_dt.models.model_spec import model_spec
from raytrain_dt.models.moe import take_router_stats
from raytrain_dt.tools.checkpoint_convert import read_flat_state


def global_batch_ids(
    cfg: TrainConfig, dataset: TokenDataset, step: int, batches: list[int] | None = None
) -> np.ndarray:
    """The samples of step `step` (0-based): the next `batches[step]` positions of the global
    order (default: trainer.global_batch every step)."""
    sizes = batches or [cfg.trainer.global_batch] * (step + 1)
    start = sum(sizes[:step])
    return sample_ids(
        np.arange(start, start + sizes[step]), dataset.num_samples, cfg.data.shuffle_seed
    )


def reference_run(
    cfg: TrainConfig,
    steps: int,
    batches: list[int] | None = None,
    router_stats: list | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of the first `steps` steps and the parameters after them; `batches`: each
    step's real global batch (a run under trainer.batch_tolerance), the loss a mean over it.
    `router_stats` (a mixture-of-experts model): each step's routed assignments per expert
    and dropped ones, as a list [per expert..., dropped], is appended to it."""
    dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
    model = model_spec(cfg).build(cfg.data.seq_len, cfg.run.seed)
    optimizer = build_adamw(model, cfg.trainer)
    t = cfg.trainer
    losses = []
    for step in range(steps):
        set_lr(
            optimizer,
            lr_at(
                step,
                lr=t.lr,
                warmup_steps=t.warmup_steps,
                total_steps=t.steps,
                min_lr_ratio=t.min_lr_ratio,
            ),
        )
        tokens = torch.from_numpy(dataset.read(global_batch_ids(cfg, dataset, step, batches)))
        loss = next_token_loss(model(tokens), tokens)
        loss.backward()
        counts = take_router_stats(model, torch.device("cpu"))
        if router_stats is not None and counts is not None:
            router_stats.append(counts.tolist())
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_checkpoint_params(path: str) -> dict[str, torch.Tensor]:
    """The model parameters of a DCP checkpoint, gathered in this single process."""
    return {
        k.removeprefix("model."): v
        for k, v in read_flat_state(path).items()
        if k.startswith("model.")
    }


def check_run_matches_reference(
    cfg: TrainConfig, result, steps: int, atol: float = 1e-4, batches: list[int] | None = None
) -> list[dict]:
    """A finished run (`RunResult`) against the single-process run: every step's loss and the
    final checkpoint's weights within `atol`, and every step's samples exactly those of the
    global order (none lost, none twice). `batches`: each step's real global batch, for a run
    under trainer.batch_tolerance. Returns the run's metrics rows."""
    import pytest

    from raytrain_dt.observe.metrics import read_jsonl

    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    ref_losses, ref_params = reference_run(cfg, steps, batches)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=atol)
    params = load_checkpoint_params(result.latest_checkpoint)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, atol=atol, rtol=0)
    dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
    ledger = read_jsonl(f"{result.run_dir}/ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    for record in ledger:
        expected = global_batch_ids(cfg, dataset, record["step"] - 1, batches)
        assert record["sample_ids"] == expected.tolist()
    return metrics
