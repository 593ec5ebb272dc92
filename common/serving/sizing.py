"""How much KV cache a served target has, and how many requests it holds at once.

Two sources, one arithmetic:
- the running server's own figure: vLLM exports `vllm:cache_config_info` on /metrics with the number of KV
  blocks it allocated and their size (`kv_cache_tokens`); 01b prints it at start and checks
  generate.concurrency against it;
- on paper, before anything runs (`plan_serving`, scripts/plan_serving.py, the README's tables): the GPU
  memory vLLM may use, minus the weights per GPU and the activations, divided by the KV bytes per token.

KV bytes per token (`kv_bytes_per_token`), as vLLM lays its cache out per GPU:
- MLA (DeepSeek-V3, Kimi-K2.x: `kv_lora_rank` in the config) caches one latent of kv_lora_rank +
  qk_rope_head_dim values per layer, and every tensor-parallel rank keeps all of it (the heads are split,
  the latent is not): Kimi-K2.5 = 61 x (512 + 64) x 2 B = 70,272 B per token per GPU in bf16;
- GQA/MHA caches a key and a value per KV head per layer, the KV heads split over the ranks (a rank keeps
  at least one).

With speculative decoding the EAGLE draft's layers have a KV cache too, in the same pool (vLLM 0.32.0):
- the draft is built under the target's parallel config, so its KV heads split over the same TP ranks
  (`vllm/v1/spec_decode/llm_base_proposer.py` `_create_draft_vllm_config` keeps the target's parallel
  config; `vllm/model_executor/models/llama.py` `LlamaAttention.__init__`: num_kv_heads =
  max(1, total // tp)); an MLA draft (`deepseek_eagle3.py`) keeps its latent on every rank, as the target;
  its cache dtype is the server's (`speculative_config.kv_cache_dtype` may override it);
- `GPUModelRunner.get_kv_cache_spec` (`vllm/v1/worker/gpu_model_runner.py`) lists the draft's attention
  layers beside the target's; all are full attention (MLAAttentionSpec is grouped as FullAttentionSpec,
  `register_all_kvcache_specs` in `vllm/v1/core/single_type_kv_cache_manager.py`), so
  `get_kv_cache_groups` (`vllm/v1/core/kv_cache_utils.py`) puts them in one group whose block holds every
  layer's page (`UniformTypeKVCacheSpecs.page_size_bytes` is their sum), and
  `get_kv_cache_config_from_groups` allocates (available memory // that block's bytes) blocks. A token
  costs target + draft bytes: the Kimi-K2.5 draft (1 layer, 64 KV heads of 128, bf16) adds 32,768 B per
  token, 4,096 B per GPU at TP 8, to the target's 70,272.
A draft of a family this pipeline knows (common/model/draft/registry.py: a config object, or a config.json naming
a registered architecture) is sized by its family's rule (`DraftFamily.kv_bytes_per_token`); any other draft (a
published MLA one) by the rules above, from its config's keys (`draft_kv_bytes_per_token`).
The running server's `vllm:cache_config_info` counts blocks of that size, so its figure (01b) already
includes the draft when the server has one. The draft's weights are not counted on paper (the Kimi-sized
draft: ~0.5 GiB per GPU at TP 8, its fc replicated on every rank, the rest split); vLLM's profile run does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from common.core.errors import ConfigError, PipelineError
from common.model.sizes import model_size

GIB = 1024**3
# What nvidia-smi reports as a card's memory (MiB / 1024), for planning on paper.
GPU_MEMORY_GIB = {"rtx-pro-6000": 95.6, "h200": 140.4, "b200": 179.1}
REQUIRED = object()  # kv_bytes_per_token: a size the config must give
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_bytes_per_token(text_config: Any, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                       draft_config: Any = None) -> int:
    """Bytes of KV cache one token takes on one GPU (see the module docstring): a model's layers (a config dict
    or object: the target's text config, or a draft's config.json / DraftModelConfig), plus the draft's when
    draft_config is given (a target served with that draft)."""
    if draft_config is not None:
        return (kv_bytes_per_token(text_config, tensor_parallel_size, kv_cache_dtype)
                + draft_kv_bytes_per_token(draft_config, tensor_parallel_size, kv_cache_dtype))
    if isinstance(text_config, dict) and isinstance(text_config.get("transformer_layer_config"), dict):
        text_config = {**text_config["transformer_layer_config"], **text_config}  # a speculators-format draft

    def get(name: str, default: Any = REQUIRED):  # a size, range-checked (a negative or string one is an error)
        value = model_size(text_config, name, None if default is REQUIRED else default)
        if value is None and default is REQUIRED:
            raise ConfigError(f"the config has no {name}, which sizing its KV cache needs")
        return value

    per_value = KV_DTYPE_BYTES[kv_cache_dtype]
    layers = get("num_hidden_layers")
    if get("kv_lora_rank", None):
        return layers * (get("kv_lora_rank") + get("qk_rope_head_dim", 0)) * per_value
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads", heads)
    head_dim = get("head_dim", None) or get("hidden_size") // heads
    if not head_dim:  # hidden_size below num_attention_heads: no head would have a dimension
        raise ConfigError(f"hidden_size {get('hidden_size')} is below num_attention_heads {heads}: head_dim would be 0 "
                          f"(give head_dim)")
    return layers * 2 * max(1, math.ceil(kv_heads / tensor_parallel_size)) * head_dim * per_value


def draft_kv_bytes_per_token(draft_config: Any, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto") -> int:
    """Bytes of KV cache one token takes in a draft's layers on one GPU: by its family's rule when it is of a
    family the pipeline knows, else by vLLM's layout of its config's keys (kv_bytes_per_token)."""
    family, config = _draft_family(draft_config)
    if family is None:
        return kv_bytes_per_token(draft_config, tensor_parallel_size, kv_cache_dtype)
    return family.kv_bytes_per_token(config, tensor_parallel_size, KV_DTYPE_BYTES[kv_cache_dtype])


def _draft_family(draft_config: Any):
    """(family, its config object) of a draft config object or config.json dict; (None, None) for a config.json that
    names no registered architecture or that its family cannot read (sized from its keys instead)."""
    from common.model.draft import DRAFT_FAMILIES, family_of_config  # imports torch: only when a draft is sized

    if not isinstance(draft_config, dict):
        return family_of_config(draft_config), draft_config
    layer = draft_config.get("transformer_layer_config")  # a speculators-format draft names it at either level
    names = draft_config.get("architectures") or (layer.get("architectures") if isinstance(layer, dict) else None)
    if not isinstance(names, list) or not names or any(not isinstance(n, str) or n not in DRAFT_FAMILIES for n in names):
        return None, None
    family = DRAFT_FAMILIES[names[0]]
    try:
        return family, family.read_config(draft_config)
    except (PipelineError, KeyError, TypeError, ValueError):
        return None, None


def draft_architecture(draft_config: Any) -> str:
    """The architecture name of a draft config (object or config.json dict), for the side-by-side lines."""
    family, _ = _draft_family(draft_config)
    if family is not None:
        return family.architecture
    names = draft_config.get("architectures") if isinstance(draft_config, dict) else None
    return str(names[0]) if isinstance(names, list) and names else "an unknown architecture"


def draft_comparison_lines(plans: list[tuple[str, str, "ServingPlan"]]) -> list[str]:
    """Several drafts for one target side by side: (name, architecture, plan served with it) each, the plans alike but
    for the draft. The target alone first, then each draft's bytes per token on one GPU and what the cache holds."""
    first = plans[0][2]
    lines = [first.lines()[0], f"without a draft: {first.kv_bytes_per_token:,} B/token -> {first.kv_tokens_without_draft:,} "
                               f"tokens, {first._at_once(first.kv_tokens_without_draft)}"]
    for name, architecture, plan in plans:
        lines.append(f"with {name} ({architecture}): + {plan.draft_kv_bytes_per_token:,} B/token draft = "
                     f"{plan.total_kv_bytes_per_token:,} B/token -> {plan.kv_tokens:,} tokens, {plan._at_once(plan.kv_tokens)}")
    return lines


def kv_cache_tokens(metrics: dict) -> Optional[int]:
    """Tokens the running server's KV cache holds (summed over its engines), from `vllm:cache_config_info`
    in scrape_metrics' form; None when the server does not say."""
    total = 0
    for labels, _ in metrics.get("vllm:cache_config_info", []):
        try:
            total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            return None
    return total or None


@dataclass
class ServingPlan:
    """One GPU of a tensor-parallel server, on paper (GiB)."""

    gpu_memory_gib: float  # what the card has
    utilization: float  # --gpu-memory-utilization
    weights_gib: float  # the target's weights on this GPU
    activation_gib: float  # activations, CUDA graphs, communication buffers: vLLM's profile run measures it
    kv_bytes_per_token: int  # the target's layers
    max_model_len: int
    tokens_per_request: int  # a typical request: prompt + answer
    draft_kv_bytes_per_token: int = 0  # the EAGLE draft's layers, in the same blocks (0: served without a draft)

    @property
    def kv_gib(self) -> float:
        return self.gpu_memory_gib * self.utilization - self.weights_gib - self.activation_gib

    @property
    def total_kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token + self.draft_kv_bytes_per_token

    def _tokens(self, bytes_per_token: int) -> int:
        return max(0, int(self.kv_gib * GIB // bytes_per_token))

    @property
    def kv_tokens(self) -> int:
        """Tokens the cache holds as served: every token has a slot in the target's and the draft's layers."""
        return self._tokens(self.total_kv_bytes_per_token)

    @property
    def kv_tokens_without_draft(self) -> int:
        return self._tokens(self.kv_bytes_per_token)

    @property
    def fits_one_full_request(self) -> bool:
        """vLLM refuses to start unless one request of max_model_len fits."""
        return self.kv_tokens >= self.max_model_len

    @property
    def full_length_requests(self) -> int:
        return self.kv_tokens // self.max_model_len

    @property
    def typical_requests(self) -> int:
        return self.kv_tokens // self.tokens_per_request

    def _at_once(self, tokens: int) -> str:
        refused = "" if tokens >= self.max_model_len else " (vLLM refuses to start: lower max_model_len)"
        return (f"{tokens // self.max_model_len} request(s) of max_model_len {self.max_model_len:,}{refused}, "
                f"~{tokens // self.tokens_per_request} of {self.tokens_per_request:,} tokens")

    def lines(self) -> list[str]:
        per_gpu = (f"per GPU: {self.gpu_memory_gib:.1f} GiB x {self.utilization:g} = {self.gpu_memory_gib * self.utilization:.1f} "
                   f"GiB, - {self.weights_gib:.1f} GiB weights - {self.activation_gib:.1f} GiB activations = {self.kv_gib:.1f} GiB KV cache")
        if not self.draft_kv_bytes_per_token:
            return [per_gpu, f"KV cache: {self.kv_bytes_per_token:,} B/token -> {self.kv_tokens:,} tokens",
                    f"at once: {self._at_once(self.kv_tokens)}"]
        return [per_gpu,
                f"KV cache: {self.kv_bytes_per_token:,} B/token target + {self.draft_kv_bytes_per_token:,} B/token draft = "
                f"{self.total_kv_bytes_per_token:,} B/token -> {self.kv_tokens:,} tokens",
                f"at once: {self._at_once(self.kv_tokens)}",
                f"without the draft: {self.kv_tokens_without_draft:,} tokens, {self._at_once(self.kv_tokens_without_draft)}"]


def plan_serving(text_config: Any, *, gpu_memory_gib: float, weights_gib_total: float, tensor_parallel_size: int,
                 utilization: float = 0.9, kv_cache_dtype: str = "auto", max_model_len: int,
                 tokens_per_request: int, activation_gib: float = 4.0, draft_config: Any = None) -> ServingPlan:
    """The KV cache one GPU of a TP server keeps, on paper; with draft_config (the EAGLE draft's config), served
    with that draft. activation_gib is a planning allowance (vLLM's profile run measures the real figure at start
    and logs "Available KV cache memory")."""
    draft_bytes = 0 if draft_config is None else draft_kv_bytes_per_token(draft_config, tensor_parallel_size, kv_cache_dtype)
    return ServingPlan(gpu_memory_gib=gpu_memory_gib, utilization=utilization,
                       weights_gib=weights_gib_total / tensor_parallel_size, activation_gib=activation_gib,
                       kv_bytes_per_token=kv_bytes_per_token(text_config, tensor_parallel_size, kv_cache_dtype),
                       max_model_len=max_model_len, tokens_per_request=tokens_per_request,
                       draft_kv_bytes_per_token=draft_bytes)


def concurrency_line(kv_tokens: int, tokens_per_request: int, concurrency: int) -> tuple[str, bool]:
    """What 01b prints about the server's KV capacity, and whether generate.concurrency is far above it
    (requests past what the cache holds wait in vLLM's queue, and that wait counts against timeout_s)."""
    fit = max(1, kv_tokens // max(1, tokens_per_request))
    line = (f"the server's KV cache holds {kv_tokens:,} tokens: ~{fit} requests of {tokens_per_request:,} tokens "
            f"(prompt + generate.max_tokens) at once; generate.concurrency is {concurrency}")
    # answers are mostly shorter than max_tokens, so up to ~4x that many run at once in practice
    return line, concurrency > 4 * fit
