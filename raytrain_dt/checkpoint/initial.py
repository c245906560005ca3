"""Initial weights from a Hugging Face-format directory (`ckpt consolidate` output, or a
`save_pretrained` Llama): read its config.json into our model settings, check it against the
configured shape before any actor starts, and serve the slices of its tensors that each rank's
shards cover (`DirectoryWeights`, a `models.materialize.WeightSource`).

For `model.init_from`, tensor names are mapped with `checkpoint.export.hf_name`, the one
consolidation writes, so a consolidated checkpoint loads back exactly; it is imported only where
weights are loaded (in the rank actors), which keeps torch.distributed.checkpoint out of the
driver. `model.hf` directories hold the Hub's names, which are the model's own.

A rank reads only what it holds: safetensors' `get_slice` reads the bytes of one region, and
`pytorch_model*.bin` files are memory-mapped, so only the pages of its slices are touched.
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
# A directory's weights: (one file, the index of a sharded set), in order of preference.
WEIGHT_FILES = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)


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


def tensor_files(directory: Path, key: str = KEY) -> dict[str, Path]:
    """Tensor name -> the file holding it: safetensors (one file or an index), else
    `pytorch_model*.bin` files."""
    for single, index in WEIGHT_FILES:
        if (directory / index).is_file():
            weight_map = json.loads((directory / index).read_text())["weight_map"]
            return {name: directory / file for name, file in weight_map.items()}
        if (directory / single).is_file():
            return dict.fromkeys(_open(directory / single).keys(), directory / single)
    raise ConfigError(f"{key}: {directory} has no model.safetensors, pytorch_model.bin or index")


def _open(path: Path):
    """A reader of one file: safe_open, or a memory-mapped torch file (a dict of tensors)."""
    if path.suffix == ".safetensors":
        return safe_open(path, "pt")
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


class DirectoryWeights:
    """The region of each tensor that a rank's shard covers, read from the directory's files.
    `rename` maps a parameter name to the file's tensor name (our names to the Hub's)."""

    def __init__(self, directory: str | Path, key: str = KEY, rename=None):
        self.directory = Path(directory)
        self.key = key
        self.rename = rename or (lambda name: name)
        self.files = tensor_files(self.directory, key)
        self._readers: dict[Path, object] = {}

    def read(self, name: str, module, shape: tuple[int, ...], index: tuple[slice, ...]):
        stored = self.rename(name)
        if stored not in self.files:
            raise ConfigError(f"{self.key}: {self.directory} has no tensor {stored}")
        path = self.files[stored]
        if path not in self._readers:
            self._readers[path] = _open(path)
        reader = self._readers[path]
        if path.suffix == ".safetensors":
            tensor = reader.get_slice(stored)
            found = tuple(tensor.get_shape())
        else:
            tensor = reader[stored]
            found = tuple(tensor.shape)
        if found != tuple(shape):
            raise ConfigError(f"{self.key}: {stored} has shape {found}, the model {tuple(shape)}")
        return tensor[index].to(torch.float32)
