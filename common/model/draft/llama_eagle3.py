"""The Llama EAGLE-3 draft modules and the training-time-test (TTT) forward pass.

Architecture (docs/design.md#draft-architecture, identical to the official EAGLE-3 / SpecForge draft
and to vLLM's `llama_eagle3.py`):

    g = fc(concat(aux_0, aux_1, aux_2))                  # target features -> H, step 0 only
        fc_norm (EAGLE-3.1):  concat(fc_norm.0(aux_0), fc_norm.1(aux_1), ...) instead of the raw concat
        norm_before_fc:       input_norm(concat(aux_0, aux_1, aux_2))   (exclusive with fc_norm)
    layer 0 ("midlayer"): residual = g  (hidden_norm(g) if norm_before_residual)
        x = concat(input_layernorm(embed(token)), hidden_norm(g))        # [.., 2H], embedding first
        h = residual + o_proj(attn(q/k/v_proj(x)))
        h = h + mlp(post_attention_layernorm(h))
    layers k >= 1: ordinary pre-norm Llama decoder layers on h (vLLM PR #26164)
    logits = lm_head(norm(h))                            # [.., V_d], in every mode
    next step's g = h (the PRE-norm output; fc is not applied again), or norm(h) with norm_output (EAGLE-3.1)

State dict names are exactly the names of the official vLLM checkpoint format: `fc.weight`,
`midlayer.*` (layer 0), `layers.{k}.*` for k >= 1 (vLLM's `LlamaModel.layers[k]`; it maps
`midlayer.` to `layers.0.`), `norm.weight`, `lm_head.weight`, `fc_norm.{i}.weight` (fc_norm) or `input_norm.weight`
(norm_before_fc), buffers `d2t` / `t2d`, and the
frozen `embed_tokens.weight` (dropped on export unless asked for). The module ends with the family's
registration (LLAMA_EAGLE3_FAMILY, common/model/draft/registry.py): its names, formats and sizes.

TTT (docs/design.md#ttt-alignment-and-loss): `forward_ttt_hidden` unrolls `ttt_steps` draft steps over one packed row of
samples. At step i, index t of a sample of length L:
  - hidden input = fc(aux[t]) at step 0, else the draft's own output of step i-1 at t (pre-norm; normed with
    norm_output);
  - token input  = x_{t+1+i} (teacher forcing; positions past the sample end get token 0 and are
    never used by a valid position);
  - RoPE position = position_ids[t] + i;
  - attention: step-0 keys at s <= t of the same sample, plus the keys of steps 1..i at index t.
The output at (i, t) is the prediction of x_{t+2+i}; it is meaningful iff t+2+i <= L-1.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common.core.errors import ConfigError, DataError
from common.model.draft.attention import ATTENTION_BACKENDS, ATTN_SCORES_BYTES, DEFAULT_ATTN_CHUNK, AttentionMeta
from common.model.draft.contract import DraftModelContract
from common.model.draft.config import ACTIVATIONS, OFFICIAL_ARCHITECTURE, DraftModelConfig, build_draft_config
from common.model.draft.layout import PackedLayout, _wide, squeeze_row
from common.model.draft.registry import DraftFamily, StateDictAdapter, grouped_query_widths, register


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

    softmax_scale = None  # the attention's scale stays 1/sqrt(head_dim)

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
    """The attention's projections (state-dict names self_attn.{q,k,v,o}_proj): forward gives q, k, v; the TTT
    attention and o_proj run in DecoderLayer."""

    def __init__(self, config: DraftModelConfig, input_size: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        """x [T, in] -> q [T, nh, d], k and v [T, nkv, d], RoPE on q and k."""
        T = x.shape[0]
        q = apply_rope(self.q_proj(x).view(T, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, config: DraftModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Layer 0 (`first=True`) reads [embedding, hidden] (2H wide); later layers are plain Llama layers.
    `attention_class` builds the projections from (config, input width); pre_attention runs them."""

    attention_class = Attention

    def __init__(self, config: DraftModelConfig, first: bool):
        super().__init__()
        self.first = first
        self.norm_before_residual = config.norm_before_residual
        H = config.hidden_size
        self.self_attn = self.attention_class(config, 2 * H if first else H)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, config.rms_norm_eps)

    def forward(self, hidden, embeds, cos, sin, cache_k, cache_v, meta):
        q, k, v, residual = self.pre_attention(hidden, embeds, cos, sin)
        attn = ATTENTION_BACKENDS[meta.impl].attend(q, [*cache_k, k], [*cache_v, v], meta)
        return self.post_attention(attn, residual), k, v

    # The two dense halves around the attention: what compile_regions compiles (the attention itself works on
    # the micro-batch's chunk plan or block mask, which change with every micro-batch).

    def pre_attention(self, hidden, embeds, cos, sin):
        """Norms, then the attention's projections and RoPE: (q, k, v, the residual)."""
        if self.first:
            normed_hidden = self.hidden_norm(hidden)
            residual = normed_hidden if self.norm_before_residual else hidden
            x = torch.cat((self.input_layernorm(embeds), normed_hidden), dim=-1)
        else:
            residual = hidden
            x = self.input_layernorm(hidden)
        return (*self.self_attn(x, cos, sin), residual)

    def post_attention(self, attn, residual):
        """o_proj, the residual, the MLP: the layer's output h [T, H]."""
        h = residual + self.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))

    def compile_regions(self, backend: str = "inductor") -> None:
        """torch.compile the two dense halves (fullgraph: a graph break is an error; dynamic in T)."""
        self.pre_attention = torch.compile(self.pre_attention, fullgraph=True, dynamic=True, backend=backend)
        self.post_attention = torch.compile(self.post_attention, fullgraph=True, dynamic=True, backend=backend)


class Eagle3DraftModel(nn.Module, DraftModelContract):
    """The Llama EAGLE-3 draft. `attention` names the TTT attention backend (ATTENTION_BACKENDS; 04 picks it with
    choose_attention), `attn_chunk_size` the queries per chunk of the chunked one (a sample longer than this is
    cut), `gradient_checkpointing` recomputes each (TTT step, layer) call in the backward. A family that changes
    only the layer or the rotary subclasses it and names its own `layer_class` / `rotary_class`."""

    layer_class = DecoderLayer  # (config, first=) -> a layer with forward(hidden, embeds, cos, sin, cache_k, cache_v, meta)
    rotary_class = RotaryEmbedding  # (config) -> positions -> (cos, sin); its softmax_scale: the attention's (None: 1/sqrt(d))

    def __init__(self, config: DraftModelConfig, *, attention: str = "chunked", attn_chunk_size: int = DEFAULT_ATTN_CHUNK,
                 gradient_checkpointing: bool = False):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention backend {attention!r} is unknown; use one of {sorted(ATTENTION_BACKENDS)}")
        self.config = config
        self.attention_impl, self.attn_chunk_size, self.gradient_checkpointing = attention, attn_chunk_size, gradient_checkpointing
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        fc_input_size = config.num_aux * config.target_hidden_size
        # EAGLE-3.1's norms before fc, under vLLM's names and eps (its LlamaModel and DeepseekV2Eagle3Model)
        if config.norm_before_fc:
            self.input_norm = RMSNorm(fc_input_size, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                         for _ in range(config.num_aux))
        self.fc = nn.Linear(fc_input_size, H, bias=False)
        self.midlayer = self.layer_class(config, first=True)
        # Extra layers keep vLLM's indices (layers.1, layers.2, ...): a ModuleDict with string keys.
        self.layers = nn.ModuleDict({str(k): self.layer_class(config, first=False)
                                     for k in range(1, config.num_hidden_layers)})
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary = self.rotary_class(config)
        # Default vocab map: draft index i = target id i (identity on the first V_d ids).
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

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
        x = aux_hidden.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:  # vLLM's combine_hidden_states: input_norm, then fc_norm per chunk, then fc
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, x.chunk(self.config.num_aux, dim=-1))], dim=-1)
        return self.fc(x)

    def next_step_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """A step's pre-norm output [.., H] -> the hidden input of the next draft step: itself (EAGLE-3), or what
        lm_head reads (norm_output, EAGLE-3.1; vLLM's aux_output). The logits read the normed state in both."""
        return self.final_norm(hidden) if self.config.norm_output else hidden

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [.., H] -> what lm_head reads [.., H]."""
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [.., H] -> draft logits [.., V_d]."""
        return self.lm_head(self.norm(hidden))

    @property
    def head_weight(self) -> nn.Parameter:
        """lm_head's weight [V_d, H]."""
        return self.lm_head.weight

    @property
    def embedding(self) -> nn.Embedding:
        """embed_tokens: the target's embedding, frozen."""
        return self.embed_tokens

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
        layout = PackedLayout.build(seq_lens, T, input_ids.device)
        meta = AttentionMeta(layout, chunk_size=self.attn_chunk_size, impl=self.attention_impl,
                             pairs_budget=ATTN_SCORES_BYTES // (4 * self.config.num_attention_heads),
                             scale=self.rotary.softmax_scale)
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
            if step + 1 < ttt_steps:
                hidden = self.next_step_hidden(h)
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

    def compiled_regions(self, aux_hidden, input_ids, position_ids, seq_lens):
        """(name, region, args) of the regions compile_regions compiles (each layer's pre_attention and
        post_attention), with TTT step 0's inputs for this row, in call order; run it under torch.no_grad()."""
        aux_hidden, input_ids = squeeze_row(aux_hidden, 2), squeeze_row(input_ids, 1)
        position_ids = squeeze_row(position_ids, 1)
        hidden = self.combine_aux(aux_hidden)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = (x[:, None, :] for x in self.rotary(position_ids))
        meta = AttentionMeta(PackedLayout.build(seq_lens, hidden.shape[0], hidden.device), chunk_size=self.attn_chunk_size,
                             impl=self.attention_impl, scale=self.rotary.softmax_scale)
        for i, layer in enumerate(self.decoder_layers):
            pre_args = (hidden, embeds if layer.first else None, cos, sin)
            yield f"layer {i} pre_attention", layer.pre_attention, pre_args
            q, k, v, residual = layer.pre_attention(*pre_args)
            post_args = (ATTENTION_BACKENDS[meta.impl].attend(q, [k], [v], meta), residual)
            yield f"layer {i} post_attention", layer.post_attention, post_args
            hidden = layer.post_attention(*post_args)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


# -- the Llama EAGLE-3 family (common/model/draft/registry.py) ----------------------------------


def trainable_params(d: DraftModelConfig) -> int:
    """P: fc (and its norms), every decoder layer (layer 0 reads 2H and has hidden_norm), norm, lm_head (embed_tokens is
    frozen)."""
    H, I, hd = d.hidden_size, d.intermediate_size, d.head_dim
    q, kv = d.num_attention_heads * hd, d.num_key_value_heads * hd

    def layer(inp: int, first: bool) -> int:
        return inp * (q + 2 * kv) + q * H + 3 * H * I + 2 * H + (H if first else 0)

    return (d.num_aux * d.target_hidden_size * H + fc_norm_params(d) + layer(2 * H, True)
            + (d.num_hidden_layers - 1) * layer(H, False) + H + d.draft_vocab_size * H)


def fc_norm_params(d: DraftModelConfig) -> int:
    """The weights of the norms before fc: fc_norm's (one H_t per aux state) or norm_before_fc's (num_aux * H_t)."""
    return d.num_aux * d.target_hidden_size if (d.fc_norm or d.norm_before_fc) else 0


def largest_param(d: DraftModelConfig) -> int:
    """The largest trainable tensor: fc, lm_head, layer 0's q_proj or an MLP projection."""
    H = d.hidden_size
    return max(d.num_aux * d.target_hidden_size * H, d.draft_vocab_size * H, 2 * H * d.num_attention_heads * d.head_dim,
               H * d.intermediate_size)


def kv_bytes_per_token(d: DraftModelConfig, tensor_parallel_size: int, bytes_per_value: int) -> int:
    """A key and a value per KV head per layer; vLLM builds the draft under the target's tensor parallelism, so
    the KV heads split over the ranks, at least one each (common/serving/sizing.py)."""
    kv_heads = max(1, math.ceil(d.num_key_value_heads / tensor_parallel_size))
    return d.num_hidden_layers * 2 * kv_heads * d.head_dim * bytes_per_value


LLAMA_EAGLE3_FAMILY = register(DraftFamily(
    architecture=OFFICIAL_ARCHITECTURE,  # what vLLM's llama_eagle3.py serves
    aliases=("Eagle3LlamaForCausalLM", "Eagle3Speculator"),  # the official EAGLE repo's name, the speculators format's
    config_class=DraftModelConfig,
    model_class=Eagle3DraftModel,
    build_config=build_draft_config,
    # our names are the official format's; speculators calls layer 0 (our midlayer) layers.0
    adapter=StateDictAdapter(speculators=(("midlayer.", "layers.0."),), speculators_architecture="Eagle3Speculator"),
    trainable_params=trainable_params,
    largest_param=largest_param,
    kv_bytes_per_token=kv_bytes_per_token,
    attention_widths=grouped_query_widths,  # q/k/v_proj from the layer input, rotary over the whole head
    fsdp_unit_classes=(),  # one unit: a layer runs once per TTT step (common.core.distributed.wrap_parallel says why)
    draft_keys=None,  # build_draft_config reads every draft.* key
    label="the Llama draft",
))
