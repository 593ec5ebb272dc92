"""Shared pytest fixtures.

- tiny_target_dir (session): the tiny Llama target in the cache (the shipped build, data/tiny-targets/llama; common/demo/tiny_target.py);
  EAGLE3_TINY_TARGET_DIR=DIR uses an already built one instead.
- vllm_server (session): one real vLLM server on the tiny target for the whole test session,
  on a free loopback port, with the <think> reasoning parser; stopped at the end. Tests that use
  it must be marked `vllm`.
- hidden_run (session): helpers.build_run's data set (target, tokenized data, hidden states,
  vocab map), built once and cloned by the tests that train on it.
- run_dir: a fresh run directory; write_config: writes a config YAML for a test run.
- build_chat_tokenizer / build_slow_chat_tokenizer: small tokenizers with a given chat template
  (fast; or slow remote code, the shape of Kimi-K2.5's); KIMI_LIKE_TEMPLATE.
- one_torch_thread: one intra-op thread for the test's duration.
- all_cores: every core for the test's duration (each xdist worker is otherwise pinned to its own: see
  pin_this_worker_to_its_cores).

REPO and stage_env (a stage's subprocess environment) are in tests/helpers.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.helpers import worker_cores

# The reasoning parser that splits the tiny target's `<think>\n...\n</think>\n\n` output.
TINY_REASONING_PARSER = "deepseek_r1"


def pin_this_worker_to_its_cores() -> None:
    """Give each pytest-xdist worker its own share of the cores, for itself and every process it starts.

    vLLM-CPU binds its OpenMP threads to the cores the process may use, and they spin between kernels. Two
    workers on the same cores each start servers and stages on all of them, and each ran up to 5x slower
    (2026-12-07: the Kimi-shaped proxy's test took 1437 s beside another, 205 s alone). Pinned, every worker
    is a machine of its own. EAGLE3_TEST_PIN=0 leaves the cores shared."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or os.environ.get("EAGLE3_TEST_PIN", "1") == "0":
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return
    os.environ["EAGLE3_TEST_ALL_CORES"] = ",".join(map(str, cores))
    os.sched_setaffinity(0, worker_cores(cores, int(worker[2:]) % count, count))


pin_this_worker_to_its_cores()


@pytest.fixture
def all_cores(monkeypatch):
    """Every core of the machine for this test and what it starts (vLLM-CPU with tensor parallel 2 needs a core per
    rank), whatever its xdist worker was pinned to. The thread binding an in-process engine sets in os.environ is
    undone with it."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    mine = os.sched_getaffinity(0)
    if os.environ.get("EAGLE3_TEST_ALL_CORES"):
        os.sched_setaffinity(0, {int(c) for c in os.environ["EAGLE3_TEST_ALL_CORES"].split(",")})
    yield
    os.sched_setaffinity(0, mine)


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    # EAGLE3_TINY_TARGET_DIR points the tests at an already built target (debugging, CI caches).
    if os.environ.get("EAGLE3_TINY_TARGET_DIR"):
        return Path(os.environ["EAGLE3_TINY_TARGET_DIR"])
    from common.demo.tiny_target import ensure_tiny_target

    return ensure_tiny_target("llama")


@pytest.fixture(scope="session")
def vllm_server(tiny_target_dir, tmp_path_factory):
    from common.serving.vllm_server import VllmServer

    log_dir = tmp_path_factory.mktemp("vllm-server")
    server = VllmServer(
        tiny_target_dir,
        port=0,
        max_model_len=2048,
        reasoning_parser=TINY_REASONING_PARSER,
        log_path=log_dir / "server.log",
        startup_timeout_s=600,
    )
    with server:
        yield server


TOKENIZER_CORPUS = [
    "Hello world, this is a small corpus about numbers 1 2 3 and some ünïcödé text.",
    "The user wants the sum of 12 and 30. So the answer is 42.",
    "Here is a haiku about the moon: quiet light over the sea.",
    "system user assistant What is the capital of France? Paris is the capital.",
    "Answer to turn Thinking about: Write a Python function that reverses a string.",
] * 20


def build_chat_tokenizer(out_dir, template: str | None = None, special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                         added=("<think>", "</think>"), eos: str = "<|im_end|>", bos: str | None = None) -> Path:
    """A small byte-level BPE saved as a transformers fast tokenizer (tokenizer files only).

    Default: the tiny target's chat template and token setup (chat markers special, think
    markers ordinary added tokens), without training a model: quick enough for unit tests.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if template is None:
        from common.demo.tiny_target import CHAT_TEMPLATE as template
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=list(special) + list(added), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, chat_template=template).save_pretrained(out_dir)
    return Path(out_dir)


# A slow tokenizer (no offset mappings) shipped as model code, loaded with trust_remote_code:
# the shape of Kimi-K2.5's TikToken tokenizer, over the same BPE as build_chat_tokenizer.
SLOW_TOKENIZER_MODULE = '''\
# A slow tokenizer (pure-Python interface, no offset mappings) over a byte-level BPE, loaded
# with trust_remote_code like Kimi-K2.5's TikToken tokenizer. Written by tests/conftest.py.

import json
import os
import shutil

from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizer


class SlowBPETokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "slow_bpe.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, **kwargs):
        self.vocab_file = vocab_file
        self._bpe = Tokenizer.from_file(vocab_file)
        self._vocab = self._bpe.get_vocab(with_added_tokens=True)
        self._ids_to_tokens = {i: t for t, i in self._vocab.items()}
        added = json.load(open(vocab_file, encoding="utf-8")).get("added_tokens", [])
        kwargs.setdefault("added_tokens_decoder", {
            a["id"]: AddedToken(a["content"], special=a["special"], normalized=False, lstrip=False, rstrip=False)
            for a in added
        })
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self._vocab)

    def get_vocab(self):
        return dict(self._vocab)

    def _tokenize(self, text, **kwargs):
        return self._bpe.encode(text, add_special_tokens=False).tokens

    def _convert_token_to_id(self, token):
        return self._vocab[token]

    def _convert_id_to_token(self, index):
        return self._ids_to_tokens[index]

    def convert_tokens_to_string(self, tokens):
        return self._bpe.decoder.decode(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "slow_bpe.json")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
'''

# Kimi-K2.5's chat template in miniature: no newlines between turns, the generation prompt
# ends with <think>, and every assistant turn is rendered as <think></think>content (its
# reasoning stripped), so the template cannot reproduce what the model generated.
# Like the real Qwen3 template: reasoning is only rendered for the last assistant message.
DROPS_OLD_REASONING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning') and loop.last -%}"
    "{{- '<think>\\n' + message['reasoning'] + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


KIMI_LIKE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_assistant|>assistant<|im_middle|><think></think>' + message['content'] + '<|im_end|>' -}}"
    "{%- else -%}"
    "{{- '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' + message['content'] + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|><think>' -}}{%- endif -%}"
)
KIMI_LIKE_SPECIAL = ("<|endoftext|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")

# SmolLM2-135M-Instruct's template (Llama-3.1 and Mistral are alike in this): ChatML with a default system
# turn and no reasoning part; the model has no <think> token.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A generation prompt that ends inside a word ("...\nA"): a reply that continues the word
# ("nswer") merges into one token with it, so its tokens cannot be located.
PROMPT_ENDS_MID_WORD_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{- '<|im_start|>assistant\\nA' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\nA' -}}{%- endif -%}"
)


def build_slow_chat_tokenizer(out_dir, template: str | None = None, special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                              added=("<think>", "</think>"), eos: str = "<|im_end|>", bos: str | None = None) -> Path:
    """build_chat_tokenizer's tokenizer as a slow, remote-code tokenizer (load it with
    trust_remote_code=True): same ids, no offset mappings, is_fast False."""
    import json

    out_dir = build_chat_tokenizer(out_dir, template, special, added, eos, bos)
    (out_dir / "tokenizer.json").rename(out_dir / "slow_bpe.json")
    (out_dir / "slow_bpe_tokenizer.py").write_text(SLOW_TOKENIZER_MODULE, encoding="utf-8")
    config = json.loads((out_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("backend", None)
    config["tokenizer_class"] = "SlowBPETokenizer"
    config["auto_map"] = {"AutoTokenizer": ["slow_bpe_tokenizer.SlowBPETokenizer", None]}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out_dir


@pytest.fixture(scope="session")
def hidden_run(tmp_path_factory) -> Path:
    """tests/helpers.build_run, built once: tiny target, tokenized data, hidden states, vocab map.
    Returns its config; tests copy it (helpers.clone_run) and never write into it."""
    from tests.helpers import build_run

    return build_run(tmp_path_factory.mktemp("hidden-run"))


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer-only 'model' directory with the tiny target's chat template."""
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"))


@pytest.fixture
def run_dir(tmp_path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


def deep_update(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            deep_update(base[k], v)
        else:
            base[k] = v
    return base


@pytest.fixture
def write_config(run_dir):
    """write_config({"generate": {...}, ...}, name="config.yaml") -> Path of a YAML config whose
    run_dir is the test's run_dir (unless the tree sets one)."""

    def write(tree: dict | None = None, name: str = "config.yaml") -> Path:
        full = deep_update({"run_dir": str(run_dir)}, dict(tree or {}))
        path = run_dir.parent / name
        path.write_text(yaml.safe_dump(full, sort_keys=False), encoding="utf-8")
        return path

    return write


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: one intra-op thread is faster and immune to other processes on the machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
