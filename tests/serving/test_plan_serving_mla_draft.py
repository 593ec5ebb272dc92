"""plan_serving for the MLA draft: vLLM keeps its latent (kv_lora_rank + qk_rope_head_dim values) whole on every TP
rank, so configs/kimi-k2.5.yaml's draft adds 1,152 B per token per GPU, against 4,096 B for the Llama-style draft's
64 KV heads of 128 split over TP 8; given twice, --draft prints the two side by side."""

from __future__ import annotations

import json
import subprocess
import sys

from common.core.config import load_config
from common.serving.sizing import GIB, draft_kv_bytes_per_token, kv_bytes_per_token, plan_serving
from tests.helpers import REPO

KIMI = json.loads((REPO / "configs" / "targets" / "kimi-k2.5.json").read_text())
LLAMA_DRAFT = REPO / "configs" / "drafts" / "kimi-k2.5-eagle3.json"


def test_the_mla_draft_adds_1152_bytes_per_gpu_the_llama_style_4096():
    from common.model.draft import DEEPSEEK_EAGLE3_FAMILY
    from common.train.memory_plan import draft_config_from

    mla = draft_config_from(load_config(REPO / "configs" / "kimi-k2.5.yaml"), KIMI)
    llama = json.loads(LLAMA_DRAFT.read_text())
    assert DEEPSEEK_EAGLE3_FAMILY.kv_bytes_per_token(mla, 8, 2) == (512 + 64) * 2 == 1152
    for tp in (1, 8, 16):  # the latent is not split
        assert draft_kv_bytes_per_token(mla, tp) == 1152 and draft_kv_bytes_per_token(mla, tp, "fp8") == 576
    assert draft_kv_bytes_per_token(llama, 8) == 2 * 64 * 128 * 2 // 8 == 4096
    assert draft_kv_bytes_per_token(llama, 1) == 32_768
    assert kv_bytes_per_token(KIMI, 8, draft_config=mla) == 70_272 + 1152
    plan = plan_serving(KIMI, gpu_memory_gib=95.6, weights_gib_total=KIMI["weights_gib"], tensor_parallel_size=8,
                        utilization=0.92, max_model_len=32_768, tokens_per_request=4096, activation_gib=5.0, draft_config=mla)
    assert plan.kv_tokens == int((95.6 * 0.92 - KIMI["weights_gib"] / 8 - 5.0) * GIB // 71_424) == 172_161


def test_plan_serving_prints_the_drafts_side_by_side():
    args = [sys.executable, "scripts/plan_serving.py", "--target", "configs/targets/kimi-k2.5.json", "--gpu", "rtx-pro-6000",
            "--utilization", "0.92", "--max-model-len", "32768", "--tokens-per-request", "4096",
            "--draft", "configs/kimi-k2.5.yaml", "--draft", str(LLAMA_DRAFT)]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert out.stdout.splitlines() == [
        "kimi-k2.5.json + draft kimi-k2.5.yaml | kimi-k2.5-eagle3.json: TP 8 on rtx-pro-6000, KV cache auto",
        "  per GPU: 95.6 GiB x 0.92 = 88.0 GiB, - 71.5 GiB weights - 5.0 GiB activations = 11.5 GiB KV cache",
        "  without a draft: 70,272 B/token -> 174,984 tokens, 5 request(s) of max_model_len 32,768, ~42 of 4,096 tokens",
        "  with kimi-k2.5.yaml (Eagle3DeepseekV2ForCausalLM): + 1,152 B/token draft = 71,424 B/token -> 172,161 tokens, "
        "5 request(s) of max_model_len 32,768, ~42 of 4,096 tokens",
        "  with kimi-k2.5-eagle3.json (LlamaForCausalLMEagle3): + 4,096 B/token draft = 74,368 B/token -> 165,346 tokens, "
        "5 request(s) of max_model_len 32,768, ~40 of 4,096 tokens"]
    # at TP 1 the Llama-style draft's heads stay whole; the MLA latent is the same
    out = subprocess.run([*args, "--tp", "1", "--weights-gib", "10"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "+ 1,152 B/token draft" in out.stdout and "+ 32,768 B/token draft" in out.stdout, out.stdout + out.stderr
