"""The EAGLE-3 draft model and its training-time-test (TTT) forward pass.

Architecture (docs/design.md#draft-architecture, identical to the official EAGLE-3 / SpecForge draft
and to vLLM's `llama_eagle3.py`):

    g = fc(concat(aux_0, aux_1, aux_2))                  # target features -> H, step 0 only
    layer 0 ("midlayer"): residual = g  (hidden_norm(g) if norm_before_residual)
        x = concat(input_layernorm(embed(token)), hidden_norm(g))        # [.., 2H], embedding first
        h = residual + o_proj(attn(q/k/v_proj(x)))
        h = h + mlp(post_attention_layernorm(h))
    layers k >= 1: ordinary pre-norm Llama decoder layers on h (vLLM PR #26164)
    logits = lm_head(norm(h))                            # [.., V_d]
    next step's g = h (the PRE-norm output; fc is not applied again)

State dict names are exactly the names of the official vLLM checkpoint format: `fc.weight`,
`midlayer.*` (layer 0), `layers.{k}.*` for k >= 1 (vLLM's `LlamaModel.layers[k]`; it maps
`midlayer.` to `layers.0.`), `norm.weight`, `lm_head.weight`, buffers `d2t` / `t2d`, and the
frozen `embed_tokens.weight` (dropped on export unless asked for).

TTT (docs/design.md#ttt-alignment-and-loss): `forward_ttt_hidden` unrolls `ttt_steps` draft steps over one packed row of
samples. At step i, index t of a sample of length L:
  - hidden input = fc(aux[t]) at step 0, else the draft's own pre-norm output of step i-1 at t;
  - token input  = x_{t+1+i} (teacher forcing; positions past the sample end get token 0 and are
    never used by a valid position);
  - RoPE position = position_ids[t] + i;
  - attention: step-0 keys at s <= t of the same sample, plus the keys of steps 1..i at index t.
The output at (i, t) is the prediction of x_{t+2+i}; it is meaningful iff t+2+i <= L-1.

Attention implementations (`model.attention_impl`):
  - "chunked" (default, exact on CPU and GPU): queries in chunks of `attn_chunk_size`; per chunk,
    scores against the step-0 keys of the samples the chunk touches (block-causal mask) plus one
    elementwise "diagonal" score per earlier step, a joint fp32 softmax, and the weighted sum.
    Each chunk is checkpointed when gradients are needed, so the backward pass keeps only
    q/k/v and outputs, never the [heads, T, T] probabilities of all chunks at once.
  - "flex" (experimental): torch flex_attention over the concatenated step KV with a block mask,
    compiled on CUDA. Checked against "naive" on CPU in eager mode (forward only); not run on CUDA yet.
  - "naive": the reference: the full (steps*T) x (steps*T) mask, plain softmax attention.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common.core.errors import ConfigError, DataError

OFFICIAL_ARCHITECTURE = "LlamaForCausalLMEagle3"


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class DraftModelConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    vocab_size: int  # target vocab
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # vLLM convention; their order is the order of the aux concat
    norm_before_residual: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "num_hidden_layers", "vocab_size", "draft_vocab_size",
                     "target_hidden_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"draft config {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"draft num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size ({self.draft_vocab_size}) is larger than the target vocab "
                f"({self.vocab_size}); set vocab.draft_vocab_size <= {self.vocab_size}"
            )
        self.aux_layer_ids = [int(k) for k in self.aux_layer_ids]
        if not self.aux_layer_ids or len(set(self.aux_layer_ids)) != len(self.aux_layer_ids):
            raise ConfigError(
                f"aux_layer_ids must be a non-empty list of distinct layer ids, got {self.aux_layer_ids} "
                f"(vLLM collapses duplicates)"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"draft hidden_act '{self.hidden_act}' is not supported; use one of {sorted(_ACTIVATIONS)}")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def to_vllm_config(self, **extra) -> dict:
        """config.json of the official EAGLE-3 format that vLLM loads (docs/design.md#vllm-checkpoint-format).

        RoPE is written in the legacy `rope_theta` / `rope_scaling` form, which transformers 4.x
        reads directly and transformers 5.x converts into `rope_parameters`.
        """
        ids = list(self.aux_layer_ids)
        d = {
            "architectures": [OFFICIAL_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "attention_bias": False,
            "mlp_bias": False,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "num_aux_hidden_states": len(ids),
            "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            "norm_before_residual": self.norm_before_residual,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
        }
        d.update(extra)
        if "eagle_aux_hidden_state_layer_ids" in extra:  # keep every copy of the ids consistent
            ids = [int(k) for k in extra["eagle_aux_hidden_state_layer_ids"]]
            if len(ids) != self.num_aux:
                raise ConfigError(f"eagle_aux_hidden_state_layer_ids {ids} has {len(ids)} ids, but the draft's fc "
                                  f"reads {self.num_aux} aux layers ({self.aux_layer_ids})")
            d["eagle_aux_hidden_state_layer_ids"] = ids
            d["eagle_config"] = {**d["eagle_config"], "eagle_aux_hidden_state_layer_ids": ids}
        return d

    @classmethod
    def from_vllm_config(cls, d: dict) -> "DraftModelConfig":
        """Inverse of `to_vllm_config`; also reads speculators-format configs and
        transformers-5 `rope_parameters`."""
        d = dict(d)
        top = d
        if "transformer_layer_config" in d:  # speculators format
            d = {**d["transformer_layer_config"], **{k: v for k, v in d.items() if k != "transformer_layer_config"}}
            if "norm_before_residual" not in top:
                d["norm_before_residual"] = True  # vLLM's default for this format (docs/design.md#draft-architecture)
        eagle_config = d.get("eagle_config") or {}
        ids = d.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            raise ConfigError("draft config has no eagle_aux_hidden_state_layer_ids; cannot tell which target layers it reads")
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        params = d.get("rope_parameters")
        if rope_theta is None and isinstance(params, dict):
            rope_theta = params.get("rope_theta")
            if rope_scaling is None and params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            num_hidden_layers=int(d.get("num_hidden_layers", 1)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            aux_layer_ids=list(ids),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            hidden_act=d.get("hidden_act", "silu"),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _text_attr(tc, name: str, default=None):
    value = getattr(tc, name, None)
    if value is None and name == "rope_theta":  # transformers >= 5 keeps it in rope_parameters
        rp = getattr(tc, "rope_parameters", None) or {}
        value = rp.get("rope_theta") if isinstance(rp, dict) else None
    return default if value is None else value


# What each rope type needs (transformers' and vLLM's names); the other keys they read are optional.
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "longrope": ("short_factor", "long_factor")}
_ROPE_KEYS = {"rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate", "low_freq_factor", "high_freq_factor", "short_factor",
              "long_factor"}


def _target_rope_scaling(tc) -> dict | None:
    scaling = getattr(tc, "rope_scaling", None)
    params = getattr(tc, "rope_parameters", None)  # transformers >= 5 keeps the scaling here, with rope_theta
    if not scaling and isinstance(params, dict) and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return dict(scaling) if scaling else None


def draft_rope_scaling(asked, tc) -> dict | None:
    """draft.rope_scaling resolved: None, the target's scaling ("target"), or the mapping given; in the form
    vLLM's get_rope and transformers read ({"rope_type": ..., ...}), checked so a bad one is one line here and
    not a KeyError when vLLM loads the draft."""
    if asked is None:
        return None
    source = "the target's rope_scaling" if asked == "target" else "draft.rope_scaling"
    scaling = _target_rope_scaling(tc) if asked == "target" else dict(asked)
    if not scaling:
        return None  # the target uses plain RoPE: so does the draft
    kind = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    kind = {"deepseek_yarn": "yarn"}.get(kind, kind)  # DeepSeek-V3/Kimi name their yarn so inside vLLM only
    if kind == "default":
        return None
    if kind not in _ROPE_REQUIRED:
        raise ConfigError(f"{source} has rope_type {kind!r}, which the draft cannot reproduce; use one of "
                          f"{sorted(_ROPE_REQUIRED)}, or set draft.rope_scaling: null")
    missing = [k for k in _ROPE_REQUIRED[kind] if k not in scaling]
    if missing:
        raise ConfigError(f"{source} ({kind}) lacks {', '.join(missing)}; give them in draft.rope_scaling, e.g. "
                          f"{{rope_type: yarn, factor: 64, original_max_position_embeddings: 4096}}")
    return {"rope_type": kind, **{k: v for k, v in scaling.items() if k in _ROPE_KEYS - {"rope_type"}}}


def build_draft_config(cfg, info, draft_vocab_size: int, aux_layer_ids: list[int]):
    """DraftModelConfig from the run config's draft section; nulls take the target's sizes."""
    d, tc = cfg.draft, info.text_config
    hidden = d.hidden_size or info.hidden_size
    if hidden != info.hidden_size:
        raise ConfigError(
            f"draft.hidden_size={hidden} differs from the target's hidden size {info.hidden_size}; the draft reads the "
            f"target's token embedding, so set draft.hidden_size to {info.hidden_size} or null"
        )
    heads = d.num_attention_heads or int(_text_attr(tc, "num_attention_heads"))
    if d.num_key_value_heads:
        kv = d.num_key_value_heads
    else:
        target_kv = int(_text_attr(tc, "num_key_value_heads", heads))
        kv = target_kv if heads % target_kv == 0 else heads
    head_dim = d.head_dim or hidden // heads
    if heads % kv != 0:
        raise ConfigError(f"draft.num_attention_heads={heads} must be a multiple of draft.num_key_value_heads={kv}")
    max_pos = d.max_position_embeddings or max(int(_text_attr(tc, "max_position_embeddings", 0)), cfg.tokenize.max_seq_len)
    if max_pos < cfg.tokenize.max_seq_len:
        raise ConfigError(
            f"draft.max_position_embeddings={max_pos} is below tokenize.max_seq_len={cfg.tokenize.max_seq_len}; "
            f"set it to at least {cfg.tokenize.max_seq_len} (or null for the target's)"
        )
    return DraftModelConfig(
        hidden_size=hidden,
        intermediate_size=d.intermediate_size or int(_text_attr(tc, "intermediate_size", 4 * hidden)),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_hidden_layers=d.num_hidden_layers,
        rms_norm_eps=float(d.rms_norm_eps or _text_attr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=float(d.rope_theta or _text_attr(tc, "rope_theta", 10000.0)),
        rope_scaling=draft_rope_scaling(d.rope_scaling, tc),
        max_position_embeddings=int(max_pos),
        vocab_size=info.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=info.hidden_size,
        aux_layer_ids=list(aux_layer_ids),
        norm_before_residual=d.norm_before_residual,
        hidden_act=str(_text_attr(tc, "hidden_act", "silu")),
    )


# --------------------------------------------------------------------------------------------
# Packed-row layout
# --------------------------------------------------------------------------------------------


@dataclass
class PackedLayout:
    """Where each token of a packed row sits: samples are concatenated back to back."""

    seq_lens: list[int]
    sample: torch.Tensor  # [T] int64, index of the token's sample
    start: torch.Tensor  # [T] int64, row index of the first token of the token's sample
    offset: torch.Tensor  # [T] int64, index within the sample
    length: torch.Tensor  # [T] int64, length of the token's sample
    starts: list[int] = field(default_factory=list)  # python copy of each sample's start

    @property
    def num_tokens(self) -> int:
        return int(sum(self.seq_lens))

    @classmethod
    def build(cls, seq_lens, num_tokens: int, device) -> "PackedLayout":
        seq_lens = [int(n) for n in seq_lens]
        if any(n < 1 for n in seq_lens) or sum(seq_lens) != num_tokens:
            raise DataError(f"seq_lens {seq_lens} must be positive and sum to the row length {num_tokens}")
        starts, acc = [], 0
        for n in seq_lens:
            starts.append(acc)
            acc += n
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
        sample = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)
        start = torch.tensor(starts, dtype=torch.long, device=device)[sample]
        offset = torch.arange(num_tokens, device=device) - start
        return cls(seq_lens, sample, start, offset, lens[sample], starts)

    def shifted(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index of the token k places later, clamped into the row; whether it is in the same sample)."""
        T = self.num_tokens
        idx = (torch.arange(T, device=self.sample.device) + k).clamp_(max=T - 1)
        return idx, self.offset + k <= self.length - 1

    def step_valid(self, step: int) -> torch.Tensor:
        """[T] bool: step `step` at t has a target inside the sample (t + 2 + step <= L - 1)."""
        return self.offset + 2 + step <= self.length - 1


def squeeze_row(x: torch.Tensor, dims: int) -> torch.Tensor:
    """Accept [T, ...] or a batch of one row [1, T, ...]."""
    if x.dim() == dims + 1:
        if x.shape[0] != 1:
            raise DataError(f"expected one packed row, got a batch of {x.shape[0]}; pack samples into one row")
        x = x[0]
    return x


# --------------------------------------------------------------------------------------------
# TTT attention
# --------------------------------------------------------------------------------------------


@dataclass
class AttentionMeta:
    layout: PackedLayout
    chunk_size: int = 512
    checkpoint_chunks: bool = True
    impl: str = "chunked"
    block_masks: dict = field(default_factory=dict)  # flex: one block mask per step count


def _attend_chunk(q, k0, v0, q_sample, k_sample, q_index, k_index, *diag):
    """Exact TTT attention for one query chunk.

    q [C, nh, d]; k0/v0 [S, nkv, d] step-0 keys of the rows [k_index[0], ...]; diag = (k_1..k_i,
    v_1..v_i) each [C, nkv, d] at the query's own index. Returns [C, nh, d].
    """
    C, nh, d = q.shape
    S, nkv, _ = k0.shape
    g = nh // nkv
    n_diag = len(diag) // 2
    scale = d**-0.5
    # GQA without repeating K: fold the g query heads of each kv head into the row dimension.
    qg = q.view(C, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * C, d)
    s0 = torch.matmul(qg, k0.permute(1, 2, 0)).float().mul_(scale).view(nkv, g, C, S)
    allowed = (q_sample[:, None] == k_sample[None, :]) & (k_index[None, :] <= q_index[:, None])
    s0 = s0.masked_fill_(~allowed, float("-inf"))
    qf = q.float().view(C, nkv, g, d)
    scores = [s0]
    for j in range(n_diag):
        kj = diag[j].float().view(C, nkv, 1, d)
        scores.append(((qf * kj).sum(-1) * scale).permute(1, 2, 0).unsqueeze(-1))  # [nkv, g, C, 1]
    p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = torch.matmul(p[..., :S].reshape(nkv, g * C, S).to(v0.dtype), v0.permute(1, 0, 2)).float()
    out = out.view(nkv, g, C, d)
    for j in range(n_diag):
        vj = diag[n_diag + j].float().view(C, nkv, d).permute(1, 0, 2).unsqueeze(1)  # [nkv, 1, C, d]
        out = out + p[..., S + j : S + j + 1] * vj
    return out.permute(2, 0, 1, 3).reshape(C, nh, d).to(q.dtype)


def chunked_ttt_attention(q, ks, vs, meta: AttentionMeta) -> torch.Tensor:
    """q [T, nh, d] of step i = len(ks) - 1; ks/vs: per-step keys/values [T, nkv, d] (after RoPE)."""
    layout = meta.layout
    T = q.shape[0]
    index = torch.arange(T, device=q.device)
    use_ckpt = meta.checkpoint_chunks and torch.is_grad_enabled() and (
        q.requires_grad or ks[0].requires_grad or vs[0].requires_grad
    )
    outs = []
    for a in range(0, T, meta.chunk_size):
        b = min(a + meta.chunk_size, T)
        lo = _sample_start_of(layout, a)
        args = (q[a:b], ks[0][lo:b], vs[0][lo:b], layout.sample[a:b], layout.sample[lo:b], index[a:b], index[lo:b],
                *[k[a:b] for k in ks[1:]], *[v[a:b] for v in vs[1:]])
        if use_ckpt:
            outs.append(checkpoint(_attend_chunk, *args, use_reentrant=False))
        else:
            outs.append(_attend_chunk(*args))
    return torch.cat(outs, dim=0)


def _sample_start_of(layout: PackedLayout, row: int) -> int:
    """First row a query at `row` may attend to: the start of its sample (python ints, no device sync)."""
    return layout.starts[bisect.bisect_right(layout.starts, row) - 1]


def build_ttt_mask(seq_lens, steps: int, device=None) -> torch.Tensor:
    """The full TTT mask over the concatenated sequence [step 0 | step 1 | ...], [(steps*T), (steps*T)] bool.

    Row (i, t) may attend column (j, s) iff j == 0 and s <= t in the same sample (the step-0
    context), or 1 <= j <= i and s == t (the query's own earlier draft steps).
    """
    seq_lens = [int(n) for n in seq_lens]
    T = sum(seq_lens)
    sample = torch.repeat_interleave(torch.arange(len(seq_lens), device=device),
                                     torch.tensor(seq_lens, device=device))
    n = torch.arange(steps * T, device=device)
    step, tok = n // T, n % T
    q_step, q_tok = step[:, None], tok[:, None]
    k_step, k_tok = step[None, :], tok[None, :]
    context = (k_step == 0) & (sample[k_tok] == sample[q_tok]) & (k_tok <= q_tok)
    own_chain = (k_step >= 1) & (k_step <= q_step) & (k_tok == q_tok)
    return context | own_chain


def naive_ttt_attention(q, ks, vs, meta_or_seq_lens) -> torch.Tensor:
    """Reference: plain softmax attention of step i's queries over all steps' keys with the full mask."""
    seq_lens = meta_or_seq_lens.layout.seq_lens if isinstance(meta_or_seq_lens, AttentionMeta) else meta_or_seq_lens
    T, nh, d = q.shape
    step = len(ks) - 1
    mask = build_ttt_mask(seq_lens, step + 1, device=q.device)[step * T:(step + 1) * T]  # rows of step i
    k = torch.cat(ks, dim=0)
    v = torch.cat(vs, dim=0)
    g = nh // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) / math.sqrt(d)
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", p, v.float()).to(q.dtype)


def flex_ttt_attention(q, ks, vs, meta: AttentionMeta) -> torch.Tensor:
    """flex_attention over [k_0 | k_1 | ... | k_i] with the TTT mask as a block mask.

    Experimental: checked against `naive` on CPU (eager, forward only: flex has no CPU backward);
    not yet run on CUDA, where it is compiled. "chunked" is the default and exact everywhere.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    T = q.shape[0]
    n_steps = len(ks)
    sample = meta.layout.sample
    if n_steps not in meta.block_masks:
        def mask_mod(b, h, q_idx, kv_idx):
            blk = kv_idx // T
            tok = kv_idx - blk * T
            # clamp: block-mask construction may probe indices in the padding past T
            same_sample = sample[tok.clamp(max=T - 1)] == sample[q_idx.clamp(max=T - 1)]
            context = (blk == 0) & same_sample & (tok <= q_idx)
            return context | ((blk > 0) & (tok == q_idx))

        meta.block_masks[n_steps] = create_block_mask(mask_mod, None, None, T, n_steps * T, device=q.device)
    k = torch.cat(ks, dim=0).transpose(0, 1).unsqueeze(0)
    v = torch.cat(vs, dim=0).transpose(0, 1).unsqueeze(0)
    out = _FLEX(q.transpose(0, 1).unsqueeze(0), k, v, block_mask=meta.block_masks[n_steps], enable_gqa=True)
    return out[0].transpose(0, 1)


def _flex_fn():
    from torch.nn.attention.flex_attention import flex_attention

    if torch.cuda.is_available():
        return torch.compile(flex_attention)  # packed rows vary in length: let dynamo go dynamic
    return flex_attention


class _LazyFlex:
    fn = None

    def __call__(self, *args, **kwargs):
        if _LazyFlex.fn is None:
            _LazyFlex.fn = _flex_fn()
        return _LazyFlex.fn(*args, **kwargs)


_FLEX = _LazyFlex()

ATTENTION_IMPLS = {"chunked": chunked_ttt_attention, "naive": naive_ttt_attention, "flex": flex_ttt_attention}


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Llama (neox-style) RoPE from the draft's own rope_theta / rope_scaling (docs/design.md#draft-architecture).

    inv_freq is a plain fp32 attribute, not a buffer, so `model.to(bfloat16)` cannot round it.
    """

    def __init__(self, config: DraftModelConfig):
        super().__init__()
        self.inv_freq, self.attention_scaling = _rope_parameters(config)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _rope_parameters(config: DraftModelConfig) -> tuple[torch.Tensor, float]:
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    # Scaled variants (llama3, linear, yarn, dynamic, longrope): use transformers' own formulas so the
    # draft matches what vLLM / HF compute from the same config.json.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = config.to_vllm_config()
    hf = LlamaConfig(**{k: fields[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                               "head_dim", "rope_theta", "rope_scaling",
                                               "max_position_embeddings")})
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"rope_scaling type '{rope_type}' is not supported; use one of {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
    return inv_freq.float(), float(scaling_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d] fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DraftModelConfig, input_size: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache_k, cache_v, meta: AttentionMeta):
        T = x.shape[0]
        q = apply_rope(self.q_proj(x).view(T, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        out = ATTENTION_IMPLS[meta.impl](q, [*cache_k, k], [*cache_v, v], meta)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim)), k, v


class MLP(nn.Module):
    def __init__(self, config: DraftModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Layer 0 (`first=True`) reads [embedding, hidden] (2H wide); later layers are plain Llama layers."""

    def __init__(self, config: DraftModelConfig, first: bool):
        super().__init__()
        self.first = first
        self.norm_before_residual = config.norm_before_residual
        H = config.hidden_size
        self.self_attn = Attention(config, 2 * H if first else H)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, config.rms_norm_eps)

    def forward(self, hidden, embeds, cos, sin, cache_k, cache_v, meta):
        if self.first:
            normed_hidden = self.hidden_norm(hidden)
            residual = normed_hidden if self.norm_before_residual else hidden
            x = torch.cat((self.input_layernorm(embeds), normed_hidden), dim=-1)
        else:
            residual = hidden
            x = self.input_layernorm(hidden)
        attn, k, v = self.self_attn(x, cos, sin, cache_k, cache_v, meta)
        h = residual + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k, v


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: DraftModelConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(config.num_aux * config.target_hidden_size, H, bias=False)
        self.midlayer = DecoderLayer(config, first=True)
        # Extra layers keep vLLM's indices (layers.1, layers.2, ...): a ModuleDict with string keys.
        self.layers = nn.ModuleDict({str(k): DecoderLayer(config, first=False)
                                     for k in range(1, config.num_hidden_layers)})
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        # Default vocab map: draft index i = target id i (identity on the first V_d ids).
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

        self.gradient_checkpointing = False  # checkpoint each (TTT step, layer) call
        self.attention_impl = "chunked"  # chunked | flex | naive
        self.attn_chunk_size = 512  # queries per attention chunk (transient memory ~ 4 x heads x chunk x sample_len x 4 B)
        self.attn_checkpoint_chunks = True  # recompute chunk scores in backward instead of storing them
        self.reset_parameters()

    # -- setup -------------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self):
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        self.embed_tokens.weight.normal_(0.0, std)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [self.midlayer, *[self.layers[str(k)] for k in range(1, self.config.num_hidden_layers)]]

    @torch.no_grad()
    def load_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding [V, H] and keep it frozen."""
        expected = tuple(self.embed_tokens.weight.shape)
        if tuple(weight.shape) != expected:
            raise DataError(
                f"target embedding has shape {tuple(weight.shape)}, the draft expects {expected} "
                f"(vocab_size, draft hidden_size); the draft hidden size must equal the target's"
            )
        self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))
        self.embed_tokens.weight.requires_grad_(False)

    @torch.no_grad()
    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        V, Vd = self.config.vocab_size, self.config.draft_vocab_size
        d2t = d2t.to(torch.long).flatten()
        t2d = t2d.to(torch.bool).flatten()
        if d2t.numel() != Vd or t2d.numel() != V:
            raise DataError(f"vocab map has d2t [{d2t.numel()}] and t2d [{t2d.numel()}]; the draft expects "
                            f"d2t [{Vd}] and t2d [{V}]; rebuild the vocab map (03) for this draft_vocab_size and target")
        target_ids = torch.arange(Vd) + d2t.cpu()
        t2d_cpu = t2d.cpu()
        if (target_ids.min() < 0 or target_ids.max() >= V or int(t2d_cpu.sum()) != Vd
                or not bool(t2d_cpu[target_ids].all()) or target_ids.unique().numel() != Vd):
            raise DataError("vocab map is inconsistent: d2t must map the draft ids to distinct target ids, "
                            "exactly the ones set in t2d; rebuild it with 03_build_vocab_map.py")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_vocab_target_ids(self) -> torch.Tensor:
        """[V_d] target id of each draft index."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # -- forward pieces ----------------------------------------------------------------------

    def combine_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        expected = self.fc.in_features
        if aux_hidden.shape[-1] != expected:
            raise DataError(f"aux hidden states have width {aux_hidden.shape[-1]}, the draft expects {expected} "
                            f"({self.config.num_aux} aux layers x target hidden {self.config.target_hidden_size})")
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [.., H] -> draft logits [.., V_d]."""
        return self.lm_head(self.norm(hidden))

    def forward_ttt_hidden(self, aux_hidden, input_ids, position_ids, seq_lens, ttt_steps: int,
                           step_fn=None) -> list:
        """Unrolled TTT over one packed row; returns the pre-norm output [T, H] of every step.

        aux_hidden [T, n_aux*H_t], input_ids [T] (the raw tokens x; shifting happens here),
        position_ids [T] (position within each sample), seq_lens (sum == T).
        Step i, index t predicts x_{t+2+i}; see the module docstring for the alignment.
        With `step_fn`, returns [step_fn(self, i, h_i)] instead (ttt_loss computes each step's
        loss there, inside forward, so DDP/FSDP wrappers see every parameter use).
        """
        aux_hidden = squeeze_row(aux_hidden, 2)
        input_ids = squeeze_row(input_ids, 1)
        position_ids = squeeze_row(position_ids, 1)
        T = input_ids.shape[0]
        if aux_hidden.shape[0] != T or position_ids.shape[0] != T:
            raise DataError(f"aux_hidden ({aux_hidden.shape[0]}), input_ids ({T}) and position_ids "
                            f"({position_ids.shape[0]}) must have the same length")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"attention_impl '{self.attention_impl}' is unknown; use one of {sorted(ATTENTION_IMPLS)}")
        layout = PackedLayout.build(seq_lens, T, input_ids.device)
        meta = AttentionMeta(layout, chunk_size=self.attn_chunk_size,
                             checkpoint_chunks=self.attn_checkpoint_chunks, impl=self.attention_impl)
        layers = self.decoder_layers
        caches = [([], []) for _ in layers]
        hidden = self.combine_aux(aux_hidden)
        outputs = []
        for step in range(ttt_steps):
            idx, inside = layout.shifted(1 + step)
            tokens = torch.where(inside, input_ids[idx], torch.zeros_like(input_ids))
            embeds = self.embed_tokens(tokens)
            cos, sin = self.rotary(position_ids + step)
            h = hidden
            for layer, (cache_k, cache_v) in zip(layers, caches):
                e = embeds if layer.first else None
                # pass copies of the caches: they grow after this call, a checkpoint recompute must not see that
                args = (h, e, cos, sin, tuple(cache_k), tuple(cache_v), meta)
                if self.gradient_checkpointing and torch.is_grad_enabled():
                    h, k, v = checkpoint(layer, *args, use_reentrant=False)
                else:
                    h, k, v = layer(*args)
                cache_k.append(k)
                cache_v.append(v)
            outputs.append(h if step_fn is None else step_fn(self, step, h))
            hidden = h
        return outputs

    def forward_ttt(self, aux_hidden, input_ids, position_ids, seq_lens, ttt_steps: int) -> list[torch.Tensor]:
        """Per-step draft logits [T, V_d] (step i, index t = prediction for x_{t+2+i}).

        Materialises T x V_d per step; training uses `forward_ttt_hidden` + ttt.ttt_loss, which
        applies norm + lm_head in checkpointed chunks instead.
        """
        return [self.compute_logits(h) for h in self.forward_ttt_hidden(aux_hidden, input_ids, position_ids,
                                                                          seq_lens, ttt_steps)]

    def forward(self, aux_hidden, input_ids, position_ids, seq_lens, ttt_steps: int, step_fn=None):
        """`forward_ttt` (per-step logits), or per-step `step_fn(model, i, h_i)` results when given."""
        if step_fn is None:
            return self.forward_ttt(aux_hidden, input_ids, position_ids, seq_lens, ttt_steps)
        return self.forward_ttt_hidden(aux_hidden, input_ids, position_ids, seq_lens, ttt_steps, step_fn=step_fn)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
