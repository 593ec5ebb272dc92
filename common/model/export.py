"""Export the draft in the checkpoint formats vLLM loads (docs/design.md#vllm-checkpoint-format), and read
either format back. Every draft architecture goes through its family (common/model/draft/registry.py): the
config.json `architectures` name, the config class, the model class and the tensor names of each format.

Official EAGLE-3 format (`export_vllm_draft`: what vLLM's model class of the family's architecture reads):
    config.json        the config's to_vllm_config(): architectures [the family's], draft_vocab_size,
                       target_hidden_size, eagle_aux_hidden_state_layer_ids, the EAGLE-3.1 flags the family
                       reads (fc_norm, norm_output; the Llama draft's norm_before_fc), ...
    model.safetensors  the model's state dict under the family's official names (docs/design.md#vllm-checkpoint-format),
                       with the names every family shares (common.model.draft.contract): lm_head.weight [V_d, H],
                       d2t int64 [V_d] (target id = i + d2t[i]), t2d bool [V];
                       no embed_tokens (vLLM shares the target's) unless include_embedding.
                       A full-vocabulary draft (draft_vocab_size = target vocab, as the published
                       Kimi-K2.5 draft) has no d2t/t2d: vLLM then builds no draft_id_to_target_id but
                       would still route a `d2t` tensor to it and fail to load.
speculators format (`export_speculators_draft`): the same tensors under the family's speculators names
(the family's adapter renames them), embed_tokens included, and the speculators config.json, with
norm_before_residual written explicitly (vLLM assumes True when it is missing), and the EAGLE-3.1 flags.

Both writers build the directory under a temporary name next to `out_dir` and rename it into
place, so `out_dir` is either the previous complete export or the new complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from common.model.draft import (EMBEDDING_PREFIX, NORM_FLAGS, VOCAB_MAP_TENSORS, DraftConfigContract, DraftFamily,
                                DraftModelContract, family_of, family_of_config, family_of_model)
from common.core.errors import ConfigError, DataError
from common.core.io import fsync_dir

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"  # the files of an exported draft
D2T, T2D = VOCAB_MAP_TENSORS


def has_vocab_map(config: DraftConfigContract) -> bool:
    """Whether the export carries d2t/t2d: not for a full-vocabulary draft (see the module docstring)."""
    return config.draft_vocab_size != config.vocab_size


def _draft_state_dict(model: DraftModelContract, dtype: torch.dtype, include_embedding: bool) -> dict:
    """The tensors to export, under our names (the family's adapter renames them per format)."""
    out = {}
    full_vocab = not has_vocab_map(model.config)
    if full_vocab and bool(model.d2t.any()):
        raise DataError("the draft vocab is the whole target vocab but d2t reorders it, which vLLM cannot load "
                        "(it takes draft id i as target id i); rebuild the vocab map with 03_build_vocab_map.py")
    for name, tensor in model.state_dict().items():
        if name.startswith(EMBEDDING_PREFIX) and not include_embedding:
            continue
        if full_vocab and name in VOCAB_MAP_TENSORS:
            continue
        if name == D2T:
            tensor = tensor.to(torch.int64)
        elif name == T2D:
            tensor = tensor.to(torch.bool)
        elif tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.detach().to("cpu").contiguous().clone()
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_dir_atomically(out_dir: Path, files: dict) -> Path:
    """files: name -> callable(path) that writes it. Renames the finished temp dir to out_dir."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, write in files.items():
            write(tmp / name)
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        old = None
        if out_dir.exists():
            old = out_dir.parent / f".old-{out_dir.name}.{os.getpid()}"
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _json_writer(obj):
    return lambda path: path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _safetensors_writer(tensors: dict, metadata: dict | None = None):
    from safetensors.torch import save_file

    return lambda path: save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})


def export_vllm_draft(model: DraftModelContract, out_dir, dtype: torch.dtype = torch.bfloat16,
                      extra_config: dict | None = None, include_embedding: bool = False) -> Path:
    """Write the draft in the official EAGLE-3 format; returns out_dir."""
    model = getattr(model, "module", model)
    family = family_of_model(model)
    config = family.vllm_config(model.config, torch_dtype=_dtype_name(dtype), **(extra_config or {}))
    tensors = {family.adapter.to_official(k): v for k, v in _draft_state_dict(model, dtype, include_embedding).items()}
    return _write_dir_atomically(Path(out_dir), {
        CONFIG_NAME: _json_writer(config),
        WEIGHTS_NAME: _safetensors_writer(tensors),
    })


def export_speculators_draft(model: DraftModelContract, out_dir, verifier_name_or_path: str,
                             speculative_tokens: int, dtype: torch.dtype = torch.bfloat16,
                             include_embedding: bool = True, verifier_architectures: list[str] | None = None,
                             speculators_version: str = "0.3.0") -> Path:
    """Write the draft in the speculators format; vLLM can serve the directory alone."""
    model = getattr(model, "module", model)
    family = family_of_model(model)
    if family.adapter.speculators_architecture is None:
        raise ConfigError(f"the {family.architecture} draft has no speculators format; export it with export_vllm_draft "
                          f"(the official format)")
    c = model.config
    official = family.vllm_config(c, torch_dtype=_dtype_name(dtype))
    layer_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                  "rope_theta", "rope_scaling", "initializer_range", "attention_bias", "mlp_bias",
                  "tie_word_embeddings", "torch_dtype")
    transformer_layer_config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                **{k: official[k] for k in layer_keys}}
    config = {
        "speculators_model_type": "eagle3",
        "architectures": [family.adapter.speculators_architecture],
        "speculators_version": speculators_version,
        "transformer_layer_config": transformer_layer_config,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        **{flag: official.get(flag, False) for flag in NORM_FLAGS},  # EAGLE-3.1's (vLLM's speculators/algos.py)
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_name_or_path),
                         "architectures": list(verifier_architectures or ["LlamaForCausalLM"])},
        },
        "torch_dtype": _dtype_name(dtype),
    }
    tensors = {family.adapter.to_speculators(k): v for k, v in _draft_state_dict(model, dtype, include_embedding).items()}
    return _write_dir_atomically(Path(out_dir), {
        CONFIG_NAME: _json_writer(config),
        WEIGHTS_NAME: _safetensors_writer(tensors),
    })


REDO_EXPORT = "re-export the draft (rerun 04_train.py) or restore the file"


def _read_config_json(path) -> tuple[dict, Path]:
    """The exported draft's config.json as a dict, and its path; a missing, truncated or edited file is one DataError
    naming it, before vLLM or the loader sees it."""
    from common.core.io import parse_json

    config_path = Path(path) / CONFIG_NAME
    try:
        raw = parse_json(config_path.read_bytes())
    except FileNotFoundError:
        raise DataError(f"{config_path} is missing; '{path}' is not an exported EAGLE-3 draft ({REDO_EXPORT})") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{config_path} is not a readable JSON file ({' '.join(str(e).split())}); {REDO_EXPORT}") from None
    if not isinstance(raw, dict):
        raise DataError(f"{config_path} holds a JSON {type(raw).__name__}, not a draft config object; {REDO_EXPORT}")
    return raw, config_path


def read_draft_config(path) -> DraftConfigContract:
    """The config.json of the exported draft in `path` as its family's config object (the family: family_of_config),
    checked: JSON, an architecture a family knows (else one ConfigError line), the keys the family's config needs and
    their values. A truncated or edited file is one DataError naming it."""
    raw, config_path = _read_config_json(path)
    family = family_of(raw.get("architectures"), where=str(config_path))
    try:
        return family.read_config(raw)
    except KeyError as e:
        raise DataError(f"{config_path} has no {e.args[0]!r}, which an EAGLE-3 draft config needs; {REDO_EXPORT}") from None
    except (TypeError, ValueError, AttributeError, ConfigError) as e:
        raise DataError(f"{config_path} is not a valid EAGLE-3 draft config ({' '.join(str(e).split())}); {REDO_EXPORT}") from None


def read_draft_aux_layer_ids(path) -> list[int]:
    """The target layers the draft in `path` reads (eagle_aux_hidden_state_layer_ids, at the top of its config.json,
    in its eagle_config, or in the speculators format's transformer_layer_config), whatever its architecture: 05
    measures drafts vLLM serves, of more families than 04 trains."""
    raw, config_path = _read_config_json(path)
    key = "eagle_aux_hidden_state_layer_ids"
    inner = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else {}
    for where in (raw, raw.get("eagle_config"), inner, inner.get("eagle_config")):
        ids = where.get(key) if isinstance(where, dict) else None
        if ids:
            if not isinstance(ids, list) or not all(type(k) is int for k in ids):
                raise DataError(f"{config_path} has {key} {json.dumps(ids)}, not a list of layer numbers; {REDO_EXPORT}")
            return ids
    raise DataError(f"{config_path} has no {key!r}: it does not say which target layers the draft reads; {REDO_EXPORT}")


def draft_weight_files(path) -> list[Path]:
    """The safetensors of the draft in `path`: model.safetensors, else every *.safetensors (a draft saved
    in several files, as some publishers do)."""
    path = Path(path)
    single = path / WEIGHTS_NAME
    return [single] if single.is_file() else sorted(path.glob("*.safetensors"))


def read_draft_tensors(path, family: DraftFamily, shapes_only: bool = False, names: set[str] | None = None) -> dict:
    """{name: tensor} (or {name: shape} from the headers alone) of the tensors of the draft in `path` (all, or
    those in `names`), either format, under our names (its family's adapter, from its config.json). A missing or unreadable file is one DataError naming it."""
    from safetensors import safe_open

    files = draft_weight_files(path)
    if not files:
        raise DataError(f"{Path(path) / WEIGHTS_NAME} is missing; '{path}' is not an exported EAGLE-3 draft "
                        f"(run 04_train.py or re-export)")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    ours = family.adapter.to_ours(name)
                    if names is not None and ours not in names:
                        continue
                    out[ours] = tuple(sf.get_slice(name).get_shape()) if shapes_only else sf.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise DataError(f"cannot read {f} ({str(e).splitlines()[0][:160] if str(e) else type(e).__name__}); the "
                            f"file is truncated or corrupt: re-export or re-download the draft") from None
    return out


def check_draft_tensors(shapes: dict, config: DraftConfigContract, where, optional: set[str] = frozenset()) -> None:
    """DataError unless `shapes` ({name: shape}) are exactly the tensors of a draft of `config` (a model of its
    family): embed_tokens may be absent (shared from the target), and so may the names in `optional`."""
    with torch.device("meta"):  # shapes only: no memory, no init
        own = {k: tuple(v.shape) for k, v in family_of_config(config).build(config).state_dict().items()}
    missing = [k for k in own if k not in shapes and not k.startswith(EMBEDDING_PREFIX) and k not in optional]
    unexpected = [k for k in shapes if k not in own]
    wrong = [f"{k} {tuple(v)} != {own[k]}" for k, v in shapes.items() if k in own and tuple(v) != own[k]]
    if missing or unexpected or wrong:
        raise DataError(f"{where} does not match its config.json: missing {missing}, "
                        f"unexpected {unexpected}, wrong shapes {wrong}; re-export the draft")


def load_exported_draft(path, dtype: torch.dtype = torch.float32, embedding: torch.Tensor | None = None,
                        device: str | torch.device = "cpu") -> DraftModelContract:
    """Rebuild the draft from an export (either format), as a model of its family. Without embed_tokens in the
    file, pass the target embedding as `embedding` (or call load_target_embedding later)."""
    path = Path(path)
    config = read_draft_config(path)
    family = family_of_config(config)
    state = read_draft_tensors(path, family=family)
    # embed_tokens: shared from the target; d2t/t2d: absent from a full-vocab export (identity map, the default)
    check_draft_tensors({k: v.shape for k, v in state.items()}, config, draft_weight_files(path)[0],
                        optional=set(VOCAB_MAP_TENSORS) if not has_vocab_map(config) else set())
    model = family.build(config)
    model.load_state_dict(state, strict=False)
    if embedding is not None:
        model.load_target_embedding(embedding)
    model.embedding.weight.requires_grad_(False)
    return model.to(device=device, dtype=dtype)
