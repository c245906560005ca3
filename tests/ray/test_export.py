"""Export and inspection of a real checkpoint: `ckpt consolidate` output loads in
transformers' LlamaForCausalLM with the same logits as our model; `ckpt ls/inspect` report it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import load_checkpoint_params
from safetensors import safe_open

from raytrain_dt.cli import main
from raytrain_dt.control.coordinator import model_shape, train
from raytrain_dt.models.llama import LlamaDecoder

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, token_data):
    from raytrain_dt.config import load_config

    run_dir = tmp_path_factory.mktemp("export") / "run"
    cfg = load_config("conf/test.yaml", [f"data.path={token_data}", f"run.dir={run_dir}",
                                         "trainer.steps=2", "checkpoint.every_steps=2"])  # fmt: skip
    result = train(cfg, show_progress=False)
    return cfg, result


def _our_model(cfg, checkpoint: str) -> LlamaDecoder:
    model = LlamaDecoder(model_shape(cfg), cfg.data.seq_len)
    model.load_state_dict(load_checkpoint_params(checkpoint))
    return model.eval()


@pytest.mark.parametrize("shard_gb", [5.0, 0.0002], ids=["single-file", "sharded"])
def test_consolidated_model_loads_in_transformers_with_the_same_logits(trained, tmp_path, shard_gb):
    transformers = pytest.importorskip("transformers")
    cfg, result = trained
    out = tmp_path / "hf"
    assert (
        main(
            ["ckpt", "consolidate", result.run_dir, "--out", str(out), "--shard-gb", str(shard_gb)]
        )
        == 0
    )
    files = sorted(p.name for p in out.iterdir())
    if shard_gb < 1:
        assert "model.safetensors.index.json" in files and len(files) > 3
    else:
        assert files == ["config.json", "model.safetensors"]
        with safe_open(out / "model.safetensors", "pt") as f:
            assert "model.layers.0.self_attn.q_proj.weight" in f.keys()  # noqa: SIM118
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ours = _our_model(cfg, result.latest_checkpoint)
    tokens = torch.randint(0, 256, (2, cfg.data.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)


def test_ckpt_ls_and_inspect_report_a_committed_intact_checkpoint(trained, capsys):
    _, result = trained
    assert main(["ckpt", "ls", result.run_dir]) == 0
    listing = capsys.readouterr().out
    assert "step        2" in listing and "committed, intact" in listing
    assert main(["ckpt", "inspect", result.latest_checkpoint]) == 0
    report = capsys.readouterr().out
    assert "step: 2   consumed samples: 16" in report
    assert "state: committed, intact" in report
    record = json.loads(Path(result.latest_checkpoint, "commit.json").read_text())
    assert f"files: {len(record['files'])}" in report


def test_ckpt_on_a_path_without_checkpoints_is_one_line(tmp_path, capsys):
    assert main(["ckpt", "inspect", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nothing'}: does not exist"
    assert main(["ckpt", "ls", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: holds no checkpoint"
