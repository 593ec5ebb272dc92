"""Stages 01 + 01b against a real vLLM server (CPU build) serving the tiny target.

The session-scoped `vllm_server` fixture starts vLLM once (about 1.5 min on 2 cores) with the
deepseek_r1 reasoning parser, which splits the tiny target's `<think>...</think>` output.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, stage_env

from common.generate import normalize_turn, parse_completion
from common.io import iter_jsonl
from common.tokenization import load_tokenizer, tokenize_conversation

pytestmark = pytest.mark.vllm


def run_stage_script(script: str, cfg_path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / script), "--config", str(cfg_path), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=stage_env())
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc


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
        for m in assistants:
            assert "<think>" not in m["content"] and "</think>" not in m["content"]
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


def test_masked_tokens_are_the_tokens_vllm_generated(vllm_server, tiny_target_dir):
    """For answers that ended with <|im_end|>, the tokens our mask marks are exactly the token
    ids vLLM generated: the reasoning split + normalization + template re-rendering round-trips."""
    from openai import OpenAI

    tok = load_tokenizer(str(tiny_target_dir))
    client = OpenAI(base_url=vllm_server.base_url, api_key="EMPTY", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    questions = ["What is 12 plus 30?", "Write a haiku about the moon.", "What is the capital of France?",
                 "Write a Python function that reverses a string.", "Explain gravity."]
    checked = 0
    for q in questions:
        messages = [{"role": "user", "content": q}]
        resp = client.chat.completions.create(model=model, messages=messages, max_tokens=256, temperature=0.0,
                                              extra_body={"return_token_ids": True})
        choice = resp.choices[0]
        if choice.finish_reason != "stop":
            continue
        generated = list(choice.model_extra.get("token_ids") or getattr(choice, "token_ids", None) or [])
        assert generated, "vLLM did not return token_ids"
        turn = parse_completion(resp)
        reasoning, content = normalize_turn(turn["reasoning"], turn["content"])
        answer = {"role": "assistant", "content": content} | ({"reasoning": reasoning} if reasoning else {})
        sample = tokenize_conversation(tok, messages + [answer], 4096)
        masked = [t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m]
        assert masked == generated, (q, tok.decode(masked, skip_special_tokens=False), tok.decode(generated, skip_special_tokens=False))
        checked += 1
    assert checked >= 3
