"""04's memory planner for the MLA draft (Eagle3DeepseekV2ForCausalLM): the attention's widths are the family's
(DraftFamily.attention_widths: q and k at nope + rope per head, v at v_head_dim, the q and kv latents), the estimate
bounds the peak measured on CPU for a tiny MLA target whose widths all differ, and the shipped Kimi config (the
published K2.5 MLA draft's sizes, the full vocab) fits 8 x 96 GB."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.train.mla_run import build_mla_run, build_mla_target
from tests.train.test_memory_plan import probe_peak

# The estimate's margin over the measured peak here (1.02x and 1.06x measured). Tighter than the Llama test's 1.3: the
# planner that counted v at the q/k width and left the latents out planned 1.07x and ~1.2x on these runs, and a margin
# of 1.3 would not tell the two apart.
OVER = 1.12

KIMI_JSON = REPO / "configs" / "targets" / "kimi-k2.5.json"


def kimi_mla_draft(*overrides: str):
    """The draft 04 builds from configs/kimi-k2.5.yaml for Kimi-K2.5's config (its MLA sizes, yarn rope)."""
    from common.core.config import load_config
    from common.train.memory_plan import draft_config_from

    target = {**json.loads(KIMI_JSON.read_text()), "torch_dtype": "bfloat16"}
    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml", list(overrides))
    return cfg, draft_config_from(cfg, target)


def test_the_mla_familys_attention_widths():
    from common.model.draft import DEEPSEEK_EAGLE3_FAMILY, LLAMA_EAGLE3_FAMILY, AttentionWidths, family_of_config

    _, d = kimi_mla_draft()
    assert family_of_config(d) is DEEPSEEK_EAGLE3_FAMILY
    assert (d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (d.hidden_size, d.num_attention_heads, d.intermediate_size, d.draft_vocab_size) == (7168, 64, 18432, 163840)
    assert DEEPSEEK_EAGLE3_FAMILY.attention_widths(d) == AttentionWidths(
        q=64 * 192, k=64 * 192, v=64 * 128, out=64 * 128, rope=64, normed_latents=1536 + 512)
    no_q_lora = dataclasses.replace(d, q_lora_rank=None)
    assert DEEPSEEK_EAGLE3_FAMILY.attention_widths(no_q_lora).normed_latents == 512
    # the Llama family: 64 heads, 8 KV heads of 128, rotary over the whole head, no latents
    from common.model.draft import DraftModelConfig

    llama = DraftModelConfig(hidden_size=7168, intermediate_size=12288, num_attention_heads=64, num_key_value_heads=8,
                             head_dim=128, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168,
                             aux_layer_ids=[2, 30, 58])
    assert LLAMA_EAGLE3_FAMILY.attention_widths(llama) == AttentionWidths(q=8192, k=1024, v=1024, out=8192, rope=128)


def test_the_plan_counts_v_at_v_head_dim_and_the_latents():
    """Each MLA width moves the planned activations by exactly what it keeps per token: v_head_dim its v (every TTT
    step's) and the attention output, kv_lora_rank its latent through the norm (without checkpointing)."""
    from common.train.memory_plan import plan_memory

    cfg, d = kimi_mla_draft("train.gradient_checkpointing=true")
    T, K = cfg.train.batch_max_tokens, cfg.train.ttt_steps
    base = plan_memory(d, cfg.train, world_size=8)
    narrower_v = plan_memory(dataclasses.replace(d, v_head_dim=64), cfg.train, world_size=8)
    # checkpointing on: each TTT step keeps its layer's v [T, heads x v_head_dim] (bf16)
    assert base.terms["activations"] - narrower_v.terms["activations"] == T * K * 64 * 64 * 2
    off = dataclasses.replace(cfg.train, gradient_checkpointing=False)
    smaller_latent = plan_memory(dataclasses.replace(d, kv_lora_rank=256), off, world_size=8)
    # off: the kv latent's norm keeps an fp32 input copy and its bf16 output (6 B a value), per token and TTT step
    assert (plan_memory(d, off, world_size=8).terms["activations"] - smaller_latent.terms["activations"]
            == T * K * 256 * (4 + 2 + 2))


def test_the_eagle31_norms_add_what_they_keep_per_token():
    """EAGLE-3.1 on the Kimi MLA draft: fc_norm keeps, once per micro-batch, each aux state's norm (an fp32 input copy,
    the normalised input and the bf16 output, fc's input: 8 B a value of 3 x 7168); norm_output the final norm of all
    T rows in each of the K - 1 steps that feed the next (8 B a value of the draft's 7168). Checkpointing on and off.
    (Measured on CPU in fp32 by tests/train/test_memory_plan.py's "eagle3.1" size: +0.66 MB for both, planned +0.65.)"""
    from common.train.memory_plan import plan_memory

    cfg, d = kimi_mla_draft("train.gradient_checkpointing=true")
    T, K, H, A = cfg.train.batch_max_tokens, cfg.train.ttt_steps, d.hidden_size, d.num_aux
    for train in (cfg.train, dataclasses.replace(cfg.train, gradient_checkpointing=False)):
        base = plan_memory(d, train, world_size=8).terms["activations"]
        fc_norm = plan_memory(dataclasses.replace(d, fc_norm=True), train, world_size=8).terms["activations"]
        norm_output = plan_memory(dataclasses.replace(d, norm_output=True), train, world_size=8).terms["activations"]
        both = plan_memory(dataclasses.replace(d, fc_norm=True, norm_output=True), train, world_size=8).terms["activations"]
        assert fc_norm - base == T * A * d.target_hidden_size * (4 + 2 + 2)
        assert norm_output - base == T * (K - 1) * H * (4 + 2 + 2)
        assert both - base == (fc_norm - base) + (norm_output - base)


def test_the_kimi_config_fits_96_gb_cards_with_the_full_vocab():
    """configs/kimi-k2.5.yaml: the MLA draft (1.84B trainable with the 163840-token lm_head), FSDP on 8; the planner
    turns gradient checkpointing on for 96 GB cards (the figure the config and README quote) and leaves it off on
    141 GB H200s."""
    args = [sys.executable, str(REPO / "scripts" / "plan_memory.py"), "--config", str(REPO / "configs" / "kimi-k2.5.yaml"),
            "--world-size", "8", "--target-config", str(KIMI_JSON)]
    out = subprocess.run([*args, "--gpu-memory-gb", "96"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "peak ~76.29 GB per GPU" in out.stdout and "1841.2M trainable params" in out.stdout
    assert "gradient_checkpointing on (auto)" in out.stdout and "fits: 76.29 GB of 96.00 GB" in out.stdout
    out = subprocess.run([*args, "--gpu-memory-gb", "141"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "peak ~122.60 GB" in out.stdout and "gradient_checkpointing off (auto)" in out.stdout
    # 32768 tokens per micro-batch does not fit a 96 GB card even recomputing: one line, what to lower
    out = subprocess.run([*args, "--gpu-memory-gb", "96", "--set", "train.batch_max_tokens=32768"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "does not fit 96.00 GB" in out.stderr
    # a hub target's three size flags cannot size an MLA draft: one line pointing at --target-config
    out = subprocess.run([*args[:-2], "--target-hidden-size", "7168", "--target-vocab-size", "163840",
                          "--target-num-layers", "61"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "as --target-config" in out.stderr


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-run")
    return build_mla_run(root, build_mla_target(root / "target"), draft_vocab_size=128)


@pytest.mark.parametrize("size", ["small", "larger+gc"])
def test_estimate_bounds_the_measured_peak_of_the_mla_draft(mla_run, tmp_path, size):
    """04's estimate vs the allocator's peak over 3 steps (tests/train/memory_probe.py), for the MLA draft of a target
    with q/k heads of 32 and v heads of 8, a q latent of 32 and a kv latent of 48."""
    import yaml

    tree = yaml.safe_load(mla_run.read_text())
    tree["train"].update(max_steps=3, eval_every=0, checkpoint_every=100)
    if size == "larger+gc":
        tree["train"].update(batch_max_tokens=1024, ttt_steps=5, gradient_checkpointing=True)
        tree["draft"]["intermediate_size"] = 512
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    r = probe_peak(cfg)
    measured, estimate = r["peak_bytes"], r["estimate_bytes"]
    print(f"{size}: measured {measured / 1e6:.2f} MB, estimated {estimate / 1e6:.2f} MB ({estimate / measured:.2f}x): "
          f"{r['estimate']}")
    assert measured <= estimate <= OVER * measured
