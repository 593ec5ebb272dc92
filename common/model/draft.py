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
  - "chunked" (exact on CPU and GPU): `TTTAttention`, an autograd Function with a hand-written backward
    (FlashAttention's algebra in PyTorch ops). Queries in chunks of `attn_chunk_size` rows, each seeing the
    step-0 keys from the sample start of its first row (block-causal mask, built once per micro-batch), padded
    and batched into a few bmm's per step, plus the step's "diagonal" keys (steps 1..i at the query's own row)
    in one batched product, under one joint fp32 log-sum-exp. Forward keeps the output and the log-sum-exp,
    backward recomputes the probabilities: no [heads, T, S] tensor lives between them.
  - "flex": torch flex_attention over the concatenated step KV with a block mask per micro-batch and step
    count, compiled on CUDA (no CPU backward). 04's "auto" picks it on a GPU where a start-up self-check
    against "chunked" passes (common.train.step.resolve_attention).
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
ATTN_SCORES_BYTES = 1 << 30  # fp32 scores of one chunk batch of the chunked attention, all heads (1 GiB)


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

    def shifted(self, k: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index of the token k places later, clamped into the row; whether it is in the same sample): [T] each,
        or [K, T] for a column of K shifts k [K, 1]."""
        T = self.num_tokens
        idx = (torch.arange(T, device=self.sample.device) + k).clamp_(max=T - 1)
        return idx, self.offset + k <= self.length - 1

    def step_valid(self, step: int | torch.Tensor) -> torch.Tensor:
        """[T] bool: step `step` at t has a target inside the sample (t + 2 + step <= L - 1); [K, T] for a
        column of steps [K, 1]."""
        return self.offset + 2 + step <= self.length - 1


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 for softmax-grade arithmetic; float64 stays float64 (the exactness tests run in it)."""
    return x if x.dtype == torch.float64 else x.float()


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
    """What every attention call of one micro-batch shares: the layout and, built once on first use and
    reused by every TTT step and layer, the chunk batches (chunked) or the block masks (flex)."""

    layout: PackedLayout
    chunk_size: int = 512
    impl: str = "chunked"
    block_masks: dict = field(default_factory=dict)  # flex: one block mask per number of steps
    pairs_budget: int = 1 << 22  # query-key pairs per chunk batch (its fp32 scores: heads x pairs x 4 B)
    _plan: "ChunkPlan | None" = None

    def chunk_plan(self, device) -> "ChunkPlan":
        if self._plan is None:
            self._plan = plan_chunks(self.layout, self.chunk_size, self.pairs_budget, device)
        return self._plan


@dataclass
class ChunkBatch:
    """n query chunks padded to C queries and S keys each, attended in one batched computation."""

    queries: torch.Tensor  # [n * C] row of each query (the last chunk's padding repeats its last row; dropped)
    keys: torch.Tensor  # [n * S] row of each padded step-0 key
    blocked: torch.Tensor  # [n, C, S] bool: True where the query may not see the key (other sample, later, padding)
    query_weight: torch.Tensor | None  # [n * C] 1.0 for a real query, 0.0 for padding (None: no padding)
    whole_rows: bool = False  # queries and keys are rows 0..T-1 in order (equal whole samples): no gathers

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.blocked.shape)

    @property
    def blocked5(self) -> torch.Tensor:
        """blocked as [n, 1, C, 1, S]: broadcast over kv heads and the g query heads of each."""
        n, C, S = self.blocked.shape
        return self.blocked.view(n, 1, C, 1, S)

    def rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x if self.whole_rows else x.index_select(0, index)

    def add_rows(self, total: torch.Tensor, index: torch.Tensor, part: torch.Tensor) -> None:
        part = _as(part, total.dtype)
        if self.whole_rows:
            total.add_(part.reshape(total.shape))
        else:
            total.index_add_(0, index, part.reshape(-1, *total.shape[1:]))


@dataclass
class ChunkPlan:
    batches: list[ChunkBatch]  # in row order; only the last chunk is padded
    num_tokens: int

    def to_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The batches' outputs, concatenated, as [T, ...]: the last chunk's padding dropped."""
        return out if out.shape[0] == self.num_tokens else out[: self.num_tokens]


def query_chunks(layout: PackedLayout, chunk_size: int) -> list[tuple[int, int, int]]:
    """(start, stop, key_start) per chunk: rows [start, stop) of chunk_size queries (the last one shorter), seeing
    the step-0 keys from the start of the sample of their first row, key_start, up to stop - 1."""
    starts = layout.starts
    return [(a, min(a + chunk_size, layout.num_tokens), starts[bisect.bisect_right(starts, a) - 1])
            for a in range(0, layout.num_tokens, chunk_size)]


def plan_chunks(layout: PackedLayout, chunk_size: int, pairs_budget: int, device) -> ChunkPlan:
    """The chunks (query_chunks) grouped, in row order, into batches of at most pairs_budget padded query-key
    pairs (at least one chunk each): a fixed handful of batched ops per step and batch, whatever the samples."""
    chunks = query_chunks(layout, chunk_size)
    C = chunks[0][1] - chunks[0][0]
    groups, group = [], []
    for c in chunks:
        trial = group + [c]
        if group and len(trial) * C * max(b - lo for _, b, lo in trial) > pairs_budget:
            groups.append(group)
            trial = [c]
        group = trial
    groups.append(group)
    # the masks are built on the device in a few tensor ops (a long micro-batch has 10^8 query-key pairs);
    # 1 byte per pair, kept for the micro-batch (common.train.memory_plan counts it)
    batches, sample, T = [], layout.sample, layout.num_tokens
    for group in groups:
        n, S = len(group), max(b - lo for _, b, lo in group)
        a, b, lo = (torch.tensor(col, device=sample.device)[:, None] for col in zip(*group))
        qi, ki = a + torch.arange(C, device=sample.device), lo + torch.arange(S, device=sample.device)
        q_real, k_real = qi < b, ki < b
        qi, ki = torch.minimum(qi, b - 1), torch.minimum(ki, b - 1)
        allowed = (sample[qi][:, :, None] == sample[ki][:, None, :]) & (ki[:, None, :] <= qi[:, :, None])
        allowed &= q_real[:, :, None] & k_real[:, None, :]
        allowed[:, :, 0] |= ~q_real  # a padded query sees one key: a finite softmax, its output is dropped
        # equal whole chunks that start their own keys: queries and keys are the rows in order
        whole = len(groups) == 1 and all(lo_ == a_ and b_ - a_ == C == S for a_, b_, lo_ in group) and n * C == T
        weight = None if bool(q_real.all()) else q_real.flatten().float()
        batches.append(ChunkBatch(qi.flatten().to(device), ki.flatten().to(device), (~allowed).to(device),
                                  None if weight is None else weight.to(device), whole))
    return ChunkPlan(batches, T)


class TTTAttention(torch.autograd.Function):
    """Exact TTT attention of one step's queries, with a hand-written backward (FlashAttention's algebra in
    PyTorch ops, per chunk batch): forward keeps q, the keys and values, the output and each row's log-sum-exp;
    backward recomputes a chunk batch's probabilities from them. So no [heads, C, S] probabilities are kept
    between forward and backward (nothing to checkpoint) and a step dispatches a fixed, small number of ops
    per chunk batch, whatever the step. Scores, softmax and the probabilities' gradients are fp32; the
    matmuls run in the inputs' dtype (bf16 on GPU).

    apply(plan, q, k_0, v_0, k_1..k_i, v_1..v_i): q [T, nh, d]; k_j/v_j [T, nkv, d] (step j's keys after
    RoPE); a query at row t sees the step-0 keys of its sample up to t, and k_1..k_i at row t only.
    """

    @staticmethod
    def forward(ctx, plan: "ChunkPlan", q, k0, v0, *diag):
        outs, lses = [], []
        with torch.autocast(q.device.type, enabled=False):  # the dtypes are chosen here (autocast skips backward)
            for cb in plan.batches:
                out, lse = _attend_forward(cb, q, k0, v0, diag)
                outs.append(out)
                lses.append(lse)
        out = plan.to_rows(torch.cat(outs) if len(outs) > 1 else outs[0])
        ctx.plan = plan
        ctx.save_for_backward(q, k0, v0, out, *lses, *diag)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        plan = ctx.plan
        q, k0, v0, out, *rest = ctx.saved_tensors
        lses, diag = rest[:len(plan.batches)], rest[len(plan.batches):]
        n_diag = len(diag) // 2
        # D = rowsum(dO * O), the softmax's backward term shared by every key of a query row
        delta = (_wide(grad_out) * _wide(out)).sum(dim=-1)  # [T, nh]
        grad_out = _as(grad_out, q.dtype)
        # summed in fp32 (a key row is seen by several chunks of a long sample), returned in the inputs' dtype
        acc = _wide(q[:0]).dtype
        dq, dk0, dv0 = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k0, v0))
        # the diag keys' and values' gradients of every earlier step at once: [T, nkv, i, d] each
        T, nkv, d = k0.shape
        d_diag = [torch.zeros(T, nkv, n_diag, d, dtype=acc, device=k0.device) for _ in range(2)] if n_diag else []
        for cb, lse in zip(plan.batches, lses):
            _attend_backward(cb, q, k0, v0, diag, lse, grad_out, delta, dq, dk0, dv0, d_diag)
        return (None, _as(dq, q.dtype), _as(dk0, k0.dtype), _as(dv0, v0.dtype),
                *[_as(g, k0.dtype) for d_ in d_diag for g in d_.unbind(2)])


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)  # no op dispatched when it is one already


def _by_kv_head(x: torch.Tensor, n: int, rows: int, nkv: int) -> torch.Tensor:
    """[n * rows, nkv, r, d] rows of n chunks (r = g query heads of a kv head, or steps) -> [n * nkv, rows * r, d]:
    one matrix per (chunk, kv head), as bmm wants them."""
    # contiguous: reshape may return a strided view (one chunk, or one kv head), which later views cannot split
    return x.view(n, rows, nkv, -1).transpose(1, 2).reshape(n * nkv, -1, x.shape[-1]).contiguous()


def _to_rows(x: torch.Tensor, n: int, nkv: int, rows: int) -> torch.Tensor:
    """The inverse of _by_kv_head: [n * nkv, rows * r, d] -> [n * rows, nkv, r, d]."""
    return x.view(n, nkv, rows, -1).transpose(1, 2).reshape(n * rows, nkv, -1, x.shape[-1])


def _batch_inputs(cb: "ChunkBatch", q, k0, v0, diag):
    """The chunk batch's queries [n*nkv, C*g, d], keys and values [n*nkv, S, d] (one matrix per chunk and kv
    head; query rows ordered (c, g)), and the diag keys [n*nkv*C, d, i] and values [n*nkv*C, i, d] at the
    queries' rows (wide: fp32)."""
    n, C, S = cb.shape
    nkv, d = k0.shape[1], k0.shape[2]
    qh = _by_kv_head(cb.rows(q, cb.queries).view(n * C, nkv, -1, d), n, C, nkv)
    kh = _by_kv_head(cb.rows(k0, cb.keys).view(n * S, nkv, 1, d), n, S, nkv)
    vh = _by_kv_head(cb.rows(v0, cb.keys).view(n * S, nkv, 1, d), n, S, nkv)
    n_diag = len(diag) // 2
    kd = vd = None
    if n_diag:
        kd = _wide(_by_kv_head(cb.rows(torch.stack(diag[:n_diag], dim=2), cb.queries), n, C, nkv)).reshape(-1, n_diag, d)
        vd = _wide(_by_kv_head(cb.rows(torch.stack(diag[n_diag:], dim=2), cb.queries), n, C, nkv)).reshape(-1, n_diag, d)
    return qh, kh, vh, kd, vd


def _probabilities(cb: "ChunkBatch", qh, kh, kd, lse=None):
    """Softmax probabilities of the chunk batch over its step-0 keys [n*nkv, C*g, S] and its diag keys
    [n*nkv*C, g, i] (None without), and the log-sum-exp [n*nkv, C*g] (given in backward: from forward)."""
    n, C, S = cb.shape
    B, Cg, d = qh.shape
    scale = d**-0.5
    scores = _wide(torch.bmm(qh, kh.transpose(1, 2)))  # [B, C*g, S]
    scores.view(n, B // n, C, Cg // C, S).mul_(scale).masked_fill_(cb.blocked5, float("-inf"))
    diag_scores = None
    if kd is not None:
        diag_scores = torch.bmm(_wide(qh).view(B * C, Cg // C, d), kd.transpose(1, 2)).mul_(scale)  # [B*C, g, i]
    if lse is None:
        lse = scores.logsumexp(dim=-1)
        if diag_scores is not None:  # fold in the diag keys: log(exp(lse) + sum exp(diag))
            lse = torch.logaddexp(lse, diag_scores.logsumexp(dim=-1).view(B, Cg))
    p = scores.sub_(lse.unsqueeze(-1)).exp_()
    p_diag = None if diag_scores is None else diag_scores.sub_(lse.view(B * C, Cg // C, 1)).exp_()
    return p, p_diag, lse


def _attend_forward(cb: "ChunkBatch", q, k0, v0, diag):
    n, C, _ = cb.shape
    nkv = k0.shape[1]
    qh, kh, vh, kd, vd = _batch_inputs(cb, q, k0, v0, diag)
    B, Cg, d = qh.shape
    p, p_diag, lse = _probabilities(cb, qh, kh, kd)
    out = _wide(torch.bmm(_as(p, vh.dtype), vh))  # [B, C*g, d]
    if p_diag is not None:
        out.view(B * C, Cg // C, d).baddbmm_(p_diag, vd)
    return _as(_to_rows(out, n, nkv, C).reshape(n * C, -1, d), q.dtype), lse


def _attend_backward(cb: "ChunkBatch", q, k0, v0, diag, lse, grad_out, delta, dq, dk0, dv0, d_diag):
    """Adds the chunk batch's gradients into dq, dk0, dv0 and d_diag ([T, nkv, i, d]; index_add: key rows repeat
    across chunks). FlashAttention's algebra: dV = P^T dO; dS = P * (dO V^T - D) * scale; dQ = dS K; dK = dS^T Q
    (the g query heads of a kv head are rows of one matrix: their dK and dV sum in the matmul)."""
    n, C, S = cb.shape
    nkv = k0.shape[1]
    qh, kh, vh, kd, vd = _batch_inputs(cb, q, k0, v0, diag)
    B, Cg, d = qh.shape
    scale = d**-0.5
    p, p_diag, _ = _probabilities(cb, qh, kh, kd, lse)
    do, dlt = cb.rows(grad_out, cb.queries), cb.rows(delta, cb.queries)
    if cb.query_weight is not None:  # the last chunk's padding repeats a real row: its gradient must not count
        do = do * _as(cb.query_weight, do.dtype)[:, None, None]
        dlt = dlt * cb.query_weight[:, None]
    do_h = _by_kv_head(do.view(n * C, nkv, -1, d), n, C, nkv)  # [B, C*g, d]
    dlt = _by_kv_head(dlt.view(n * C, nkv, -1, 1), n, C, nkv).view(B, Cg, 1)
    dv_h = torch.bmm(_as(p, do_h.dtype).transpose(1, 2), do_h)  # [B, S, d]
    ds = _wide(torch.bmm(do_h, vh.transpose(1, 2))).sub_(dlt).mul_(p).mul_(scale)  # [B, C*g, S]
    ds = _as(ds, q.dtype)
    dq_h = _wide(torch.bmm(ds, kh))  # [B, C*g, d]
    dk_h = torch.bmm(ds.transpose(1, 2), qh)  # [B, S, d]
    if p_diag is not None:
        do_d = _wide(do_h).view(B * C, Cg // C, d)
        ds_diag = torch.bmm(do_d, vd.transpose(1, 2)).sub_(dlt.view(B * C, Cg // C, 1)).mul_(p_diag).mul_(scale)
        dq_h.view(B * C, Cg // C, d).baddbmm_(ds_diag, kd)
        i = kd.shape[1]
        dkd = torch.bmm(ds_diag.transpose(1, 2), _wide(qh).view(B * C, Cg // C, d)).view(B, C * i, d)
        dvd = torch.bmm(p_diag.transpose(1, 2), do_d).view(B, C * i, d)
        cb.add_rows(d_diag[0], cb.queries, _to_rows(dkd, n, nkv, C))
        cb.add_rows(d_diag[1], cb.queries, _to_rows(dvd, n, nkv, C))
    cb.add_rows(dq, cb.queries, _to_rows(dq_h, n, nkv, C))
    cb.add_rows(dk0, cb.keys, _to_rows(dk_h, n, nkv, S))
    cb.add_rows(dv0, cb.keys, _to_rows(dv_h, n, nkv, S))


def chunked_ttt_attention(q, ks, vs, meta: AttentionMeta) -> torch.Tensor:
    """q [T, nh, d] of step i = len(ks) - 1; ks/vs: per-step keys/values [T, nkv, d] (after RoPE)."""
    return TTTAttention.apply(meta.chunk_plan(q.device), q, ks[0], vs[0], *ks[1:], *vs[1:])


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
    scores = torch.einsum("thd,shd->hts", _wide(q), _wide(k)) / math.sqrt(d)
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", p, _wide(v)).to(q.dtype)


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
        # normalised in fp32 (one fused kernel on CUDA), scaled in the input's dtype
        return self.weight * F.rms_norm(_wide(x), (x.shape[-1],), eps=self.eps).to(x.dtype)


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
        if self.attention_scaling == 1.0:
            return emb.cos(), emb.sin()
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
    """x [T, heads, d]; cos/sin [T, 1, d] fp32 (RotaryEmbedding's [T, d], broadcast over the heads)."""
    xf = _wide(x)
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    """The attention's projections (state-dict names self_attn.{q,k,v,o}_proj); DecoderLayer runs them."""

    def __init__(self, config: DraftModelConfig, input_size: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)


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
        q, k, v, residual = self.pre_attention(hidden, embeds, cos, sin)
        attn = ATTENTION_IMPLS[meta.impl](q, [*cache_k, k], [*cache_v, v], meta)
        return self.post_attention(attn, residual), k, v

    # The two dense halves around the attention: what compile_regions compiles (the attention itself works on
    # the micro-batch's chunk plan or block mask, which change with every micro-batch).

    def pre_attention(self, hidden, embeds, cos, sin):
        """Norms, q/k/v projections and RoPE: (q [T, nh, d], k, v [T, nkv, d], the residual)."""
        if self.first:
            normed_hidden = self.hidden_norm(hidden)
            residual = normed_hidden if self.norm_before_residual else hidden
            x = torch.cat((self.input_layernorm(embeds), normed_hidden), dim=-1)
        else:
            residual = hidden
            x = self.input_layernorm(hidden)
        a, T = self.self_attn, x.shape[0]
        q = apply_rope(a.q_proj(x).view(T, a.num_heads, a.head_dim), cos, sin)
        k = apply_rope(a.k_proj(x).view(T, a.num_kv_heads, a.head_dim), cos, sin)
        v = a.v_proj(x).view(T, a.num_kv_heads, a.head_dim)
        return q, k, v, residual

    def post_attention(self, attn, residual):
        """o_proj, the residual, the MLP: the layer's output h [T, H]."""
        h = residual + self.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))

    def compile_regions(self, backend: str = "inductor") -> None:
        """torch.compile the two dense halves (fullgraph: a graph break is an error; dynamic in T)."""
        self.pre_attention = torch.compile(self.pre_attention, fullgraph=True, dynamic=True, backend=backend)
        self.post_attention = torch.compile(self.post_attention, fullgraph=True, dynamic=True, backend=backend)


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
        self.attn_chunk_size = 512  # queries per attention chunk (chunked: a sample longer than this is cut)
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
        meta = AttentionMeta(layout, chunk_size=self.attn_chunk_size, impl=self.attention_impl,
                             pairs_budget=ATTN_SCORES_BYTES // (4 * self.config.num_attention_heads))
        layers = self.decoder_layers
        caches = [([], []) for _ in layers]
        hidden = self.combine_aux(aux_hidden)
        outputs = []
        for step in range(ttt_steps):
            idx, inside = layout.shifted(1 + step)
            tokens = torch.where(inside, input_ids[idx], torch.zeros_like(input_ids))
            embeds = self.embed_tokens(tokens)
            cos, sin = (x[:, None, :] for x in self.rotary(position_ids + step))  # [T, 1, d]: shared by q, k, layers
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

    def compile_regions(self, backend: str = "inductor") -> None:
        """Regional torch.compile of every decoder layer (DecoderLayer.compile_regions); the step's other ops
        (embedding, RoPE tables, attention, loss) stay eager."""
        for layer in self.decoder_layers:
            layer.compile_regions(backend)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
