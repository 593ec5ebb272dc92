"""Issue 17: the serving arithmetic of README "Sizing" (common/serving/sizing.py, scripts/plan_serving.py).
The bytes per token are also checked against a running vLLM in tests/data/test_generate_vllm.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys


from common.core.config import load_config
from common.serving.sizing import concurrency_line, kv_bytes_per_token, kv_cache_tokens, plan_serving
from tests.helpers import REPO

KIMI = json.loads((REPO / "configs" / "targets" / "kimi-k2.5.json").read_text())


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
