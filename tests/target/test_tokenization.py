"""Chat-template tokenization with loss masks (common/target/tokenization.py).

Every branch: reasoning + content, empty content with reasoning, no reasoning, multi-turn,
system prompts, truncation (inside the assistant span, before it), drop, empty assistant, no
assistant; a second template family (Llama-3 style: BOS, other end-of-turn token, reasoning
under `reasoning_content`); and templates that break the assumptions (DataError).
The checks compare against the tokenizer itself: ids == apply_chat_template(tokenize=True),
decode(tokens with mask 1) == the rendered assistant text. A slow tokenizer (remote code, no
offset mappings, the shape of Kimi-K2.5's) gives exactly what the fast path gives. Server ids
(tokenize_server_ids): prompt masked 0, completion 1, truncate/drop counted.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import (
    DROPS_OLD_REASONING_TEMPLATE,
    KIMI_LIKE_SPECIAL,
    KIMI_LIKE_TEMPLATE,
    PROMPT_ENDS_MID_WORD_TEMPLATE,
    build_chat_tokenizer,
    build_slow_chat_tokenizer,
)

from common.core.errors import DataError
from common.demo.tiny_target import CHAT_TEMPLATE as QWEN_STYLE_TEMPLATE
from common.target.tokenization import (
    TokenBoundaryError,
    load_tokenizer,
    stop_token_ids,
    tokenize_conversation,
    tokenize_server_ids,
)

LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') -%}"
    "{{- '<think>' + message['reasoning_content'] + '</think>' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


IGNORES_REASONING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tokenizer(out_dir, template: str, special: list[str], added: list[str], eos: str, bos: str | None = None):
    return load_tokenizer(str(build_chat_tokenizer(out_dir, template, special, added, eos, bos)))


def build_slow_tokenizer(out_dir, template: str, special: list[str], added: list[str], eos: str, bos: str | None = None):
    tok = load_tokenizer(str(build_slow_chat_tokenizer(out_dir, template, special, added, eos, bos)), trust_remote_code=True)
    assert not tok.is_fast
    return tok


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
THINK = ["<think>", "</think>"]


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    """The tiny target's template and special-token setup (chat markers special, think markers not)."""
    return build_tokenizer(tmp_path_factory.mktemp("qwen"), QWEN_STYLE_TEMPLATE,
                           ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"], eos="<|im_end|>")


@pytest.fixture(scope="module")
def llama3_tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("llama3"), LLAMA3_STYLE_TEMPLATE,
                           ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                           ["<think>", "</think>"], eos="<|eot_id|>", bos="<|begin_of_text|>")


def template_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def masked_runs(tok, sample) -> list[str]:
    """Decoded text of each contiguous run of mask-1 tokens."""
    runs, cur = [], []
    for t, m in zip(sample["input_ids"], sample["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def unmasked_text(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if not m], skip_special_tokens=False)


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER1 = {"role": "user", "content": "What is 12 plus 30?"}
USER2 = {"role": "user", "content": "Are you sure about that?"}
ANSWER1 = {"role": "assistant", "content": "12 + 30 = 42\n\nThe answer is **42**.",
           "reasoning": "The user wants the sum of 12 and 30.\n12 + 30 = 42."}
ANSWER2 = {"role": "assistant", "content": "Yes, 12 + 30 = 42.", "reasoning": "Check again: 42."}


def test_single_turn_reasoning_and_content(qwen_tok):
    messages = [SYSTEM, USER1, ANSWER1]
    stats = Counter()
    sample = tokenize_conversation(qwen_tok, messages, 4096, stats=stats)
    assert sample["input_ids"] == template_ids(qwen_tok, messages)
    assert len(sample["loss_mask"]) == len(sample["input_ids"])
    assert masked_runs(qwen_tok, sample) == [
        "<think>\n" + ANSWER1["reasoning"] + "\n</think>\n\n" + ANSWER1["content"] + "<|im_end|>"
    ]
    # System, user, the role header and the newline after <|im_end|> are not learned.
    assert unmasked_text(qwen_tok, sample) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 12 plus 30?<|im_end|>\n"
        "<|im_start|>assistant\n\n"
    )
    assert sample["loss_mask"][-1] == 0 and sample["loss_mask"][-2] == 1
    assert qwen_tok.convert_ids_to_tokens(sample["input_ids"][-2]) == "<|im_end|>"
    assert stats == Counter(kept=1)


def test_empty_content_with_reasoning(qwen_tok):
    messages = [USER1, {"role": "assistant", "content": "", "reasoning": "Only thinking, cut off."}]
    sample = tokenize_conversation(qwen_tok, messages, 4096)
    assert sample["input_ids"] == template_ids(qwen_tok, messages)
    assert masked_runs(qwen_tok, sample) == ["<think>\nOnly thinking, cut off.\n</think>\n\n<|im_end|>"]


def test_reasoning_only_message_without_content_key(qwen_tok):
    messages = [USER1, {"role": "assistant", "content": None, "reasoning": "Hmm."}]
    sample = tokenize_conversation(qwen_tok, messages, 4096)
    assert masked_runs(qwen_tok, sample) == ["<think>\nHmm.\n</think>\n\n<|im_end|>"]


def test_no_reasoning(qwen_tok):
    messages = [USER1, {"role": "assistant", "content": "42."}]
    sample = tokenize_conversation(qwen_tok, messages, 4096)
    assert sample["input_ids"] == template_ids(qwen_tok, messages)
    assert masked_runs(qwen_tok, sample) == ["42.<|im_end|>"]


def test_reasoning_content_key_is_read(qwen_tok):
    via_content_key = [USER1, {"role": "assistant", "content": "42.", "reasoning_content": "Sum."}]
    via_reasoning = [USER1, {"role": "assistant", "content": "42.", "reasoning": "Sum."}]
    a = tokenize_conversation(qwen_tok, via_content_key, 4096)
    b = tokenize_conversation(qwen_tok, via_reasoning, 4096)
    assert a == b
    assert masked_runs(qwen_tok, a) == ["<think>\nSum.\n</think>\n\n42.<|im_end|>"]


def test_multi_turn_masks_each_assistant_turn(qwen_tok):
    messages = [SYSTEM, USER1, ANSWER1, USER2, ANSWER2]
    sample = tokenize_conversation(qwen_tok, messages, 4096)
    assert sample["input_ids"] == template_ids(qwen_tok, messages)
    assert masked_runs(qwen_tok, sample) == [
        "<think>\n" + ANSWER1["reasoning"] + "\n</think>\n\n" + ANSWER1["content"] + "<|im_end|>",
        "<think>\n" + ANSWER2["reasoning"] + "\n</think>\n\n" + ANSWER2["content"] + "<|im_end|>",
    ]
    assert "Are you sure about that?" in unmasked_text(qwen_tok, sample)


def test_truncation_inside_assistant_span(qwen_tok):
    messages = [USER1, ANSWER1]
    full = tokenize_conversation(qwen_tok, messages, 4096)
    first_loss = full["loss_mask"].index(1)
    cut = first_loss + 5  # five tokens into the assistant turn
    stats = Counter()
    sample = tokenize_conversation(qwen_tok, messages, cut, "truncate", stats=stats)
    assert sample["input_ids"] == full["input_ids"][:cut]
    assert sample["loss_mask"] == full["loss_mask"][:cut]
    assert sum(sample["loss_mask"]) == 5
    assert stats == Counter(truncated=1, kept=1)


def test_truncation_before_assistant_leaves_nothing_to_learn(qwen_tok):
    messages = [SYSTEM, USER1, ANSWER1]
    full = tokenize_conversation(qwen_tok, messages, 4096)
    cut = full["loss_mask"].index(1)  # everything before the first generated token
    stats = Counter()
    assert tokenize_conversation(qwen_tok, messages, cut, "truncate", stats=stats) is None
    assert stats == Counter(truncated=1, no_loss_tokens=1)


def test_drop_overlong(qwen_tok):
    messages = [USER1, ANSWER1]
    n = len(tokenize_conversation(qwen_tok, messages, 4096)["input_ids"])
    stats = Counter()
    assert tokenize_conversation(qwen_tok, messages, n - 1, "drop", stats=stats) is None
    assert stats == Counter(dropped_overlong=1)
    assert len(tokenize_conversation(qwen_tok, messages, n, "drop", stats=stats)["input_ids"]) == n  # exactly fits
    with pytest.raises(ValueError):
        tokenize_conversation(qwen_tok, messages, n, "cut")


def test_empty_assistant_and_no_assistant_are_counted_skips(qwen_tok):
    stats = Counter()
    assert tokenize_conversation(qwen_tok, [USER1, {"role": "assistant", "content": ""}], 4096, stats=stats) is None
    assert tokenize_conversation(qwen_tok, [USER1, {"role": "assistant", "content": "  \n", "reasoning": ""}], 4096, stats=stats) is None
    assert tokenize_conversation(qwen_tok, [SYSTEM, USER1], 4096, stats=stats) is None
    assert stats == Counter(empty_assistant=2, no_assistant=1)


def test_other_template_family_llama3_style(llama3_tok):
    """Generic, not hard-coded: BOS in the template, <|eot_id|> ends a turn, no newline after
    it, reasoning rendered only from `reasoning_content` (we set both keys)."""
    messages = [SYSTEM, USER1, ANSWER1, USER2, ANSWER2]
    sample = tokenize_conversation(llama3_tok, messages, 4096)
    as_template_expects = [
        {"role": m["role"], "content": m["content"], "reasoning_content": m.get("reasoning", "")} for m in messages
    ]
    assert sample["input_ids"] == template_ids(llama3_tok, as_template_expects)
    assert masked_runs(llama3_tok, sample) == [
        "<think>" + ANSWER1["reasoning"] + "</think>" + ANSWER1["content"] + "<|eot_id|>",
        "<think>" + ANSWER2["reasoning"] + "</think>" + ANSWER2["content"] + "<|eot_id|>",
    ]
    assert sample["loss_mask"][0] == 0 and llama3_tok.convert_ids_to_tokens(sample["input_ids"][0]) == "<|begin_of_text|>"
    assert sample["loss_mask"][-1] == 1  # <|eot_id|> is the last token: nothing after it


def test_template_that_rewrites_history_is_rejected(tmp_path):
    tok = build_tokenizer(tmp_path, DROPS_OLD_REASONING_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                          ["<think>", "</think>"], eos="<|im_end|>")
    # Single turn is fine: the only assistant turn is the last one.
    assert tokenize_conversation(tok, [USER1, ANSWER1], 4096) is not None
    with pytest.raises(DataError, match="not prefix-stable"):
        tokenize_conversation(tok, [USER1, ANSWER1, USER2, ANSWER2], 4096)


def test_template_that_ignores_reasoning_is_rejected(tmp_path):
    tok = build_tokenizer(tmp_path, IGNORES_REASONING_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                          ["<think>", "</think>"], eos="<|im_end|>")
    assert masked_runs(tok, tokenize_conversation(tok, [USER1, {"role": "assistant", "content": "42."}], 4096)) == ["42.<|im_end|>"]
    with pytest.raises(DataError, match="does not render assistant reasoning"):
        tokenize_conversation(tok, [USER1, ANSWER1], 4096)


def test_stop_token_ids_include_generation_config(qwen_tok, tmp_path):
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    eot = qwen_tok.convert_tokens_to_ids("<|endoftext|>")
    assert stop_token_ids(qwen_tok) == {im_end}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    assert stop_token_ids(qwen_tok, str(tmp_path)) == {im_end, eot}


def test_without_a_stop_token_the_whole_span_is_learned(qwen_tok):
    sample = tokenize_conversation(qwen_tok, [USER1, {"role": "assistant", "content": "42."}], 4096, stop_ids=set())
    assert masked_runs(qwen_tok, sample) == ["42.<|im_end|>\n"]


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="cannot load the target tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE())).save_pretrained(tmp_path / "plain")
    with pytest.raises(DataError, match="no chat_template"):
        load_tokenizer(str(tmp_path / "plain"))


# ----------------------------------------------------------------------------- slow tokenizers


CONVERSATIONS = [
    [SYSTEM, USER1, ANSWER1],
    [USER1, {"role": "assistant", "content": "", "reasoning": "Only thinking, cut off."}],
    [USER1, {"role": "assistant", "content": "42."}],
    [SYSTEM, USER1, ANSWER1, USER2, ANSWER2],
    [USER1, {"role": "assistant", "content": "ünïcödé 漢字 🙂 and  two  spaces\n\n", "reasoning": " lead space"}],
]


@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_slow_tokenizer_gives_what_the_fast_path_gives(tmp_path, family):
    """No offset mappings (Kimi's TikToken tokenizer has none): token-prefix matching finds the
    same ids and the same mask, truncation and counts included."""
    if family == "qwen":
        args = (QWEN_STYLE_TEMPLATE, QWEN_SPECIAL, THINK, "<|im_end|>")
    else:
        args = (LLAMA3_STYLE_TEMPLATE, LLAMA3_SPECIAL, THINK, "<|eot_id|>", "<|begin_of_text|>")
    fast = build_tokenizer(tmp_path / "fast", *args)
    slow = build_slow_tokenizer(tmp_path / "slow", *args)
    assert fast.is_fast and not slow.is_fast
    for messages in CONVERSATIONS:
        want = tokenize_conversation(fast, messages, 4096)
        assert tokenize_conversation(slow, messages, 4096) == want, messages
        assert sum(want["loss_mask"]) > 0
        cut = want["loss_mask"].index(1) + 2
        fast_stats, slow_stats = Counter(), Counter()
        assert (tokenize_conversation(slow, messages, cut, stats=slow_stats)
                == tokenize_conversation(fast, messages, cut, stats=fast_stats))
        assert slow_stats == fast_stats == Counter(truncated=1, kept=1)
    # Same stop-token trimming: the newline after <|im_end|> is template text.
    if family == "qwen":
        assert masked_runs(slow, tokenize_conversation(slow, CONVERSATIONS[2], 4096)) == ["42.<|im_end|>"]


def test_slow_tokenizer_token_merging_across_the_reply_boundary_is_rejected(tmp_path):
    """A generation prompt ending inside a word ("...\\nA") whose reply continues it ("nswer"):
    the tokens up to the reply are not a prefix of the tokens through it."""
    slow = build_slow_tokenizer(tmp_path / "slow", PROMPT_ENDS_MID_WORD_TEMPLATE, QWEN_SPECIAL, THINK, "<|im_end|>")
    fast = build_tokenizer(tmp_path / "fast", PROMPT_ENDS_MID_WORD_TEMPLATE, QWEN_SPECIAL, THINK, "<|im_end|>")
    fine = [USER1, {"role": "assistant", "content": " 42."}]
    assert masked_runs(slow, tokenize_conversation(slow, fine, 4096)) == [" 42.<|im_end|>"]
    assert tokenize_conversation(fast, fine, 4096) == tokenize_conversation(slow, fine, 4096)
    merging = [USER1, {"role": "assistant", "content": "nswer to turn 1"}]
    with pytest.raises(TokenBoundaryError, match="not a fast tokenizer.*token merges across.*token_ids_from=server"):
        tokenize_conversation(slow, merging, 4096)
    with pytest.raises(TokenBoundaryError, match="straddles.*token merges across.*token_ids_from=server"):  # fast agrees
        tokenize_conversation(fast, merging, 4096)


def test_kimi_like_template_cannot_be_reproduced_from_text(tmp_path):
    """Kimi-K2.5's template renders <think></think> for the reply it re-renders: from text alone
    the reasoning cannot be recovered (hence tokenize.token_ids_from=server)."""
    slow = build_slow_tokenizer(tmp_path, KIMI_LIKE_TEMPLATE, list(KIMI_LIKE_SPECIAL), THINK, "<|im_end|>")
    sample = tokenize_conversation(slow, [USER1, {"role": "assistant", "content": "42."}], 4096)
    assert masked_runs(slow, sample) == ["</think>42.<|im_end|>"]  # <think> sits in the generation prompt
    with pytest.raises(DataError, match="does not render assistant reasoning"):
        tokenize_conversation(slow, [USER1, ANSWER1], 4096)


def test_load_tokenizer_remote_code_needs_trust(tmp_path):
    path = build_slow_chat_tokenizer(tmp_path)
    with pytest.raises(DataError, match="cannot load the target tokenizer.*set target.trust_remote_code=true"):
        load_tokenizer(str(path))
    assert not load_tokenizer(str(path), trust_remote_code=True).is_fast


# ----------------------------------------------------------------------------- ids from the server


def test_server_ids_prompt_masked_completion_learned():
    prompt, completion = [1, 2, 3, 4, 5], [6, 7, 8]
    stats = Counter()
    assert tokenize_server_ids(prompt, completion, 4096, stats=stats) == {
        "input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "loss_mask": [0, 0, 0, 0, 0, 1, 1, 1]}
    assert stats == Counter(kept=1)


def test_server_ids_truncate_drop_and_nothing_to_learn():
    prompt, completion = [1, 2, 3, 4, 5], [6, 7, 8]
    stats = Counter()
    assert tokenize_server_ids(prompt, completion, 7, "truncate", stats=stats) == {
        "input_ids": [1, 2, 3, 4, 5, 6, 7], "loss_mask": [0, 0, 0, 0, 0, 1, 1]}
    assert tokenize_server_ids(prompt, completion, 5, "truncate", stats=stats) is None  # only the prompt fits
    assert tokenize_server_ids(prompt, completion, 7, "drop", stats=stats) is None
    assert tokenize_server_ids(prompt, completion, 8, "drop", stats=stats)["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert tokenize_server_ids(prompt, [], 4096, stats=stats) is None
    assert stats == Counter(truncated=2, kept=2, no_loss_tokens=2, dropped_overlong=1)
    with pytest.raises(ValueError):
        tokenize_server_ids(prompt, completion, 8, "cut")
