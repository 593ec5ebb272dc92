"""A tiny target LLM the project builds locally: tokenizer, model, chat template, brief training.

Nothing is downloaded. The embedded default pipeline, the tests and the demo serve this model
with a real vLLM (CPU build), so it has the files a real chat model has:

- tokenizer.json + tokenizer_config.json: a byte-level BPE (vocab 2048) trained with `tokenizers`
  on the project's own synthetic chat corpus, special tokens `<|endoftext|>` (pad), `<|im_start|>`,
  `<|im_end|>` (eos for chat), `<think>`, `</think>` and a Qwen3-style chat template;
- config.json + model.safetensors (float32) + generation_config.json (eos = <|im_end|>, <|endoftext|>).

Families: "llama" (LlamaForCausalLM, 4 layers, hidden 128), "qwen3" (Qwen3ForCausalLM, same size,
head_dim 32) and "deepseek_v3" (DeepseekV3ForCausalLM, tiny MLA + MoE shaped like Kimi-K2.5 / DeepSeek-V3:
the Kimi-shaped proxy of the end-to-end test).

Why train: a randomly initialised target has near-uniform logits and a draft head learns nothing
that generalises from it (docs/design.md#the-tiny-target). So llama and qwen3 are trained briefly (plain AdamW, CPU) on
a deterministic synthetic chat corpus (common.demo.chat_corpus): templated questions (math, code, writing,
facts, reasoning, multi-turn) with templated, structured answers that start with a `<think>` reasoning part.
The trained model answers in that format, e.g. `<think>\\n...\\n</think>\\n\\nHere is ...<|im_end|>`.

The same generator writes the embedded sample dataset (common.demo.chat_corpus.sample_prompt_rows), so
the prompts the pipeline sends are in the target's distribution.

Cost, measured on the 2-core dev machine: the default llama (or qwen3) build trains 1000 steps of
8 x 256 tokens, about 320 CPU-seconds (0.32 s/step on one core, so about 5.5 min on one thread)
plus about 5 s for corpus and tokenizer, and ends at a training loss of 0.24 (from 7.70). On an
idle 2-core machine it trains with 2 threads, which should take about 3 min; that was not measured
because the dev machine was never idle. On a busy machine it uses 1 thread (see training_threads).
deepseek_v3 trains DEEPSEEK_STEPS (300) steps: its MoE layers cost about 1.3 s/step on a busy core, so
about 6.5 min (untrained, --no-train: about 3 s). `ensure_tiny_target` builds once into
${EAGLE3_CACHE:-~/.cache/eagle3-pipeline}/tiny-targets/<family>-<hash>/ and reuses it; the hash
covers this file and chat_corpus.py (the corpus), so editing either triggers one rebuild. A manifest beside each
cached build (common/demo/cache_manifest.py) records its files' sizes and sha256, and every use checks it: a
damaged cached build is built (or copied) again.

CLI:
    python -m common.demo.tiny_target --family llama --out DIR       # build into DIR
    python -m common.demo.tiny_target --family llama --print-path    # build into the cache (once), print the path
    python -m common.demo.tiny_target --family llama --ship          # (re)write the shipped copy, data/tiny-targets/

The default llama build (the demo's and the tests' target) is also shipped in the repository,
data/tiny-targets/llama/ (5 MB): `ensure_tiny_target` copies it into the cache instead of training, so
a newcomer's demo does not wait minutes for it. Its build.json records what it was built from (the
sha256 of this file and chat_corpus.py, the parameters) and the size and sha256 of each of its files; an
edit of either file leaves it unused (and tests/demo/test_tiny_target.py failing until `--ship` rewrites
it). Each file is checked against build.json as it is copied: a damaged one is refused (restore it with
git), never cached. Library versions are recorded but not matched: a newer torch loads the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from common.core.errors import PipelineError, printable
from common.demo import chat_corpus
from common.demo.cache_manifest import file_record, forget, reusable, same_file, write_manifest
from common.demo.chat_corpus import conversation_messages, make_conversation

FAMILIES = ("llama", "qwen3", "deepseek_v3")
SHIPPED = Path(__file__).resolve().parents[2] / "data" / "tiny-targets"  # default builds kept in the repository
VOCAB_SIZE = 2048
MAX_POSITION_EMBEDDINGS = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Training defaults of the embedded target (the cache key includes them).
DEFAULT_STEPS = 1000
DEEPSEEK_STEPS = 300  # enough for structured answers; its MoE makes a step ~2.5x a llama step
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 256
DEFAULT_LR = 3e-3
CORPUS_CONVERSATIONS = 4000

# Qwen3-style: one block per message; an assistant message with reasoning gets a think block.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- elif message['content'] -%}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') -%}"
    "{%- else -%}{%- set content = '' -%}{%- endif -%}"
    "{%- set reasoning = message.get('reasoning') or message.get('reasoning_content') or '' -%}"
    "{%- if message['role'] == 'assistant' and reasoning -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


# ---------------------------------------------------------------------------------------------
# Training corpus (common.demo.chat_corpus)
# ---------------------------------------------------------------------------------------------

def training_conversations(n: int = CORPUS_CONVERSATIONS, seed: int = 0) -> list[list[dict]]:
    """The deterministic training corpus of the tiny target: n conversations as message lists."""
    rng = random.Random(f"tiny-target-corpus-{seed}")
    return [conversation_messages(make_conversation(rng)) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def _tokenizer_training_texts(conversations: list[list[dict]]) -> Iterator[str]:
    # Raw message texts (no template markup), so no merge ever spans a special token.
    for messages in conversations:
        for m in messages:
            yield m["role"] + "\n"
            yield m["content"]
            if m.get("reasoning"):
                yield m["reasoning"]


def build_tokenizer(conversations: list[list[dict]], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE trained on the corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0..4, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_training_texts(conversations), trainer=trainer)
    # Like Qwen3: the chat markers are special (skipped when decoding with skip_special_tokens),
    # the think markers are ordinary added tokens (kept in decoded text, parsed by reasoning parsers).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[:3]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS[3:]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_POSITION_EMBEDDINGS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _portable_tokenizer_config(out: Path) -> None:
    """Make tokenizer_config.json readable by older transformers too (vLLM on a GPU cluster may
    pin 4.x): the generic fast-tokenizer class and the chat template inline."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def model_config(family: str, vocab_size: int, pad_id: int, eos_id: int):
    """The transformers config of a tiny target of `family`."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=MAX_POSITION_EMBEDDINGS, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=pad_id, bos_token_id=None, eos_token_id=eos_id,
        initializer_range=0.02,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, head_dim=32, **common)
        cfg.architectures = ["LlamaForCausalLM"]
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(num_key_value_heads=2, head_dim=32, **common)
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif family == "deepseek_v3":
        # Tiny MLA + MoE: layer 0 dense, layers 1-3 with 8 routed experts (2 per token) + 1 shared.
        # The latent cache keeps DeepSeek-V3's real width, kv_lora_rank 512 + rope 64 = 576: vLLM's CPU
        # MLA kernel is compiled for that size only (cpu_mla.py get_supported_head_sizes).
        cfg = transformers.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
            kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, num_mtp_layers=0,
            # What DeepSeek-V3's own config.json says and transformers implements (sigmoid router with a
            # correction bias); vLLM reads these two keys to build the same router (else it has no bias).
            topk_method="noaux_tc", scoring_func="sigmoid",
            **common,
        )
        cfg.architectures = ["DeepseekV3ForCausalLM"]
    else:
        raise ValueError(f"unknown tiny target family '{family}'; choose one of {', '.join(FAMILIES)}")
    return cfg


def default_steps(family: str) -> int:
    return DEEPSEEK_STEPS if family == "deepseek_v3" else DEFAULT_STEPS


def _token_stream(tokenizer, conversations: list[list[dict]]) -> list[int]:
    """All conversations rendered with the chat template, separated by <|endoftext|>."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    return ids


def train_model(model, stream: list[int], *, steps: int, seed: int = 0, batch_size: int = DEFAULT_BATCH_SIZE,
                seq_len: int = DEFAULT_SEQ_LEN, lr: float = DEFAULT_LR, progress: bool = True) -> list[float]:
    """Plain AdamW next-token training on random windows of `stream`; returns the loss of every step."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    data = torch.tensor(stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, min(50, steps // 10))
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="train tiny target", disable=not progress, mininterval=2.0)
    for step in bar:
        # Linear warmup, then cosine decay to 10% of the peak.
        frac = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * frac
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        window = torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=window[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    return losses


def training_threads() -> int:
    """2 threads on an idle machine, 1 when it is busy: with more runnable threads than cores,
    OpenMP spin-waiting makes 2 threads several times slower than 1 (measured here). The
    result does not depend on it (1 and 2 threads gave bit-identical weights here).
    EAGLE3_TINY_THREADS overrides."""
    if os.environ.get("EAGLE3_TINY_THREADS"):
        return max(1, int(os.environ["EAGLE3_TINY_THREADS"]))
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return 2 if cores >= 2 and busy + 2 <= cores + 0.5 else 1


@contextlib.contextmanager
def _torch_threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_tiny_target(out_dir: str | os.PathLike, family: str = "llama", train: bool | None = None, steps: int | None = None,
                      seed: int = 0, dtype: str = "float32", num_conversations: int = CORPUS_CONVERSATIONS,
                      progress: bool = True) -> dict:
    """Build a tiny target into `out_dir` (created; existing files are overwritten). Returns build info.

    train: None = train (every family).
    steps: training steps (None = default_steps(family)). Deterministic for a given (family, steps, seed).
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny target family '{family}'; choose one of {', '.join(FAMILIES)}")
    train = True if train is None else train
    steps = default_steps(family) if steps is None else steps
    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    conversations = training_conversations(num_conversations, seed=seed)
    tokenizer = build_tokenizer(conversations)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = model_config(family, len(tokenizer), pad_id, eos_id)

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    info: dict[str, Any] = {"family": family, "seed": seed, "trained": bool(train), "steps": steps if train else 0,
                            "num_parameters": sum(p.numel() for p in model.parameters())}
    if train and steps > 0:
        stream = _token_stream(tokenizer, conversations)
        threads, t_train = training_threads(), time.time()
        with _torch_threads(threads):
            losses = train_model(model, stream, steps=steps, seed=seed, progress=progress)
        tail = losses[-min(20, len(losses)):]
        info.update(corpus_tokens=len(stream), first_loss=losses[0], final_loss=sum(tail) / len(tail),
                    train_threads=threads, train_seconds=round(time.time() - t_train, 1))

    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None, do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out)
    info["build_seconds"] = round(time.time() - t0, 1)
    (out / "tiny_target_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------

def cache_root_dir(cache_root: str | os.PathLike | None = None) -> Path:
    base = cache_root or os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3-pipeline"
    return Path(base).expanduser() / "tiny-targets"


def build_recipe(family: str, train: bool | None = None, steps: int | None = None, seed: int = 0) -> dict:
    """What a build depends on: this file (the builder) and chat_corpus.py (the corpus), by sha256, and the
    parameters."""
    train = True if train is None else train
    steps = default_steps(family) if steps is None else steps
    code = hashlib.sha256(Path(__file__).read_bytes() + Path(chat_corpus.__file__).read_bytes()).hexdigest()
    return {"code_sha256": code, "family": family, "train": train, "steps": steps if train else 0, "seed": seed}


def build_key(family: str, train: bool | None = None, steps: int | None = None, seed: int = 0) -> str:
    """`<family>-<hash>`: the hash covers the build's recipe and the library versions."""
    import tokenizers
    import torch
    import transformers

    params = build_recipe(family, train, steps, seed) | {
        "versions": [torch.__version__, transformers.__version__, tokenizers.__version__]}
    return f"{family}-{hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]}"


def shipped_build(family: str, train: bool | None = None, steps: int | None = None, seed: int = 0) -> Path | None:
    """The build kept in the repository for these parameters and this code, if there is one."""
    shipped = SHIPPED / family
    try:
        recorded = json.loads((shipped / "build.json").read_text(encoding="utf-8"))
        files = recorded.pop("files")
        listed = all(isinstance(f["size"], int) and isinstance(f["sha256"], str) for f in files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return shipped if listed and recorded == build_recipe(family, train, steps, seed) else None


def copy_shipped(shipped: Path, dest: Path) -> None:
    """Copy the files the shipped build's build.json lists into dest, each checked (the copy) against its recorded
    size and sha256: a damaged file of the repository is refused, never cached, so restoring it is enough."""
    files = json.loads((shipped / "build.json").read_text(encoding="utf-8"))["files"]
    for name, recorded in sorted(files.items()):
        src = shipped / name
        if src.is_file():
            shutil.copy2(src, dest / name)
        wrong = same_file(dest / name, recorded)
        if wrong is not None:
            repo = shipped.parents[2]  # <repo>/data/tiny-targets/<family>
            raise PipelineError(f"the shipped tiny target file {src} does not match its build.json ({wrong}); restore "
                                f"it with `git -C {shlex.quote(str(repo))} checkout -- "
                                f"{shlex.quote(src.relative_to(repo).as_posix())}` and rerun")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_tiny_target(family: str = "llama", cache_root: str | os.PathLike | None = None, *, train: bool | None = None,
                       steps: int | None = None, seed: int = 0, progress: bool = True) -> Path:
    """The cached tiny target of `family`, built on first use, built again when a file of it is damaged. Safe when
    processes race.

    The build happens in a temp dir next to the final one, renamed into place when complete, then recorded
    (its manifest); a lock file keeps a second process from building the same thing at the same time.
    """
    root = cache_root_dir(cache_root)
    key = build_key(family, train, steps, seed)
    final = root / key
    if reusable(final, then="building it again"):
        return final
    with _file_lock(root / f".{key}.lock"):
        if reusable(final, then=None):  # another process finished while we waited
            return final
        for stale in root.glob(f".tmp-{key}-*"):  # left by a build that crashed
            shutil.rmtree(stale, ignore_errors=True)
        forget(final)
        if final.exists():  # incomplete (no manifest) or damaged: rebuild
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        shipped = shipped_build(family, train, steps, seed)
        try:
            if shipped is not None:  # the same recipe, built once and kept in the repository
                copy_shipped(shipped, tmp)
                info = {"build_seconds": 0.0}
            else:
                info = build_tiny_target(tmp, family=family, train=train, steps=steps, seed=seed, progress=progress)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "tiny_target_info.json").is_file():
                    raise
                # Someone without the lock (another filesystem) won the race: keep theirs (they record it).
            else:
                write_manifest(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    how = f"copied the shipped build {shipped}" if shipped is not None else f"built in {info['build_seconds']:.0f}s"
    print(f"tiny target {family}: {final}: {how}", file=sys.stderr)
    return final


def ship(family: str) -> Path:
    """Write the default build of `family` (from the cache, built there if needed) to SHIPPED/<family>/ with the
    recipe it was built from and each file's size and sha256 (build.json)."""
    built = ensure_tiny_target(family)
    dest = SHIPPED / family
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(built, dest)
    files = {p.name: file_record(p) for p in sorted(dest.iterdir())}
    (dest / "build.json").write_text(json.dumps(build_recipe(family) | {"files": files}, indent=2) + "\n",
                                     encoding="utf-8")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.demo.tiny_target", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--out", help="build into this directory (always builds)")
    parser.add_argument("--print-path", action="store_true", help="build into the cache if needed and print its path")
    parser.add_argument("--ship", action="store_true", help="write the default build to data/tiny-targets/ (commit it)")
    parser.add_argument("--cache-root", help="cache base directory (default: $EAGLE3_CACHE or ~/.cache/eagle3-pipeline)")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS}, deepseek_v3 {DEEPSEEK_STEPS})")
    parser.add_argument("--no-train", action="store_true", help="keep the random initialisation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train = False if args.no_train else None
    if not (args.out or args.ship or args.print_path):
        parser.error("pass --out DIR, --print-path or --ship")
    try:
        if args.out:
            print(json.dumps(build_tiny_target(args.out, family=args.family, train=train, steps=args.steps, seed=args.seed)))
        elif args.ship:
            print(ship(args.family))
        else:
            print(ensure_tiny_target(args.family, args.cache_root, train=train, steps=args.steps, seed=args.seed))
    except PipelineError as e:  # a damaged file of the shipped build
        print(f"error: {printable(str(e))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
