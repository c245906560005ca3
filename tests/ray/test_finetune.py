"""Fine-tuning from a consolidated checkpoint with jobs/finetune.py: the shape comes from the
directory's config.json, and the first step's loss is the original model's loss on that batch
(the weights arrived exactly); a contradicting shape stops before any actor starts."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from reference import global_batch_ids, load_checkpoint_params

from raytrain_dt.cli import main
from raytrain_dt.config import load_config
from raytrain_dt.control.coordinator import model_shape, train
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.models.llama import LlamaDecoder, build_model, next_token_loss
from raytrain_dt.observe.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_cluster")

# Not the recipe's shape, so the test sees that finetune takes the shape from config.json.
SOURCE_SHAPE = ["model.n_layers=2", "model.tie_embeddings=true"]


def _finetune_main():
    spec = importlib.util.spec_from_file_location("finetune_job", "jobs/finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory, token_data):
    root = tmp_path_factory.mktemp("finetune")
    cfg = load_config(
        "conf/test.yaml",
        [
            f"data.path={token_data}",
            f"run.dir={root / 'src'}",
            "trainer.steps=2",
            "trainer.warmup_steps=1",
            "checkpoint.every_steps=2",
            *SOURCE_SHAPE,
        ],
    )
    result = train(cfg, show_progress=False)
    assert main(["ckpt", "consolidate", result.run_dir, "--out", str(root / "hf")]) == 0
    return cfg, result.latest_checkpoint, root / "hf"


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return next_token_loss(model(tokens), tokens).item()


def test_finetune_starts_from_the_consolidated_weights(consolidated, token_data, tmp_path):
    source_cfg, checkpoint, hf_dir = consolidated
    run_dir = tmp_path / "ft"
    argv = [
        str(hf_dir),
        "conf/test.yaml",
        f"data.path={token_data}",
        f"run.dir={run_dir}",
        "trainer.steps=1",
        "trainer.warmup_steps=0",
    ]
    assert _finetune_main()(argv) == 0

    ft_cfg = load_config(run_dir / "config.yaml")
    assert model_shape(ft_cfg) == model_shape(source_cfg)  # from config.json, not the recipe
    dataset = TokenDataset.open(token_data, ft_cfg.data.seq_len)
    tokens = torch.from_numpy(dataset.read(global_batch_ids(ft_cfg, dataset, 0)))
    original = LlamaDecoder(model_shape(source_cfg), source_cfg.data.seq_len)
    original.load_state_dict(load_checkpoint_params(checkpoint))
    expected = _loss(original.eval(), tokens)
    first_step = read_jsonl(run_dir / "metrics.jsonl")[0]
    assert first_step["step"] == 1
    assert first_step["loss"] == pytest.approx(expected, abs=1e-5)
    # The control: a model that did not get those weights has a clearly different loss.
    fresh = build_model(model_shape(ft_cfg), ft_cfg.data.seq_len, ft_cfg.run.seed)
    assert abs(_loss(fresh, tokens) - expected) > 1e-2


def test_a_contradicting_shape_is_one_line_before_anything_starts(
    consolidated, token_data, tmp_path, capsys
):
    _, _, hf_dir = consolidated
    argv = [
        str(hf_dir),
        "conf/test.yaml",
        f"data.path={token_data}",
        f"run.dir={tmp_path / 'x'}",
        "model.n_layers=3",
    ]
    assert _finetune_main()(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: model.init_from: {hf_dir} has num_hidden_layers=2 but the configured "
        "model has 3 (model.n_layers)"
    )
    assert not (tmp_path / "x").exists()
