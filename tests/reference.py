"""Single-process references that the distributed runs are checked against.

Plain torch, no process group, no Ray, no accumulation: the whole global batch in one forward,
so it shares no parallel machinery with what it checks. It reads the same samples from the
dataset through the same documented global order.
"""

from __future__ import annotations

import numpy as np
import torch

from raytrain_dt.checkpoint.convert import read_flat_state
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.data.order import sample_ids
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.engines.optim import build_adamw, set_lr
from raytrain_dt.engines.schedule import lr_at
from raytrain_dt.models.llama import next_token_loss
from raytrain_dt.models.spec import model_spec


def global_batch_ids(cfg: TrainConfig, dataset: TokenDataset, step: int) -> np.ndarray:
    g = cfg.trainer.global_batch
    return sample_ids(
        np.arange(step * g, (step + 1) * g), dataset.num_samples, cfg.data.shuffle_seed
    )


def reference_run(cfg: TrainConfig, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of the first `steps` steps and the parameters after them."""
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
        tokens = torch.from_numpy(dataset.read(global_batch_ids(cfg, dataset, step)))
        loss = next_token_loss(model(tokens), tokens)
        loss.backward()
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
