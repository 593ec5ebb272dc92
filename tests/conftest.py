"""Shared pytest fixtures.

- tiny_target_dir (session): the cached, briefly trained tiny Llama target (common/tiny_target.py);
  EAGLE3_TINY_TARGET_DIR=DIR uses an already built one instead.
- vllm_server (session): one real vLLM server on the tiny target for the whole test session,
  on a free loopback port, with the <think> reasoning parser; stopped at the end. Tests that use
  it must be marked `vllm`.
- run_dir: a fresh run directory; write_config: writes a config YAML for a test run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The reasoning parser that splits the tiny target's `<think>\n...\n</think>\n\n` output.
TINY_REASONING_PARSER = "deepseek_r1"


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    # EAGLE3_TINY_TARGET_DIR points the tests at an already built target (debugging, CI caches).
    if os.environ.get("EAGLE3_TINY_TARGET_DIR"):
        return Path(os.environ["EAGLE3_TINY_TARGET_DIR"])
    from common.tiny_target import ensure_tiny_target

    return ensure_tiny_target("llama")


@pytest.fixture(scope="session")
def vllm_server(tiny_target_dir, tmp_path_factory):
    from common.vllm_server import VllmServer

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
        from common.tiny_target import CHAT_TEMPLATE as template
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


def stage_env(**extra: str) -> dict:
    """Environment for running a stage script as a subprocess from the repo root."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env
