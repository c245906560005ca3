"""Initial weights from a Hugging Face-format Llama directory (`ckpt consolidate` output, or a
`save_pretrained` Llama): read its config.json into our model settings, check it against the
configured shape before any actor starts, and copy its safetensors into a freshly built model.

Tensor names are mapped with `checkpoint.export.hf_name`, the one consolidation writes, so a
consolidated checkpoint loads back exactly; it is imported only where weights are loaded (in
the rank actors), which keeps torch.distributed.checkpoint out of the driver. Tensors are
copied one at a time from memory-mapped files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.presets import ModelShape

KEY = "model.init_from"

# Hugging Face config.json field -> our ModelShape field (the inverse of export.hf_config;
# a unit test keeps the two in step). All but the last two are also `model.*` settings.
SHAPE_FIELDS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "vocab_size": "vocab_size",
    "intermediate_size": "ffn_hidden",
    "tie_word_embeddings": "tie_embeddings",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
}
_PRESET_ONLY = ("norm_eps", "rope_theta")


def read_hf_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{KEY}: {path} not found (expected a Hugging Face Llama directory)")
    config = json.loads(path.read_text())
    if config.get("model_type") != "llama":
        raise ConfigError(f"{KEY}: {path} has model_type {config.get('model_type')!r}, not llama")
    if config.get("rope_scaling"):
        raise ConfigError(f"{KEY}: {path} uses rope_scaling, which this Llama model does not do")
    return config


def model_overrides(directory: str | Path) -> list[str]:
    """`model.*` dotlist settings that give our model the directory's shape."""
    config = read_hf_config(directory)
    overrides = [f"model.{ours}={config[theirs]}" for theirs, ours in SHAPE_FIELDS.items()
                 if theirs in config and ours not in _PRESET_ONLY]  # fmt: skip
    return [*overrides, f"{KEY}={directory}"]


def check_matches(directory: str | Path, shape: ModelShape) -> None:
    """ConfigError naming the first field where the directory and the configured model differ."""
    config = read_hf_config(directory)
    for theirs, ours in SHAPE_FIELDS.items():
        value = config.get(theirs, False if theirs == "tie_word_embeddings" else None)
        if value != getattr(shape, ours):
            setting = "model.preset" if ours in _PRESET_ONLY else f"model.{ours}"
            raise ConfigError(
                f"{KEY}: {directory} has {theirs}={value} but the configured model has "
                f"{getattr(shape, ours)} ({setting})"
            )


def _tensor_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"{KEY}: {directory} has no model.safetensors or index")
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


@torch.no_grad()
def load_initial_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy every parameter of the (unsharded) model from the directory's tensors."""
    from raytrain_dt.checkpoint.export import hf_name

    directory = Path(directory)
    files = _tensor_files(directory)
    # named_parameters() yields a tied output weight once, under the embedding's name.
    wanted = {hf_name(name): param for name, param in model.named_parameters()}
    missing = sorted(set(wanted) - set(files))
    if missing:
        raise ConfigError(f"{KEY}: {directory} lacks {len(missing)} tensors, e.g. {missing[0]}")
    for file in sorted(set(files.values())):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in wanted:
                    tensor = f.get_tensor(name)
                    if tensor.shape != wanted[name].shape:
                        raise ConfigError(f"{KEY}: {name} has shape {tuple(tensor.shape)}, "
                                          f"the model {tuple(wanted[name].shape)}")  # fmt: skip
                    wanted[name].copy_(tensor)
