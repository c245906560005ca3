"""Export and inspection of a real checkpoint: `ckpt consolidate` output loads in
transformers' LlamaForCausalLM with the same logits as our model, for every kind of run (FSDP2,
DeepSpeed at each ZeRO stage and pipelined, `model.hf`); `ckpt ls/inspect` report it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference import load_checkpoint_params
from report_checks import check_manifest
from safetensors import safe_open

from raytrain_dt.cli import main
from raytrain_dt.config import load_config
from raytrain_dt.control.coordinator import model_shape, train
from raytrain_dt.engines.schedule import lr_at
from raytrain_dt.errors import CheckpointError
from raytrain_dt.models.llama import LlamaDecoder
from raytrain_dt.parallel.device_mesh import build_mesh

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, token_data):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    cfg = load_config(
        "conf/test.yaml",
        [
            f"data.path={token_data}",
            f"run.dir={run_dir}",
            "trainer.steps=2",
            "checkpoint.every_steps=2",
        ],
    )
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
    assert "step        2" in listing and "committed, files present at recorded sizes" in listing
    assert main(["ckpt", "inspect", "--verify", result.latest_checkpoint]) == 0
    report = capsys.readouterr().out
    assert "step: 2   consumed samples: 16" in report
    assert "state: committed, intact" in report  # every file's SHA-256 as the ranks reported
    record = check_manifest(result.latest_checkpoint)  # the ranks reported every file
    assert f"files: {len(record['files'])}" in report
    # The metadata record holds what the issue lists, and inspect shows it.
    cfg, _ = trained
    state = record["train_state"]
    assert state["tokens"] == 16 * cfg.data.seq_len and f"tokens: {state['tokens']}" in report
    assert state["world_size"] == cfg.cluster.num_ranks == state["layout"]["dims"]["world_size"]
    assert f"engine: fsdp2   world size: {cfg.cluster.num_ranks}" in report
    assert state["model_preset"] == "tiny" and state["model_shape"] == model_shape(cfg).__dict__
    model = LlamaDecoder(model_shape(cfg), cfg.data.seq_len)
    assert state["tensors"] == {k: list(v.shape) for k, v in model.state_dict().items()}
    assert f"model tensors: {len(model.state_dict())}" in report
    assert state["lr_scheduler"]["next_lr"] == pytest.approx(
        lr_at(
            2,
            lr=cfg.trainer.lr,
            warmup_steps=cfg.trainer.warmup_steps,
            total_steps=cfg.trainer.steps,
            min_lr_ratio=cfg.trainer.min_lr_ratio,
        )
    )
    assert "lr scheduler: kind=warmup_cosine" in report
    assert (
        state["versions"]["torch"] == torch.__version__ and f"torch {torch.__version__}" in report
    )
    rng_files = sorted(p.name for p in Path(result.latest_checkpoint, "rng").iterdir())
    assert rng_files == [f"rank_{r}.pt" for r in range(cfg.cluster.num_ranks)]
    assert f"rng states: {cfg.cluster.num_ranks} ranks" in report


def test_ckpt_on_a_path_without_checkpoints_is_one_line(tmp_path, capsys):
    assert main(["ckpt", "inspect", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nothing'}: does not exist"
    assert main(["ckpt", "ls", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: holds no checkpoint"


def test_bad_checkpoint_paths_are_one_line_and_create_nothing(tmp_path, capsys):
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    for path, why in ((missing, "does not exist"), (empty, "holds no checkpoint")):
        out, dst = tmp_path / f"hf_{path.name}", tmp_path / f"dst_{path.name}"
        for argv in (
            ["ckpt", "consolidate", str(path), "--out", str(out)],
            ["ckpt", "convert", str(path), str(dst), "--to", "deepspeed"],
        ):
            assert main(argv) == 2
            assert capsys.readouterr().err.strip() == f"error: {path}: {why}"
        assert not out.exists() and not dst.exists()


def _shapes(cfg, *overrides: str) -> dict[str, tuple]:
    shape = model_shape(load_config("conf/test.yaml", [f"data.path={cfg.data.path}", *overrides]))
    with torch.device("meta"):
        return {
            k: tuple(v.shape) for k, v in LlamaDecoder(shape, cfg.data.seq_len).state_dict().items()
        }


def _differing(cfg, other: str) -> dict[str, tuple]:
    """name -> (checkpoint shape, model shape) of every tensor the `other` model has another
    shape of."""
    saved, ours = _shapes(cfg), _shapes(cfg, other)
    return {name: (saved[name], ours[name]) for name in ours if ours[name] != saved[name]}


def test_resuming_into_another_model_shape_is_one_error_before_anything_starts(trained, capsys):
    cfg, result = trained
    run_dir = Path(result.run_dir)
    before = {p: p.read_bytes() for p in (run_dir / "events.jsonl", run_dir / "config.yaml")}
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    argv = [
        "train",
        "conf/test.yaml",
        f"data.path={cfg.data.path}",
        f"run.dir={run_dir}",
        "model.ffn_hidden=128",
    ]
    assert main(argv) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    differing = _differing(cfg, "model.ffn_hidden=128")
    assert len(differing) == 3 * 4  # w1, w2, w3 of each of the tiny model's 4 layers
    assert f"{len(differing)} tensors differ" in error
    for name, (saved, ours) in differing.items():
        assert f"{name} checkpoint {saved} vs model {ours}" in error
    assert "attention" not in error
    # Nothing started: no event, no new config, no new checkpoint.
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == steps


def test_engine_load_checks_every_shape_against_dcp_metadata_before_reading(trained):
    from raytrain_dt.accel.device import select_device
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.fsdp2 import FSDP2Engine
    from raytrain_dt.models.model_spec import llama_spec
    from raytrain_dt.tools.checkpoint_convert import single_process_group
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims

    cfg, result = trained
    other = load_config("conf/test.yaml", [f"data.path={cfg.data.path}", "model.n_kv_heads=4"])
    with single_process_group():
        layout = Layout(ParallelDims(world_size=1, dp_shard=1), 3, 1, 1)
        device = select_device("fp32")
        spec = llama_spec(model_shape(other))
        engine = FSDP2Engine(
            EngineBuild(spec, other, layout, build_mesh(layout.dims, "cpu"), device)
        )
        untouched = {k: v.full_tensor().clone() for k, v in engine.model.state_dict().items()}
        with pytest.raises(CheckpointError) as raised:
            engine.load(result.latest_checkpoint)
        for k, v in engine.model.state_dict().items():
            assert torch.equal(v.full_tensor(), untouched[k])
    differing = _differing(cfg, "model.n_kv_heads=4")
    assert len(differing) == 2 * 4  # wk and wv of each layer
    assert f"{len(differing)} tensors differ" in str(raised.value)
    for name, (saved, ours) in differing.items():
        assert f"{name} checkpoint {saved} vs model {ours}" in str(raised.value)


# --- every kind of run ---------------------------------------------------------------------------
# A `model.hf` run's config: a Llama from its model type, as small as the tiny preset.
HF_RUN = ["model.hf=llama"] + [
    f"model.hf_config.{k}={v}"
    for k, v in {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
    }.items()
]
DEEPSPEED = ("engine.name=deepspeed",)
KINDS = {
    "deepspeed-zero0": (*DEEPSPEED, "engine.zero_stage=0"),
    "deepspeed-zero1": (*DEEPSPEED, "engine.zero_stage=1"),
    "deepspeed-zero2": (*DEEPSPEED, "engine.zero_stage=2"),
    "deepspeed-zero3": (*DEEPSPEED, "engine.zero_stage=3"),
    "deepspeed-pipeline": (*DEEPSPEED, "parallel.pp=2", "trainer.grad_accum=2"),
    "model-hf": tuple(HF_RUN),
}


@pytest.fixture(scope="module", params=["fsdp2", *KINDS])
def run_of_kind(request, tmp_path_factory, token_data):
    """(kind, config, the committed step) of a 2-step, 2-rank run of each kind; the FSDP2 one is
    `trained`'s."""
    if request.param == "fsdp2":
        cfg, result = request.getfixturevalue("trained")
        return request.param, cfg, result.latest_checkpoint
    cfg = load_config(
        "conf/test.yaml",
        [
            f"data.path={token_data}",
            f"run.dir={tmp_path_factory.mktemp(request.param)}",
            "trainer.steps=2",
            "checkpoint.every_steps=2",
            *KINDS[request.param],
        ],
    )
    return request.param, cfg, train(cfg, show_progress=False).latest_checkpoint


def _engine_weights(cfg, checkpoint: str) -> dict[str, torch.Tensor]:
    """The weights as the run's engine holds them after loading the checkpoint: FSDP2's DCP
    state gathered, or `full_state_dict` of a 1-rank DeepSpeedEngine that loaded it (with
    DeepSpeed's own loader, resharding through its universal format)."""
    if cfg.engine.name == "fsdp2":
        return load_checkpoint_params(checkpoint)
    from raytrain_dt.checkpoint.store import CheckpointStore
    from raytrain_dt.tools.checkpoint_convert import (
        _deepspeed_engine,
        one_rank_layout,
        single_process_group,
    )

    (ref,) = CheckpointStore(str(Path(checkpoint).parent)).list()
    saved = ref.train_state["layout"]
    with single_process_group():
        layout = one_rank_layout(saved, saved["zero_stage"])
        engine = _deepspeed_engine(model_shape(cfg), cfg, layout)
        engine.load(checkpoint)
        return engine.full_state_dict()


def test_every_kind_of_run_consolidates_to_the_engines_logits(run_of_kind, tmp_path):
    transformers = pytest.importorskip("transformers")
    from raytrain_dt.models.model_spec import model_spec

    kind, cfg, checkpoint = run_of_kind
    out = tmp_path / "hf"
    assert main(["ckpt", "consolidate", checkpoint, "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = model_spec(cfg).build(cfg.data.seq_len, seed=0)
    ours.load_state_dict(_engine_weights(cfg, checkpoint))
    tokens = torch.randint(
        0, 256, (2, cfg.data.seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours.eval()(tokens), atol=1e-5, rtol=1e-5)
    if kind == "model-hf":  # the run's own config, not one rebuilt from a preset
        assert hf.config.num_hidden_layers == 2 and type(hf).__name__ == "LlamaForCausalLM"


def test_an_uncommitted_step_is_one_line(tmp_path, capsys):
    step = tmp_path / "checkpoints" / "step_7"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    out = tmp_path / "hf"
    assert main(["ckpt", "consolidate", str(step), "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"error: {step}: not committed (no commit.json)"
    assert not out.exists()
