"""Everything about reading the target model: its config, tokenizer, weights and aux layer ids.

The target can be ~1T parameters (Kimi-K2.5), so nothing here loads the whole model unless
asked to: `load_target_tensors` reads just the embedding and lm_head out of the safetensors
shards, and `load_target_info` reads only config.json.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.core.errors import ConfigError, DataError

if TYPE_CHECKING:  # torch is imported where tensors are read
    import torch


@dataclass
class TargetInfo:
    model_path: str  # local directory or hub id
    model_type: str
    architectures: list[str]
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]  # resolved, vLLM convention
    tie_word_embeddings: bool = False
    text_config: Any = field(default=None, repr=False)  # the HF config of the language model


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default: the residual stream after 2, N//2 and N-3 decoder layers."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(ids: list[int] | None, num_layers: int) -> list[int]:
    """Validate configured ids (vLLM convention, 0 <= k < N) or return the default."""
    explicit = ids is not None
    ids = list(ids) if explicit else default_aux_layer_ids(num_layers)
    where = "target.aux_layer_ids" if explicit else f"the default aux layer ids (2, N//2, N-3) for N={num_layers}"
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise ConfigError(
            f"{where} = {ids}: ids {bad} are out of range for a target with {num_layers} decoder layers; "
            f"use ids in [0, {num_layers - 1}] (id k = residual stream after k layers)"
        )
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"{where} = {ids} has duplicates, which vLLM collapses; set distinct ids explicitly, "
            f"e.g. --set target.aux_layer_ids=[1,{max(1, num_layers // 2)},{num_layers - 1}]"
        )
    if ids != sorted(ids):
        raise ConfigError(
            f"{where} = {ids} is not ascending; vLLM hands the draft the aux states in layer order, "
            f"so list them ascending: {sorted(ids)}"
        )
    return ids


def _is_local(path: str) -> bool:
    return os.path.isabs(path) or path.startswith(".") or os.path.exists(path)


def _check_model_path(path: str, what: str = "target.model") -> None:
    if not path:
        raise ConfigError(f"{what} is not set; point it at the target model directory or hub id")
    if _is_local(path) and not os.path.isdir(path):
        raise ConfigError(f"{what} = '{path}' does not exist; build or download the model there, or fix the path")


def text_config_of(hf_config: Any) -> Any:
    """Multimodal wrappers (Kimi-K2.5, Qwen-VL) keep the language model's config in text_config."""
    for attr in ("text_config", "language_config", "llm_config"):
        sub = getattr(hf_config, attr, None)
        if sub is not None and getattr(sub, "num_hidden_layers", None):
            return sub
    return hf_config


def load_target_info(target) -> TargetInfo:
    """The target's sizes and aux layer ids, from its config (target: the config's target section)."""
    from transformers import AutoConfig

    path = target.model
    _check_model_path(path)
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=target.trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(
                f"target.model '{path}' needs custom code; set target.trust_remote_code: true if you trust it"
            ) from None
        raise ConfigError(f"cannot read the config of target.model '{path}': {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read the config of target.model '{path}': {e}") from None
    text = text_config_of(hf_config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not getattr(text, k, None)]
    if missing:
        raise ConfigError(
            f"target.model '{path}': its config ({type(hf_config).__name__}) has no {', '.join(missing)} at the top level "
            f"nor in a text_config / language_config / llm_config; point target.model at a causal language model, or at a "
            f"multimodal wrapper that keeps its language model's config in text_config (like Kimi-K2.5)"
        )
    num_layers = int(text.num_hidden_layers)
    return TargetInfo(
        model_path=path,
        model_type=str(getattr(text, "model_type", "")),
        architectures=list(getattr(hf_config, "architectures", None) or []),
        num_layers=num_layers,
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        aux_layer_ids=resolve_aux_layer_ids(target.aux_layer_ids, num_layers),
        tie_word_embeddings=bool(
            getattr(text, "tie_word_embeddings", False) or getattr(hf_config, "tie_word_embeddings", False)
        ),
        text_config=text,
    )


def _resolve_local_dir(path: str) -> Path:
    if os.path.isdir(path):
        return Path(path)
    try:  # a hub id: use the local cache only (training never downloads a 1T model by surprise)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], local_files_only=True))
    except Exception:
        raise ConfigError(
            f"target.model '{path}' is not a local directory and is not in the local HF cache; download it first"
        ) from None


def target_fingerprint(layout, model_path: str) -> str | None:
    """What the target's hidden states depend on, by content: config.json, the safetensors index and every
    *.safetensors file (sha256 each, cached by size and mtime in stages/hashes.json: a multi-GB weight
    file is read once, and again only when it is rewritten). None for a hub id (the cache is immutable)."""
    from common.core.run_folder import content_fingerprint

    model_dir = Path(model_path)
    if not model_dir.is_dir():
        return None
    files = [model_dir / "config.json", model_dir / "model.safetensors.index.json", *sorted(model_dir.glob("*.safetensors"))]
    return content_fingerprint(layout, model_dir, [f for f in files if f.is_file()])


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


def tokenizer_fingerprint(layout, path: str) -> str:
    """What tokenizing with the tokenizer at `path` depends on, by content: its folder's files but the weights
    (tokenizer.json and its config, vocab, merges, a chat template, remote code), hashed once (stages/hashes.json);
    the hub id when it is not a local folder."""
    from common.core.run_folder import input_identity

    folder = Path(path)
    files = [f for f in sorted(folder.iterdir()) if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES)] \
        if folder.is_dir() else None
    return input_identity(layout, path, files)


def _safetensors_key_index(model_dir: Path) -> dict[str, str]:
    """Map tensor name -> shard file name, from model.safetensors.index.json or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DataError(f"no *.safetensors weights in {model_dir}; the target must be stored as safetensors")
    mapping = {}
    for f in files:
        with _open_safetensors(f) as sf:
            for key in sf.keys():
                mapping[key] = f.name
    return mapping


@contextlib.contextmanager
def _open_safetensors(path: Path):
    """safe_open that turns a truncated/corrupt file into a DataError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as sf:
            yield sf
    except (DataError, ConfigError):
        raise
    except Exception as e:  # safetensors raises its own error types
        raise DataError(
            f"cannot read {path} ({str(e).splitlines()[0][:160]}); "
            f"the file is truncated or corrupt: re-download or rebuild it"
        ) from None


def check_safetensors_readable(model_path: str) -> None:
    """Open every *.safetensors of a local model; a truncated or corrupt one raises DataError naming it."""
    if not os.path.isdir(model_path):
        return
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with _open_safetensors(f):
            pass


# Suffixes tried in order; multimodal wrappers prefix "language_model." and similar.
_TENSOR_SUFFIXES = {
    "embed": ["model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight"],
    "lm_head": ["lm_head.weight", "output.weight"],
    "final_norm": ["model.norm.weight"],  # 02's vllm backend applies it to vLLM's pre-norm state id N
}


def _find_tensor_name(keys: list[str], kind: str) -> str | None:
    for suffix in _TENSOR_SUFFIXES[kind]:
        matches = sorted((k for k in keys if k == suffix or k.endswith("." + suffix)), key=len)
        # Skip vision towers etc.: prefer names without "vision"/"visual"/"mm_".
        matches = [k for k in matches if not any(s in k for s in ("vision", "visual", "mm_projector"))] or matches
        if matches:
            return matches[0]
    return None


def load_target_tensors(model_path: str, kinds=("embed", "lm_head")) -> dict:
    """Read only the requested tensors (embedding, lm_head) from the target's safetensors.

    A tied lm_head (no lm_head tensor stored) returns the embedding for both.
    """
    model_dir = _resolve_local_dir(model_path)
    key_to_file = _safetensors_key_index(model_dir)
    keys = list(key_to_file)
    names = {kind: _find_tensor_name(keys, kind) for kind in set(kinds) | {"embed"}}
    if names["embed"] is None:
        raise DataError(f"no embedding tensor (*embed_tokens.weight) found in the safetensors of {model_dir}")
    if "lm_head" in kinds and names.get("lm_head") is None:
        names["lm_head"] = names["embed"]  # tied word embeddings
    out: dict[str, torch.Tensor] = {}
    for kind in kinds:
        name = names[kind]
        if name is None:
            raise DataError(f"no {kind} tensor (*{_TENSOR_SUFFIXES[kind][0]}) found in the safetensors of {model_dir}")
        path = model_dir / key_to_file[name]
        if not path.is_file():
            raise DataError(f"weight shard {path} listed for {name} is missing; re-download the target")
        with _open_safetensors(path) as sf:
            out[kind] = sf.get_tensor(name)
    return out


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1}


def _safetensors_header(path: Path) -> dict:
    import struct

    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def materialized_bytes(model_path: str, dtype: str) -> tuple[int, str]:
    """(bytes, description): what the target's weights take once transformers has loaded them in `dtype`.

    Read from config.json and the safetensors headers only. Quantized checkpoints count as what
    transformers makes of them: compressed-tensors packed int weights (Kimi-K2.5's routed experts are
    int4, `*.weight_packed` int32 [out, in*bits/32]) are decompressed to `dtype`, their scales dropped.
    """
    from math import prod

    if not os.path.isdir(model_path):
        return 0, "unknown (not a local directory)"
    config = json.loads((Path(model_path) / "config.json").read_text()) if (Path(model_path) / "config.json").is_file() else {}
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    bits = 4
    for group in (quant.get("config_groups") or {}).values():
        bits = int(((group or {}).get("weights") or {}).get("num_bits") or bits)
    per_value = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        for name, meta in _safetensors_header(f).items():
            numel = prod(meta["shape"])
            if name.endswith(".weight_packed"):
                total += numel * (32 // bits if meta["dtype"] == "I32" else 8 // bits) * per_value
            elif name.rsplit(".", 1)[-1] in ("weight_scale", "weight_zero_point", "weight_shape", "weight_global_scale"):
                continue  # quantization metadata, gone after decompression
            elif meta["dtype"].startswith(("F", "BF")):
                total += numel * per_value
            else:
                total += numel * _DTYPE_BYTES.get(meta["dtype"], 1)
    how = f"{quant.get('quant_method')} int{bits} weights decompressed to {dtype}" if quant else f"{dtype} weights"
    return total, how


def torch_dtype(name: str):
    import torch

    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float32": torch.float32, "fp32": torch.float32}
    if name not in table:
        raise ConfigError(f"unknown dtype '{name}'; use bfloat16, float16 or float32")
    return table[name]
