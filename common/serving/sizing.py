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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

GIB = 1024**3
# What nvidia-smi reports as a card's memory (MiB / 1024), for planning on paper.
GPU_MEMORY_GIB = {"rtx-pro-6000": 95.6, "h200": 140.4, "b200": 179.1}
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_bytes_per_token(text_config: Any, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto") -> int:
    """Bytes of KV cache one token takes on one GPU (see the module docstring)."""
    def get(name: str, default=None):
        value = text_config.get(name) if isinstance(text_config, dict) else getattr(text_config, name, None)
        return default if value is None else value

    per_value = KV_DTYPE_BYTES[kv_cache_dtype]
    layers = int(get("num_hidden_layers"))
    if get("kv_lora_rank"):
        return layers * (int(get("kv_lora_rank")) + int(get("qk_rope_head_dim", 0))) * per_value
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads", heads))
    head_dim = int(get("head_dim", int(get("hidden_size")) // heads))
    return layers * 2 * max(1, math.ceil(kv_heads / tensor_parallel_size)) * head_dim * per_value


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
    kv_bytes_per_token: int
    max_model_len: int
    tokens_per_request: int  # a typical request: prompt + answer

    @property
    def kv_gib(self) -> float:
        return self.gpu_memory_gib * self.utilization - self.weights_gib - self.activation_gib

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_gib * GIB // self.kv_bytes_per_token))

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

    def lines(self) -> list[str]:
        return [f"per GPU: {self.gpu_memory_gib:.1f} GiB x {self.utilization:g} = {self.gpu_memory_gib * self.utilization:.1f} "
                f"GiB, - {self.weights_gib:.1f} GiB weights - {self.activation_gib:.1f} GiB activations = {self.kv_gib:.1f} GiB KV cache",
                f"KV cache: {self.kv_bytes_per_token:,} B/token -> {self.kv_tokens:,} tokens",
                f"at once: {self.full_length_requests} request(s) of max_model_len {self.max_model_len:,}"
                f"{'' if self.fits_one_full_request else ' (vLLM refuses to start: lower max_model_len)'}, "
                f"~{self.typical_requests} of {self.tokens_per_request:,} tokens"]


def plan_serving(text_config: Any, *, gpu_memory_gib: float, weights_gib_total: float, tensor_parallel_size: int,
                 utilization: float = 0.9, kv_cache_dtype: str = "auto", max_model_len: int,
                 tokens_per_request: int, activation_gib: float = 4.0) -> ServingPlan:
    """The KV cache one GPU of a TP server keeps, on paper. activation_gib is a planning allowance (vLLM's
    profile run measures the real figure at start and logs "Available KV cache memory")."""
    return ServingPlan(gpu_memory_gib=gpu_memory_gib, utilization=utilization,
                       weights_gib=weights_gib_total / tensor_parallel_size, activation_gib=activation_gib,
                       kv_bytes_per_token=kv_bytes_per_token(text_config, tensor_parallel_size, kv_cache_dtype),
                       max_model_len=max_model_len, tokens_per_request=tokens_per_request)


def concurrency_line(kv_tokens: int, tokens_per_request: int, concurrency: int) -> tuple[str, bool]:
    """What 01b prints about the server's KV capacity, and whether generate.concurrency is far above it
    (requests past what the cache holds wait in vLLM's queue, and that wait counts against timeout_s)."""
    fit = max(1, kv_tokens // max(1, tokens_per_request))
    line = (f"the server's KV cache holds {kv_tokens:,} tokens: ~{fit} requests of {tokens_per_request:,} tokens "
            f"(prompt + generate.max_tokens) at once; generate.concurrency is {concurrency}")
    # answers are mostly shorter than max_tokens, so up to ~4x that many run at once in practice
    return line, concurrency > 4 * fit
