"""Consolidate a checkpoint into Hugging Face format: `model.safetensors` (sharded with an index
above a size threshold) and `config.json`, streamed tensor by tensor.

The writer (`write_hf`) takes any tensor source: names with shapes and dtypes up front, then
full tensors one at a time in the order asked. The DCP source (`DCPTensors`, FSDP2 runs) reads
each tensor alone from the shards (`dcp.load` of one key, no process group) into one reusable
buffer, so peak memory is about the largest tensor, not the model; DeepSpeed's source lives
with its other file readers (`engines.deepspeed_files`). Names and config.json come from the
model: a preset's parameters are renamed to the Hub's Llama names with a config built from its
shape (`hf_config`), a `model.hf` run's already are the Hub's and its own config is written
back (`hf_run_config`). The safetensors library has no streaming writer, so the (simple,
documented) file layout is written here and read back with `safetensors.safe_open` in the tests.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp

from raytrain_dt.checkpoint.storage import dcp_reader
from raytrain_dt.errors import ConfigError
from raytrain_dt.models.hf_config import load_config
from raytrain_dt.models.hf_weights import hf_name
from raytrain_dt.models.presets import ModelShape

_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class TensorSource(Protocol):
    """A checkpoint's model tensors: every name's (shape, dtype) before any is read, then the
    full tensors of `names`, one at a time in that order (each valid until the next)."""

    tensors: dict[str, tuple[torch.Size, torch.dtype]]

    def stream(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class HFFormat:
    """What the written directory holds besides the weights: config.json's contents, the
    checkpoint's names to the Hub's, and the names not written (a tied output projection:
    transformers ties it to the embedding from the config)."""

    config: dict
    rename: Callable[[str], str]
    skip: frozenset[str] = frozenset()


def preset_format(shape: ModelShape, max_seq_len: int) -> HFFormat:
    """Our decoder (a `model.preset` run) as transformers' LlamaForCausalLM."""
    if shape.is_moe:
        # Its stacked experts have no Llama form (Mixtral's fuses w1 and w3 into one tensor).
        raise ConfigError(
            "model.preset: a mixture-of-experts preset's checkpoint has no Hugging Face Llama "
            "form; train a Mixtral or Qwen-MoE through model.hf to export one"
        )
    skip = frozenset({"output.weight"} if shape.tie_embeddings else ())
    return HFFormat(hf_config(shape, max_seq_len), hf_name, skip)


def hf_run_format(source: str, overrides: dict) -> HFFormat:
    """A `model.hf` run: its parameters already carry the Hub's names (`models.hf`), and its
    config is the one the run built its model from (`model.hf` + `model.hf_config`)."""
    config = hf_run_config(source, overrides)
    skip = frozenset({"lm_head.weight"} if config.get("tie_word_embeddings") else ())
    return HFFormat(config, lambda name: name, skip)


def hf_run_config(source: str, overrides: dict) -> dict:
    """config.json for a `model.hf` run's weights: its transformers config, naming the causal
    LM class (a config built from a model type has none, and from_pretrained needs it) and the
    fp32 the weights are written in."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = load_config(source, overrides).to_dict()
    if not config.get("architectures"):
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    return config


def hf_config(shape: ModelShape, max_seq_len: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_hidden,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "vocab_size": shape.vocab_size,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": max_seq_len,
        "tie_word_embeddings": shape.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def model_tensors(checkpoint_uri: str, reader=None) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Our model parameter names -> (shape, dtype), from DCP metadata alone (read by `reader`
    where given: an in-memory copy's)."""
    metadata = (reader or dcp_reader(checkpoint_uri)).read_metadata()
    return {
        key.removeprefix("model."): (meta.size, meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }


def _nbytes(size: torch.Size, dtype: torch.dtype) -> int:
    return torch.Size(size).numel() * dtype.itemsize


def stream_tensors(checkpoint_uri: str, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors one at a time, each assembled from however many shards hold it.

    Every tensor is read into one buffer sized for the largest, so memory stays at one tensor
    (plus the shard being copied in) and the allocator never fragments: a yielded tensor is
    valid only until the next one is read.
    """
    tensors = model_tensors(checkpoint_uri)
    buffer = torch.empty(max((_nbytes(*tensors[n]) for n in names), default=0), dtype=torch.uint8)
    for name in names:
        size, dtype = tensors[name]
        target = buffer[: _nbytes(size, dtype)].view(dtype).view(size)
        # A one-key state dict: DCP reads only the byte ranges of this tensor's shards.
        dcp.load({f"model.{name}": target}, storage_reader=dcp_reader(checkpoint_uri), no_dist=True)
        yield name, target


class DCPTensors:
    """A DCP (FSDP2) checkpoint as a `TensorSource`."""

    def __init__(self, checkpoint_uri: str):
        self.uri = checkpoint_uri
        self.tensors = model_tensors(checkpoint_uri)

    def stream(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        return stream_tensors(self.uri, names)


def _write_safetensors(
    path: Path,
    entries: list[tuple[str, str, torch.Size, torch.dtype]],
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> None:
    """entries: (our name, output name, shape, dtype) in file order; tensors in the same order."""
    header, offset = {}, 0
    for _, out_name, size, dtype in entries:
        nbytes = _nbytes(size, dtype)
        header[out_name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, _, size, dtype), (got, tensor) in zip(entries, tensors, strict=True):
            # The header is already written: a source that streams something else than it
            # announced would leave a file that reads back as other tensors.
            if got != name or tensor.shape != size or tensor.dtype != dtype:
                raise ValueError(
                    f"{path}: expected {name} {tuple(size)} {dtype}, the checkpoint gave "
                    f"{got} {tuple(tensor.shape)} {tensor.dtype}"
                )
            # The tensor's own bytes, without an intermediate copy.
            f.write(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))


def consolidate(
    checkpoint_uri: str,
    out_dir: str | Path,
    shape: ModelShape,
    max_seq_len: int,
    shard_bytes: int = 5 * 10**9,
) -> list[Path]:
    """A preset run's DCP checkpoint as HF Llama safetensors + config.json; returns the files."""
    return write_hf(
        DCPTensors(checkpoint_uri), out_dir, preset_format(shape, max_seq_len), shard_bytes
    )


def write_hf(
    source: TensorSource, out_dir: str | Path, fmt: HFFormat, shard_bytes: int = 5 * 10**9
) -> list[Path]:
    """Write HF-format safetensors (+ index when sharded) and config.json; returns the files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = source.tensors
    names = [n for n in tensors if n not in fmt.skip]
    shards: list[list[str]] = [[]]
    size_of = {n: _nbytes(*tensors[n]) for n in names}
    for name in names:
        if shards[-1] and sum(size_of[n] for n in shards[-1]) + size_of[name] > shard_bytes:
            shards.append([])
        shards[-1].append(name)
    written = []
    for i, shard in enumerate(shards):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        entries = [(n, fmt.rename(n), tensors[n][0], tensors[n][1]) for n in shard]
        _write_safetensors(out / file, entries, source.stream(shard))
        written.append(out / file)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(size_of.values())},
            "weight_map": {
                fmt.rename(n): f.name for f, shard in zip(written, shards) for n in shard
            },
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        written.append(out / "model.safetensors.index.json")
    (out / "config.json").write_text(json.dumps(fmt.config, indent=2))
    written.append(out / "config.json")
    return written
