"""A tiny checkpoint in Kimi-K2.5's own layout, built locally in a few seconds.

What the real moonshotai/Kimi-K2.5 directory has, in miniature (docs/design.md#the-tiny-target):

- config.json: the multimodal wrapper (`architectures: ["KimiK25ForConditionalGeneration"]`,
  `model_type: "kimi_k25"`) with `auto_map` pointing at its own configuration/modeling files, a
  `text_config` (model_type "kimi_k2": a DeepSeek-V3-style MLA + MoE language model; here 4 layers,
  hidden 128, layer 0 dense, layers 1-3 with 8 routed experts + 1 shared, the MLA widths of
  tiny_target.py's deepseek_v3 family) and a `vision_config` (a 1-block MoonViT-shaped tower);
- configuration_kimi_k25.py / modeling_kimi_k25.py: loaded by transformers only with
  trust_remote_code=True. The language model is transformers' own DeepseekV3ForCausalLM under
  `language_model`; `vision_tower` and `mm_projector` are small modules that text never runs;
- model.safetensors: tensors named `language_model.model.layers.N...`,
  `language_model.model.embed_tokens.weight`, `language_model.lm_head.weight`, `vision_tower.*`,
  `mm_projector.*` (the vision names follow the real checkpoint: `encoder.blocks.N.wqkv`,
  `mm_projector.proj.0`, ...);
- tokenization_kimi.py + tiktoken.model + tokenizer_config.json: a slow TikTokenTokenizer (remote
  code, needs the `tiktoken` package) over a byte-level BPE of 768 ranks trained here on the tiny
  target's chat corpus, plus 256 reserved special ids at the same offsets as Kimi's (base + 0 = [BOS],
  + 1 = [EOS], + 2 = <|im_end|>, + 3 = <|im_user|>, + 4 = <|im_assistant|>, + 10 = <|im_system|>,
  + 17 = <|im_middle|>, + 21 = <|media_pad|>, + 22 = <think>, + 23 = </think>, ...): vocab 1024;
- chat_template.jinja: Kimi's shape: `<|im_user|>user<|im_middle|>...<|im_end|>` with no newlines,
  a default system prompt, the generation prompt `<|im_assistant|>assistant<|im_middle|><think>`,
  reasoning rendered only for assistant turns after the last user turn (earlier ones get
  `<think></think>`), `thinking=False` closes the think block at once;
- generation_config.json: eos <|im_end|> (the tokenizer's eos is [EOS], as in Kimi);
- preprocessor_config.json: the media settings vLLM's Kimi-K2.5 processor reads (small limits).

Weights are random (seeded, initializer_range 0.1 so every layer changes the residual stream), with
the embedding and lm_head drawn at std 1 (`peaked`) so the teacher is sharp (mean top-1 probability
about 0.8) and its top-1 depends mostly on the current token: a draft learns that in a few steps
(tests/helpers.make_target does the same for its Llama). Set `peaked=False` for the plain init.

The vision_config carries both Kimi-K2.5's legacy keys (vt_hidden_size, init_pos_emb_height, ...)
and the current transformers/vLLM schema keys (hidden_size, pos_emb_height, ...): vLLM reads
Kimi-K2.5's config through transformers' Kimi_K25Config, whose defaults are the real tower's sizes.

CLI: python -m common.demo.tiny_kimi_k25 --out DIR
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path

BASE_VOCAB = 768            # BPE ranks (256 single bytes + merges)
NUM_RESERVED_SPECIAL = 256  # Kimi reserves 256 ids after the BPE ranks
VOCAB_SIZE = BASE_VOCAB + NUM_RESERVED_SPECIAL
NUM_LAYERS = 4
HIDDEN = 128
AUX_LAYER_IDS = [1, 2, 3]
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Special tokens by offset from the first id after the BPE ranks, as in Kimi-K2.5's tokenizer_config.json.
# True = special (skipped by skip_special_tokens); the think markers stay in decoded text for reasoning parsers.
SPECIAL_TOKENS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True), 6: ("<|start_header_id|>", True), 7: ("<|end_header_id|>", True),
    9: ("[EOT]", True), 10: ("<|im_system|>", True), 11: ("<|tool_calls_section_begin|>", True),
    12: ("<|tool_calls_section_end|>", True), 13: ("<|tool_call_begin|>", True), 14: ("<|tool_call_argument_begin|>", True),
    15: ("<|tool_call_end|>", True), 17: ("<|im_middle|>", True), 18: ("<|media_begin|>", True),
    19: ("<|media_content|>", True), 20: ("<|media_end|>", True), 21: ("<|media_pad|>", True),
    22: ("<think>", False), 23: ("</think>", False), 254: ("[UNK]", True), 255: ("[PAD]", True),
}

# The pre-tokenizer pattern of the tiny tokenizer (Kimi's keeps Han runs together and splits digits
# in threes, like this one).
PAT_STR = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

CHAT_TEMPLATE = (
    "{%- macro text(m) -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] -%}{%- for p in m['content'] -%}{%- if p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ text(m) }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ text(m) }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>{{ text(m) }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user -%}<think>{{ m.get('reasoning_content') or m.get('reasoning') or '' }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ text(m) }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

CONFIGURATION_MODULE = '''\
"""Kimi-K2.5's wrapper config in miniature (written by common/demo/tiny_kimi_k25.py)."""

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25VisionConfig(PretrainedConfig):
    model_type = "kimi_k25_vision"

    def __init__(self, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, merge_kernel_size=(2, 2),
                 hidden_act="gelu_pytorch_tanh", **kwargs):
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.patch_size = patch_size
        self.pos_emb_height = pos_emb_height
        self.pos_emb_width = pos_emb_width
        self.pos_emb_time = pos_emb_time
        self.merge_kernel_size = list(merge_kernel_size)
        self.hidden_act = hidden_act
        super().__init__(**kwargs)


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"
    sub_configs = {"text_config": DeepseekV3Config, "vision_config": KimiK25VisionConfig}

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=None, **kwargs):
        if isinstance(text_config, dict):
            text_config = {k: v for k, v in text_config.items() if k not in ("model_type", "auto_map")}
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        if isinstance(vision_config, dict):
            vision_config = KimiK25VisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
        self.vision_config = vision_config if vision_config is not None else KimiK25VisionConfig()
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(**kwargs)
'''

MODELING_MODULE = '''\
"""Kimi-K2.5's wrapper model in miniature (written by common/demo/tiny_kimi_k25.py): the language model
is transformers' DeepseekV3ForCausalLM under `language_model`; a small MoonViT-shaped vision tower and
projector hold `vision_tower.*` / `mm_projector.*`. Text forward passes never touch them."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

from .configuration_kimi_k25 import KimiK25Config


class PatchEmbed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.proj = nn.Conv2d(3, c.hidden_size, kernel_size=c.patch_size, stride=c.patch_size)
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(torch.zeros(c.pos_emb_height, c.pos_emb_width, c.hidden_size))


class MLP2(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden)
        self.fc1 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c.num_attention_heads
        self.norm0 = nn.LayerNorm(c.hidden_size)
        self.norm1 = nn.LayerNorm(c.hidden_size)
        self.wqkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.wo = nn.Linear(c.hidden_size, c.hidden_size)
        self.mlp = MLP2(c.hidden_size, c.intermediate_size)

    def forward(self, x):  # x: [n, D], one image (no rotary: a stand-in, never run for text)
        q, k, v = self.wqkv(self.norm0(x)).view(x.shape[0], 3, self.heads, -1).permute(1, 2, 0, 3)
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(x.shape))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(c.hidden_size)


class MoonViT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.patch_embed = PatchEmbed(c)
        self.encoder = VisionEncoder(c)

    def forward(self, patches):  # patches: [n, 3, p, p] of one image, n a multiple of 4
        x = self.patch_embed.proj(patches).flatten(1)
        for block in self.encoder.blocks:
            x = block(x)
        return self.encoder.final_layernorm(x)


class Projector(nn.Module):
    def __init__(self, c, text_hidden):
        super().__init__()
        merged = c.hidden_size * c.merge_kernel_size[0] * c.merge_kernel_size[1]
        self.merged = merged
        self.pre_norm = nn.LayerNorm(c.hidden_size)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, text_hidden))

    def forward(self, x):
        return self.proj(self.pre_norm(x).view(-1, self.merged))


class KimiK25PreTrainedModel(PreTrainedModel):
    config_class = KimiK25Config
    base_model_prefix = "language_model"
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _supports_sdpa = True


class KimiK25ForConditionalGeneration(KimiK25PreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.vision_tower = MoonViT(config.vision_config)
        self.mm_projector = Projector(config.vision_config, config.text_config.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def image_features(self, patches):
        return self.mm_projector(self.vision_tower(patches))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, pixel_values=None, **kwargs):
        if pixel_values is not None:
            raise NotImplementedError("the tiny Kimi-K2.5 checkpoint runs text only")
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                                   use_cache=use_cache, **kwargs)
'''

TOKENIZER_MODULE = '''\
"""A TikToken tokenizer in the shape of Kimi-K2.5's tokenization_kimi.py (written by
common/demo/tiny_kimi_k25.py): a slow transformers tokenizer (no offset mappings) over a tiktoken BPE
file, `tiktoken.model`, with 256 reserved special ids after the BPE ranks. Needs `tiktoken`; loaded
with trust_remote_code=True."""

import os
import shutil

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode  # as Kimi's newer tokenization files

PAT_STR = {pat_str!r}
NUM_RESERVED_SPECIAL = {num_reserved}


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {{"vocab_file": "tiktoken.model"}}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]",
                 added_tokens_decoder=None, **kwargs):
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        names = {{int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {{}}).items()}}
        self.special_tokens = {{names.get(i, "<|reserved_token_%d|>" % i): i for i in range(base, base + NUM_RESERVED_SPECIAL)}}
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {{c: b for b, c in self.byte_encoder.items()}}
        self.decoder = {{i: "".join(self.byte_encoder[b] for b in tok) for tok, i in ranks.items()}}
        self.encoder = {{s: i for i, s in self.decoder.items()}}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return {{**self.encoder, **self.special_tokens}}

    def _tokenize(self, text, **kwargs):
        # Special tokens were split off by the added-tokens trie: encode what is left as plain text.
        return [self.decoder[i] for i in self.model.encode(text, disallowed_special=())]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.special_tokens.get(token, self.unk_token_id))

    def _convert_id_to_token(self, index):
        if index in self.decoder:
            return self.decoder[index]
        return next((s for s, i in self.special_tokens.items() if i == index), self.unk_token)

    def convert_tokens_to_string(self, tokens):
        return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)

    def apply_chat_template(self, conversation, tools=None, tokenize=False, add_generation_prompt=True, **kwargs):
        # Kimi's tokenizer renders to text and adds the generation prompt unless told otherwise.
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
'''.format(pat_str=PAT_STR, num_reserved=NUM_RESERVED_SPECIAL)


def special_token_id(name: str) -> int:
    """The id of one of SPECIAL_TOKENS' names in the tiny checkpoint's vocabulary."""
    return BASE_VOCAB + next(off for off, (n, _) in SPECIAL_TOKENS.items() if n == name)


def train_tiktoken_ranks(texts: list[str], base_vocab: int = BASE_VOCAB) -> dict[bytes, int]:
    """A byte-level BPE trained with `tokenizers` on `texts`, as tiktoken mergeable ranks:
    the 256 single bytes at ranks 0..255 (byte order), then the merged tokens in merge order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # tokenizers' ByteLevel alphabet

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=base_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        raw = bytes(char_to_byte[c] for c in token)
        if raw not in ranks:
            ranks[raw] = len(ranks)
    return ranks


def write_tiktoken_file(ranks: dict[bytes, int], path: Path) -> None:
    """tiktoken's BPE file format: one `base64(token bytes) rank` per line, by rank."""
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _tokenizer_texts(num_conversations: int, seed: int) -> list[str]:
    from common.demo.tiny_target import training_conversations

    texts = []
    for messages in training_conversations(num_conversations, seed=seed):
        for m in messages:
            texts.append(m["content"])
            if m.get("reasoning"):
                texts.append(m["reasoning"])
    return texts + ["system user assistant tool " + DEFAULT_SYSTEM_PROMPT]


def text_config_dict(vocab_size: int = VOCAB_SIZE) -> dict:
    """The language model's config as Kimi-K2.5 writes it (model_type kimi_k2, DeepSeek-V3 keys)."""
    from common.demo.tiny_target import model_config

    cfg = model_config("deepseek_v3", vocab_size, special_token_id("[PAD]"), special_token_id("[EOS]")).to_dict()
    for key in ("transformers_version", "dtype", "torch_dtype", "_name_or_path", "output_hidden_states", "return_dict"):
        cfg.pop(key, None)
    cfg.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], bos_token_id=special_token_id("[BOS]"),
               eos_token_id=special_token_id("[EOS]"), pad_token_id=special_token_id("[PAD]"),
               tie_word_embeddings=False, dtype="float32",
               # Large enough that every layer moves the residual stream (0.4 relative per layer,
               # attention or not): a capture one layer off is far from the right one.
               initializer_range=0.1)
    return cfg


def vision_config_dict() -> dict:
    # Kimi-K2.5's legacy keys first, then the current schema that transformers/vLLM read.
    legacy = {"vt_hidden_size": 32, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 2, "vt_intermediate_size": 64,
              "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4, "mm_hidden_size": 32,
              "text_hidden_size": HIDDEN, "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu",
              "projector_ln_eps": 1e-5, "pos_emb_type": "divided_fixed", "video_attn_type": "spatial_temporal",
              "merge_type": "sd2_tpool"}
    current = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
               "patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 4,
               "merge_kernel_size": [2, 2], "hidden_act": "gelu_pytorch_tanh"}
    return {**legacy, **current}


def wrapper_config_dict() -> dict:
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "model_type": "kimi_k25",
        "bos_token_id": special_token_id("[BOS]"),
        "eos_token_id": special_token_id("[EOS]"),
        "pad_token_id": special_token_id("[PAD]"),
        "media_placeholder_token_id": special_token_id("<|media_pad|>"),
        "image_token_id": special_token_id("<|media_pad|>"),
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "dtype": "float32",
        "text_config": text_config_dict(),
        "vision_config": vision_config_dict(),
    }


def preprocessor_config_dict() -> dict:
    """Kimi-K2.5's media preprocessing settings (what vLLM's Kimi-K2.5 processor reads), with small
    patch limits. The real file also maps AutoImageProcessor to the model's own processor code, which
    is not shipped here: vLLM uses its built-in (numba) processor for Kimi-K2.5."""
    return {"media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "temporal_merge_kernel_size": 4,
                               "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "in_patch_limit": 256,
                               "patch_limit_on_one_side": 32, "in_patch_limit_each_frame": 256, "in_patch_limit_video": None,
                               "fixed_output_tokens": None, "sample_fps": 2.0, "max_num_frames_each_video": None,
                               "timestamp_mode": "hh:mm:ss.fff"}}


def tokenizer_config_dict() -> dict:
    return {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        # The chat/tool/media markers (not the think markers) are skipped by skip_special_tokens.
        "additional_special_tokens": [name for _, (name, special) in sorted(SPECIAL_TOKENS.items())
                                      if special and name not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")],
        "added_tokens_decoder": {
            str(BASE_VOCAB + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                    "single_word": False, "special": special}
            for off, (name, special) in sorted(SPECIAL_TOKENS.items())
        },
    }


def build_tiny_kimi_k25(out_dir, seed: int = 0, peaked: bool = True, num_conversations: int = 1500) -> dict:
    """Write the tiny Kimi-K2.5-layout checkpoint into `out_dir` (created; files overwritten). Returns build info."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    ranks = train_tiktoken_ranks(_tokenizer_texts(num_conversations, seed))
    if len(ranks) != BASE_VOCAB:
        raise RuntimeError(f"the tiny BPE has {len(ranks)} ranks, expected {BASE_VOCAB}; train on more text")
    write_tiktoken_file(ranks, out / "tiktoken.model")
    (out / "tokenization_kimi.py").write_text(TOKENIZER_MODULE, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_dict(), indent=2) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config_dict(), indent=2) + "\n", encoding="utf-8")

    (out / "configuration_kimi_k25.py").write_text(CONFIGURATION_MODULE, encoding="utf-8")
    (out / "modeling_kimi_k25.py").write_text(MODELING_MODULE, encoding="utf-8")
    (out / "config.json").write_text(json.dumps(wrapper_config_dict(), indent=2) + "\n", encoding="utf-8")
    im_end, eos = special_token_id("<|im_end|>"), special_token_id("[EOS]")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": special_token_id("[BOS]"), "eos_token_id": im_end, "pad_token_id": special_token_id("[PAD]"),
         "do_sample": False}, indent=2) + "\n", encoding="utf-8")

    # The weights: the model class from the files just written (what trust_remote_code loads).
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32)
    if peaked:
        with torch.no_grad():
            lm = model.language_model
            lm.model.embed_tokens.weight.normal_(0.0, 1.0)
            lm.lm_head.weight.normal_(0.0, 1.0)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tensors = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"), metadata={"format": "pt"})
    info = {"layout": "kimi_k25", "seed": seed, "peaked": peaked, "vocab_size": VOCAB_SIZE, "num_layers": NUM_LAYERS,
            "num_parameters": sum(p.numel() for p in model.parameters()), "num_tensors": len(tensors),
            "eos_ids": [im_end, eos], "build_seconds": round(time.time() - t0, 1)}
    (out / "tiny_target_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.demo.tiny_kimi_k25", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="build into this directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peak", action="store_true", help="plain random init (no scaled embedding / lm_head)")
    args = parser.parse_args(argv)
    print(json.dumps(build_tiny_kimi_k25(args.out, seed=args.seed, peaked=not args.no_peak)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
