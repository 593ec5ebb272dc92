"""Stages 01 + 01b against a real vLLM server (CPU build) serving the tiny target (the server
manager itself is tested in tests/serving/test_vllm_server.py).

The session-scoped `vllm_server` fixture starts vLLM once (about 1.5 min on 2 cores) with the
deepseek_r1 reasoning parser, which splits the tiny target's `<think>...</think>` output.
Tests marked `vllm` use it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from common.core.io import iter_jsonl
from common.data.generate_requests import normalize_turn
from common.serving.chat import parse_completion
from common.target.tokenization import load_tokenizer, tokenize_conversation
from tests.helpers import REPO, stage_env

def run_stage_script(script: str, cfg_path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / script), "--config", str(cfg_path), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=stage_env())
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.vllm
def test_prepare_then_generate_on_real_vllm(vllm_server, tiny_target_dir, run_dir, write_config):
    cfg_path = write_config({
        "target": {"model": str(tiny_target_dir)},
        "data": {"source": str(REPO / "data" / "sample_prompts.jsonl"), "max_samples": 64, "eval_fraction": 0.1,
                 "max_user_turns": 2},
        "generate": {"base_url": vllm_server.base_url, "concurrency": 32, "timeout_s": 300, "max_tokens": 192,
                     "temperature": 0.7},
        "tokenize": {"max_seq_len": 1024},
    })
    run_stage_script("01_prepare_data.py", cfg_path)
    gen = run_stage_script("01b_generate_synthetic.py", cfg_path)
    # 01b prints the KV capacity vLLM reports; it matches the bytes per token our planner computes for this
    # target (common/serving/sizing.py) against the 1 GiB CPU KV space the server was given
    from transformers import AutoConfig

    from common.serving.sizing import GIB, kv_bytes_per_token

    kv_tokens = int(re.search(r"KV cache holds ([\d,]+) tokens", gen.stdout).group(1).replace(",", ""))
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(tiny_target_dir))
    assert GIB - 1024 * per_token < kv_tokens * per_token <= GIB, (kv_tokens, per_token)
    data = run_dir / "data"
    prompts = list(iter_jsonl(data / "prompts.jsonl"))
    raw = list(iter_jsonl(data / "raw_responses.jsonl"))
    assert len(prompts) == 64
    assert sorted(r["id"] for r in raw) == sorted(p["id"] for p in prompts)  # each exactly once
    assert not (data / "failed.jsonl").exists() or list(iter_jsonl(data / "failed.jsonl")) == []

    report = json.loads((data / "generate_report.json").read_text())
    assert report["tokenizer_check"] == "match" and report["complete"] is True
    print(f"\n01b on vLLM: {report['this_run']['elapsed_s']}s, {report['this_run']['completion_tokens_per_s']} tok/s, "
          f"{report['this_run']['requests_per_s']} req/s; {gen.stdout.strip()}")

    # Multi-turn prompts were answered turn by turn; the reasoning parser split <think> off.
    prompt_by_id = {p["id"]: p for p in prompts}
    for row in raw:
        users = [m for m in prompt_by_id[row["id"]]["messages"] if m["role"] == "user"]
        assistants = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(assistants) == len(users) == len(row["turns"])
        for m in assistants:  # (a weakly trained model may emit a stray </think> later in its answer)
            assert not m["content"].startswith(("<think>", "\n")) and not m.get("reasoning", "").startswith("\n")
    with_reasoning = sum(bool(r["reasoning"]) for r in raw)
    assert with_reasoning >= len(raw) // 2, f"only {with_reasoning}/{len(raw)} responses had reasoning split off"
    assert any(len(r["turns"]) == 2 for r in raw)

    # Tokenized samples: ids are the template's, masks cover exactly the assistant turns.
    tok = load_tokenizer(str(tiny_target_dir))
    samples = list(iter_jsonl(data / "train.jsonl")) + list(iter_jsonl(data / "eval.jsonl"))
    assert sorted(s["id"] for s in samples) == sorted(r["id"] for r in raw)
    assert {s["id"] for s in iter_jsonl(data / "eval.jsonl")} == {p["id"] for p in prompts if p["split"] == "eval"}
    raw_by_id = {r["id"]: r for r in raw}
    for s in samples:
        messages = raw_by_id[s["id"]]["messages"]
        ids = tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert s["input_ids"] == list(ids)[: len(s["input_ids"])]
        masked = tok.decode([t for t, m in zip(s["input_ids"], s["loss_mask"]) if m], skip_special_tokens=False)
        want = "".join(
            (f"<think>\n{m['reasoning']}\n</think>\n\n" if m.get("reasoning") else "") + m["content"] + "<|im_end|>"
            for m in messages if m["role"] == "assistant"
        )
        assert masked == want[: len(masked)] and (len(s["input_ids"]) < len(ids) or masked == want)

    # A rerun finds everything complete.
    again = run_stage_script("01b_generate_synthetic.py", cfg_path)
    assert "already complete" in again.stdout


@pytest.mark.vllm
def test_masked_text_is_what_vllm_generated(vllm_server, tiny_target_dir):
    """For answers that closed their reasoning and ended with <|im_end|>, the tokens our mask
    marks decode to exactly the text of the tokens vLLM generated: the reasoning split, the
    newline normalization and the template re-rendering round-trip. (Token ids can differ where
    the model sampled a non-canonical split of the same text, which re-tokenization
    canonicalizes; an answer that never closes </think> cannot round-trip, the template closes
    it: 01b counts those as turn_flags.reasoning_not_closed.)"""
    from openai import OpenAI

    tok = load_tokenizer(str(tiny_target_dir))
    client = OpenAI(base_url=vllm_server.base_url, api_key="EMPTY", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    questions = ["What is 12 plus 30?", "Write a haiku about the moon.", "What is the capital of France?",
                 "Write a Python function that reverses a string.", "Explain gravity.", "Solve for x: 3x + 4 = 19.",
                 "What is 25% of 80?", "Tell me a fun fact about the octopus."]
    checked = same_ids = 0
    for q in questions:
        messages = [{"role": "user", "content": q}]
        resp = client.chat.completions.create(model=model, messages=messages, max_tokens=256, temperature=0.0,
                                              extra_body={"return_token_ids": True})
        choice = resp.choices[0]
        generated = list((choice.model_extra or {}).get("token_ids") or [])
        assert generated, "vLLM did not return token_ids"
        turn = parse_completion(resp)
        reasoning, content = normalize_turn(turn["reasoning"], turn["content"])
        if choice.finish_reason != "stop" or (reasoning and not content):
            continue
        answer = {"role": "assistant", "content": content} | ({"reasoning": reasoning} if reasoning else {})
        sample = tokenize_conversation(tok, messages + [answer], 4096)
        masked = [t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m]
        assert tok.decode(masked, skip_special_tokens=False) == tok.decode(generated, skip_special_tokens=False), q
        assert generated[-1] == masked[-1] == tok.convert_tokens_to_ids("<|im_end|>")
        checked += 1
        same_ids += masked == generated
    assert checked >= 3
    print(f"\nround trip: {checked} answers, text identical in all, token ids identical in {same_ids}")


@pytest.mark.vllm
def test_token_ids_from_server_on_real_vllm(vllm_server, tiny_target_dir, run_dir, write_config):
    """tokenize.token_ids_from=server on a real vLLM: each turn's prompt_token_ids are the chat
    template's ids for the messages sent, the completion ids decode to exactly the generated
    text (reasoning and content as the reasoning parser split them), and a sample is the last
    turn's prompt (loss 0) + completion (loss 1)."""
    from common.core.config import load_config
    from common.data.generate import run_stage

    questions = ["What is 12 plus 30?", "Write a haiku about the moon.", "What is the capital of France?",
                 "Write a Python function that reverses a string.", "Explain gravity.", "Solve for x: 3x + 4 = 19.",
                 "What is 25% of 80?", "Tell me a fun fact about the octopus."]
    prompts = []
    for i in range(16):
        messages = [{"role": "user", "content": questions[i % 8]}]
        if i % 6 == 1:
            messages.append({"role": "user", "content": "Can you explain that more simply?"})
        prompts.append({"id": f"q{i:02d}", "messages": messages, "split": "eval" if i % 8 == 0 else "train"})
    (run_dir / "data").mkdir()
    (run_dir / "data" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    cfg = load_config(write_config({
        "target": {"model": str(tiny_target_dir)},
        "generate": {"base_url": vllm_server.base_url, "concurrency": 16, "timeout_s": 120, "max_tokens": 64,
                     "temperature": 0.7},
        "tokenize": {"max_seq_len": 1024, "token_ids_from": "server"},
    }))
    assert run_stage(cfg) == 0
    data = run_dir / "data"
    report = json.loads((data / "generate_report.json").read_text())
    assert report["complete"] is True and report["tokenizer_check"] == "match"
    raw = {r["id"]: r for r in iter_jsonl(data / "raw_responses.jsonl")}
    assert sorted(raw) == [p["id"] for p in prompts]

    tok = load_tokenizer(str(tiny_target_dir))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turns_checked = closed = 0
    for row in raw.values():
        users = [i for i, m in enumerate(row["messages"]) if m["role"] == "user"]
        assert len(users) == len(row["turns"])
        for at, turn in zip(users, row["turns"]):
            sent = row["messages"][: at + 1]  # what the request carried (history with its reasoning)
            want = tok.apply_chat_template(sent, add_generation_prompt=True, tokenize=True)
            assert turn["prompt_token_ids"] == list(want["input_ids"] if hasattr(want, "keys") else want), row["id"]
            ids = turn["completion_token_ids"]
            assert len(ids) == turn["usage"]["completion_tokens"]
            # The reasoning parser split `<think>R</think>C`; the ids hold exactly that text.
            text = tok.decode(ids, skip_special_tokens=True)
            text = text[len("<think>"):] if text.startswith("<think>") else text
            reasoning, sep, content = text.partition("</think>")
            assert (reasoning, content) == (turn["reasoning"], turn["content"]), row["id"]
            if turn["finish_reason"] == "stop":
                assert ids[-1] == im_end  # the stop token is generated, and learned
            turns_checked += 1
            closed += bool(sep)
    assert turns_checked == 16 + sum(len(p["messages"]) == 2 for p in prompts) and closed >= turns_checked // 2

    samples = list(iter_jsonl(data / "train.jsonl")) + list(iter_jsonl(data / "eval.jsonl"))
    assert sorted(s["id"] for s in samples) == sorted(raw)
    for s in samples:
        last = raw[s["id"]]["turns"][-1]
        p, c = last["prompt_token_ids"], last["completion_token_ids"]
        assert s["input_ids"] == p + c and s["loss_mask"] == [0] * len(p) + [1] * len(c)
