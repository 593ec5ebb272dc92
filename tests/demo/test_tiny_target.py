"""The tiny target fixture (common/demo/tiny_target.py, its corpus common/demo/chat_corpus.py): files, chat template,
tokens, training, cache."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.demo.chat_corpus import sample_prompt_rows
from common.demo.tiny_target import (
    CHAT_TEMPLATE,
    SHIPPED,
    SPECIAL_TOKENS,
    build_key,
    build_tiny_target,
    ensure_tiny_target,
    shipped_build,
    training_conversations,
)
from tests.helpers import REPO, stage_env

QUICK_STEPS = 30


@pytest.fixture(scope="module")
def quick_target(tmp_path_factory) -> tuple[Path, dict]:
    """A llama target trained for a few steps: the real build path, quick enough for the default suite."""
    out = tmp_path_factory.mktemp("tiny-llama")
    info = build_tiny_target(out, family="llama", steps=QUICK_STEPS, progress=False)
    return out, info


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_writes_loadable_llama(quick_target):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, info = quick_target
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "tiny_target_info.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["vocab_size"], config["max_position_embeddings"]) == (4, 128, 4, 2, 384, 2048, 4096)
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"
    assert json.loads((out / "tiny_target_info.json").read_text())["family"] == "llama"

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out_states = model(ids, output_hidden_states=True)
    assert len(out_states.hidden_states) == 5
    assert out_states.logits.shape == (1, ids.shape[1], 2048)
    assert info["num_parameters"] == sum(p.numel() for p in model.parameters())


def test_special_tokens_and_generation_config(quick_target):
    from transformers import AutoTokenizer

    out, _ = quick_target
    tok = AutoTokenizer.from_pretrained(out)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok(f"a{t}b", add_special_tokens=False)["input_ids"].count(i) == 1
        assert tok.encode(t, add_special_tokens=False) == [i]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.bos_token is None
    assert tok("hello", add_special_tokens=True)["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]
    # Chat markers are special (dropped by skip_special_tokens), think markers are kept in text.
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\nok"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (2, 0)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and tok_cfg["chat_template"] == CHAT_TEMPLATE


def test_chat_template_renders_as_specified(quick_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(quick_target[0])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning": "Greet back."},
        {"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}]},
        {"role": "assistant", "content": "Done.", "reasoning_content": "Old field name."},
        {"role": "assistant", "content": "No reasoning.", "reasoning": ""},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello!<|im_end|>\n"
        "<|im_start|>user\nTwo\nparts<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nOld field name.\n</think>\n\nDone.<|im_end|>\n"
        "<|im_start|>assistant\nNo reasoning.<|im_end|>\n"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "Q"}], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    )


def test_short_training_lowers_the_loss(quick_target):
    _, info = quick_target
    assert info["trained"] is True and info["steps"] == QUICK_STEPS
    # Random init over a 2048 vocab starts near ln(2048) = 7.6; 30 steps of templated chat
    # text already cut that by more than a third.
    assert 7.2 < info["first_loss"] < 8.0
    assert info["final_loss"] < 5.0
    assert info["corpus_tokens"] > 300_000


def test_build_is_deterministic(quick_target, tmp_path):
    out, info = quick_target
    again = build_tiny_target(tmp_path / "again", family="llama", steps=QUICK_STEPS, progress=False)
    assert again["final_loss"] == info["final_loss"]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256(tmp_path / "again" / name) == sha256(out / name), name


def test_corpus_is_deterministic_and_structured():
    a, b = training_conversations(200), training_conversations(200)
    assert a == b
    assert training_conversations(200, seed=1) != a
    for messages in a:
        assistants = [m for m in messages if m["role"] == "assistant"]
        assert assistants and all(m["reasoning"] and m["content"] for m in assistants)
    assert sample_prompt_rows(50) == sample_prompt_rows(50)


@pytest.mark.parametrize("family, arch", [("qwen3", "Qwen3ForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM")])
def test_other_families_load(tmp_path, family, arch):
    import torch
    from transformers import AutoModelForCausalLM

    info = build_tiny_target(tmp_path, family=family, train=False, progress=False)
    assert info["trained"] is False
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [arch] and config["num_hidden_layers"] == 4 and config["hidden_size"] == 128
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(model).__name__ == arch
    out = model(torch.tensor([[1, 100, 200, 2]]), output_hidden_states=True)
    assert len(out.hidden_states) == 5
    names = {n for n, _ in model.named_parameters()}
    if family == "qwen3":
        assert config["head_dim"] == 32 and "model.layers.0.self_attn.q_norm.weight" in names
    else:
        # MLA attention everywhere, a dense first layer, routed + shared experts after it.
        assert config["first_k_dense_replace"] == 1 and config["n_routed_experts"] == 8 and config["kv_lora_rank"] == 512
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
        assert "model.layers.0.mlp.gate_proj.weight" in names
        assert any(n.startswith("model.layers.1.mlp.experts.") for n in names)
        assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in names


def test_ensure_builds_once_and_reuses(tmp_path):
    path = ensure_tiny_target("deepseek_v3", cache_root=tmp_path, train=False, progress=False)
    assert path.parent == tmp_path / "tiny-targets"
    assert path.name == build_key("deepseek_v3", train=False) and path.name.startswith("deepseek_v3-")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_target("deepseek_v3", cache_root=tmp_path, train=False, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert build_key("llama") != build_key("llama", steps=5) != build_key("qwen3", steps=5)


# final_loss as shipped: llama 0.242, qwen3 0.223, deepseek_v3 1.117 (300 steps of its MoE).
@pytest.mark.parametrize("family,steps,max_loss", [("llama", 1000, 0.3), ("qwen3", 1000, 0.3), ("deepseek_v3", 300, 1.3)])
def test_the_shipped_build_is_this_codes_default_build(family, steps, max_loss):
    """data/tiny-targets/<family> is the default build of the current builder and corpus (what ensure_tiny_target
    would train): an edit of tiny_target.py or chat_corpus.py must ship new ones."""
    shipped = shipped_build(family)
    assert shipped is not None, (f"data/tiny-targets/{family} was built from other code: run `python -m "
                                 f"common.demo.tiny_target --family {family} --ship` and commit data/tiny-targets/{family}")
    info = json.loads((shipped / "tiny_target_info.json").read_text())
    assert info["family"] == family and info["trained"] and info["steps"] == steps and info["final_loss"] < max_loss
    assert json.loads((shipped / "config.json").read_text())["vocab_size"] == 2048
    assert shipped_build(family, steps=5) is None and shipped_build(family, train=False) is None


def test_ensure_takes_the_shipped_build_instead_of_training(tmp_path, capfd):
    """A fresh cache gets the shipped llama build in a second (a build trains for minutes); its files as shipped."""
    path = ensure_tiny_target("llama", cache_root=tmp_path, progress=False)
    assert path == tmp_path / "tiny-targets" / build_key("llama")
    assert "copied the shipped build" in capfd.readouterr().err
    shipped = {f.name: f.read_bytes() for f in (SHIPPED / "llama").iterdir() if f.name != "build.json"}
    assert {f.name: f.read_bytes() for f in path.iterdir()} == shipped


def test_racing_processes_share_one_build(tmp_path):
    """Two CLIs started together: one builds, the other waits for it; one directory, no leftovers."""
    cmd = [sys.executable, "-m", "common.demo.tiny_target", "--family", "llama", "--no-train", "--cache-root", str(tmp_path),
           "--print-path"]
    env = stage_env(EAGLE3_TINY_THREADS="1")
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    paths = [r[0].strip().splitlines()[-1] for r in results]
    assert paths[0] == paths[1]
    entries = sorted(p.name for p in (tmp_path / "tiny-targets").iterdir() if not p.name.endswith(".lock"))
    assert entries == [Path(paths[0]).name, Path(paths[0]).name + ".manifest.json"]
    assert (Path(paths[0]) / "model.safetensors").is_file()
    built = [r[1] for r in results if "built" in r[1]]
    assert len(built) == 1  # the second process found the first one's build


@pytest.mark.slow
def test_default_build_reaches_low_loss_and_answers_in_format(tiny_target_dir):
    """The embedded default target (the cached full build): low loss, templated greedy answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((tiny_target_dir / "tiny_target_info.json").read_text())
    assert info["trained"] and info["first_loss"] > 7.0
    assert info["final_loss"] < 0.5
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=120, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:])
    assert text.startswith("<think>\n") and "\n</think>\n\n" in text and text.endswith("<|im_end|>")
    assert "def reverse_string(s):" in text
