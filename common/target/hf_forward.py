"""The target in transformers: load it, hook its decoder stack, run a batch and capture the states
EAGLE-3 trains on (docs/design.md#aux-layer-convention). Used by 02's hf backend and by 05's replay
over the served outputs.
"""

from __future__ import annotations

import os
from typing import Any

from common.core.errors import ConfigError, DataError, PipelineError
from common.core.io import format_bytes
from common.target.loading import check_safetensors_readable


def find_decoder_stack(model, num_layers: int):
    """The module that holds `layers` (N decoder layers) and the final `norm`, e.g. model.model.

    Multimodal wrappers (Kimi-K2.5) nest it deeper (language_model.model); take the shortest path.
    """
    import torch.nn as nn

    found = []
    for name, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers and isinstance(getattr(module, "norm", None), nn.Module):
            found.append((name.count("."), len(name), name, module))
    if not found:
        raise DataError(
            f"cannot find the decoder stack (a module with {num_layers} `layers` and a final `norm`) in "
            f"{type(model).__name__}; this model family is not supported by 02_extract_hidden.py"
        )
    return min(found, key=lambda t: t[:3])[3]


class HiddenStateCapture:
    """Forward hooks that copy the aux states (inputs of layers[k]) and the final norm output.

    Before each forward pass call `expect(valid_index)` with the flat [B*T] indices of the real
    tokens; after it, `take()` returns {"aux": [n, n_aux*H], "final": [n, H]} on CPU.
    """

    def __init__(self, stack, aux_layer_ids: list[int], out_dtype):
        self.aux_layer_ids = list(aux_layer_ids)
        self.out_dtype = out_dtype
        self._index_cpu = None
        self._index_on: dict = {}
        self._aux: dict[int, Any] = {}
        self._final = None
        self._handles = []
        for k in self.aux_layer_ids:
            self._handles.append(stack.layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True))
        self._handles.append(stack.norm.register_forward_hook(self._norm_hook))

    def _select(self, hidden):
        if hidden.device not in self._index_on:
            self._index_on[hidden.device] = self._index_cpu.to(hidden.device)
        flat = hidden.reshape(-1, hidden.shape[-1])
        return flat.index_select(0, self._index_on[hidden.device]).to(self.out_dtype).to("cpu")

    def _pre_hook(self, k: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self._aux[k] = self._select(hidden)
        return hook

    def _norm_hook(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        self._final = self._select(hidden)

    def expect(self, valid_index) -> None:
        self._index_cpu, self._index_on = valid_index, {}
        self._aux, self._final = {}, None

    def take(self) -> dict:
        import torch

        missing = [k for k in self.aux_layer_ids if k not in self._aux]
        if missing or self._final is None:
            raise PipelineError(f"hooks did not fire for aux layers {missing} / final norm; the model's forward is not supported")
        out = {"aux": torch.cat([self._aux[k] for k in self.aux_layer_ids], dim=1), "final": self._final}
        self._aux, self._final = {}, None
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def pad_batch(samples: list[dict]):
    """Right-padded input_ids and attention mask, and the flat indices of the real tokens."""
    import torch

    lengths = [len(s["input_ids"]) for s in samples]
    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : lengths[i]] = torch.tensor(s["input_ids"], dtype=torch.long)
        mask[i, : lengths[i]] = 1
    valid_index = mask.reshape(-1).nonzero().squeeze(1)  # row-major = samples concatenated in order
    return ids, mask, valid_index


def input_device(stack):
    embed = getattr(stack, "embed_tokens", None)
    module = embed if embed is not None else stack
    return next(module.parameters()).device


def forward_batch(stack, capture: HiddenStateCapture, samples: list[dict]) -> dict:
    import torch

    ids, mask, valid_index = pad_batch(samples)
    device = input_device(stack)
    capture.expect(valid_index)
    with torch.inference_mode():
        stack(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    return capture.take()


def choose_device(want: str) -> str:
    """auto = cuda if visible, else cpu (the config's type admits auto, cpu and cuda only)."""
    import torch

    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("extract.device is 'cuda' but no CUDA device is visible; use --set extract.device=cpu")
    return want


def check_hf_fits(target, capacity_bytes: float, where: str) -> int:
    """Refuse a target that transformers cannot hold: counts what it materialises (quantized -> dtype)."""
    from common.target.loading import materialized_bytes

    need, how = materialized_bytes(target.model, target.dtype)
    if need > capacity_bytes:
        raise ConfigError(
            f"target.model '{target.model}' takes {format_bytes(need)} in transformers ({how}), more than the "
            f"{format_bytes(capacity_bytes)} of {where}; use --set extract.backend=vllm, which runs it as stored with "
            f"tensor/expert parallelism")
    return need


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_target_model(target, device: str, local_rank: int = 0, world_size: int = 1):
    """The target as AutoModelForCausalLM in target.dtype, placed as target.device_map says (target: the config section)."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.target.loading import torch_dtype

    kwargs: dict[str, Any] = {"dtype": torch_dtype(target.dtype), "trust_remote_code": target.trust_remote_code}
    placement = "cpu"
    if device == "cuda":
        device_map = target.device_map
        one_gpu = f"cuda:{local_rank}"
        if world_size > 1:
            if device_map not in ("auto", "single"):
                raise ConfigError(f"target.device_map '{device_map}' shards one model over the GPUs; run it as one process, not under torchrun")
            placement = one_gpu
        elif device_map == "auto":
            gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
            need = check_hf_fits(target, 0.9 * sum(gpus), f"the {len(gpus)} visible GPUs (90%)")
            placement = one_gpu if need < 0.9 * gpus[0] or len(gpus) == 1 else "auto"
        else:
            placement = one_gpu if device_map == "single" else device_map
        if placement.startswith("cuda:"):
            check_hf_fits(target, 0.9 * torch.cuda.get_device_properties(local_rank).total_memory, f"GPU {local_rank} (90%)")
        torch.cuda.set_device(local_rank)
    else:
        check_hf_fits(target, 0.9 * host_memory_bytes(), "this machine's memory (90%)")
    if placement != "cpu" and not placement.startswith("cuda:"):
        kwargs["device_map"] = placement  # sharded over the visible GPUs
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(target.model, output_loading_info=True, **kwargs)
    except (OSError, ValueError) as e:
        if not target.trust_remote_code and ("custom code" in str(e) or "trust_remote_code" in str(e)):
            # Kimi-K2.5's layout: transformers knows its config but loads the model only from its own code.
            raise ConfigError(
                f"target.model '{target.model}' needs its own modeling code (auto_map in its config.json) to load in "
                f"transformers; set target.trust_remote_code: true if you trust it"
            ) from None
        raise ConfigError(f"cannot load target.model '{target.model}': {str(e).splitlines()[0]}") from None
    except Exception as e:  # safetensors' own error types on a truncated/corrupt shard
        check_safetensors_readable(target.model)  # raises naming the bad file
        raise DataError(f"cannot load target.model '{target.model}': {type(e).__name__}: {str(e).splitlines()[0]}") from None
    check_nothing_missing(target.model, loading)
    if "device_map" not in kwargs:
        model.to(placement)
    model.eval()
    return model, placement


def check_nothing_missing(model_path: str, loading: dict) -> None:
    """transformers starts a weight the checkpoint lacks at random (with a warning): hidden states of that model
    would teach the draft a model that does not exist, so a missing weight is an error."""
    missing, unexpected = sorted(loading.get("missing_keys") or []), sorted(loading.get("unexpected_keys") or [])
    if missing:
        def some(keys: list) -> str:
            return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

        raise DataError(
            f"target.model '{model_path}' lacks {len(missing)} weight(s) its architecture needs ({some(missing)})"
            + (f"; its safetensors hold others ({some(unexpected)})" if unexpected else "")
            + ": transformers would start them at random. Re-download the target, or rename its weights to its "
              "config's architecture")
