"""common.serving.chat, the one chat client of 01b and 05: the request body, the clients, the
response parser. The stages' own use of it is tested in tests/data (01b against the fault server)
and tests/evaluate (05 against FakeVllm)."""

from __future__ import annotations

import pytest

from common.core.config import config_from_dict
from common.serving.chat import (
    MalformedResponse,
    chat_request,
    has_token_ids,
    make_client,
    make_clients,
    parse_completion,
    server_root,
)


def generate_config(**generate):
    return config_from_dict({"generate": generate}).generate


# ----------------------------------------------------------------------------- requests


def test_request_carries_extra_body_enable_thinking_and_token_ids():
    g = generate_config(extra_body={"top_k": 20, "chat_template_kwargs": {"custom": 1}}, enable_thinking=False)
    req = chat_request(g, "m", [{"role": "user", "content": "hi"}], max_tokens=7, temperature=0.5, top_p=0.9,
                       return_token_ids=True)
    assert req == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "temperature": 0.5,
                   "top_p": 0.9, "extra_body": {"top_k": 20, "chat_template_kwargs": {"custom": 1, "enable_thinking": False},
                                                "return_token_ids": True}}
    assert g.extra_body == {"top_k": 20, "chat_template_kwargs": {"custom": 1}}  # the config is not changed


def test_request_without_extras_sends_no_extra_body_and_the_servers_top_p():
    req = chat_request(generate_config(), "m", [], max_tokens=1, temperature=0.0)
    assert req["extra_body"] is None and "top_p" not in req


# ----------------------------------------------------------------------------- clients


def test_clients_take_the_key_from_the_named_env_var_and_size_their_pools(monkeypatch):
    import openai

    monkeypatch.setenv("EAGLE3_CHAT_TEST_KEY", "sk-chat-test")
    g = generate_config(base_url="http://127.0.0.1:9/v1", api_key_env="EAGLE3_CHAT_TEST_KEY", concurrency=200, timeout_s=12.0)
    async_client = make_client(g)
    assert isinstance(async_client, openai.AsyncOpenAI) and async_client.api_key == "sk-chat-test"
    assert str(async_client.base_url).rstrip("/") == "http://127.0.0.1:9/v1" and async_client.max_retries == 0
    assert async_client.timeout == 12.0
    blocking = make_client(g, "http://127.0.0.1:10/v1", connections=4, blocking=True, max_retries=2)
    assert isinstance(blocking, openai.OpenAI) and blocking.max_retries == 2
    assert str(blocking.base_url).rstrip("/") == "http://127.0.0.1:10/v1"
    # 200 in flight: 4 clients of 50 (at most 64 connections each, bench/RESULTS.md)
    assert len(make_clients(g)) == 4
    monkeypatch.delenv("EAGLE3_CHAT_TEST_KEY")
    assert make_client(g, blocking=True).api_key == "EMPTY"


def test_server_root():
    assert server_root("http://h:8000/v1") == server_root("http://h:8000/v1/") == "http://h:8000"
    assert server_root("http://h:8000") == "http://h:8000"


# ----------------------------------------------------------------------------- responses


def test_parse_completion_reads_both_reasoning_fields_and_rejects_malformed():
    from openai.types.chat import ChatCompletion

    def completion(message):
        return ChatCompletion.model_validate({
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
        })

    a = parse_completion(completion({"role": "assistant", "content": "C", "reasoning": "R"}))
    b = parse_completion(completion({"role": "assistant", "content": "C", "reasoning_content": "R"}))
    c = parse_completion(completion({"role": "assistant", "content": None}))
    assert a == b == {"reasoning": "R", "content": "C", "finish_reason": "stop",
                      "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    assert (c["reasoning"], c["content"]) == ("", "")
    with pytest.raises(MalformedResponse, match="not JSON"):
        parse_completion("<html>oops</html>")
    empty = completion({"role": "assistant", "content": "C"})
    empty.choices = []
    with pytest.raises(MalformedResponse, match="no choices"):
        parse_completion(empty)


def test_parse_completion_reads_vllm_token_ids():
    from openai.types.chat import ChatCompletion

    def completion(**extra):
        choice = {"index": 0, "message": {"role": "assistant", "content": "C"}, "finish_reason": "stop"}
        choice |= {k: v for k, v in extra.items() if k == "token_ids"}
        body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
        return ChatCompletion.model_validate(body | {k: v for k, v in extra.items() if k != "token_ids"})

    out = parse_completion(completion(prompt_token_ids=[1, 2, 3], token_ids=[7, 8]))
    assert out["prompt_token_ids"] == [1, 2, 3] and out["completion_token_ids"] == [7, 8]
    assert "prompt_token_ids" not in parse_completion(completion()) and "completion_token_ids" not in parse_completion(completion())
    with pytest.raises(MalformedResponse, match="token_ids is not a list of integers"):
        parse_completion(completion(prompt_token_ids=[1, 2], token_ids=["a"]))
    assert has_token_ids(out) and not has_token_ids(parse_completion(completion()))
