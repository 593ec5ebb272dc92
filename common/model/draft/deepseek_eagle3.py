"""The MLA EAGLE-3 draft: vLLM's `Eagle3DeepseekV2ForCausalLM` (vllm/model_executor/models/deepseek_eagle3.py),
the draft vLLM and SGLang serve for Kimi-K2.5 (docs/design.md#the-mla-draft-family).

It is the Llama draft (llama_eagle3.py: fc, the layer-0 wiring, the dense MLP, norm, lm_head, d2t, the TTT
loop) with DeepSeek's multi-head latent attention in place of q/k/v_proj, as vLLM's DeepseekV2MLAAttention
(deepseek_v2.py) and its MLA layer (layers/mla.py `forward`, attention/mla_attention.py) compute it:

    q       = q_b_proj(q_a_layernorm(q_a_proj(x)))   with q_lora_rank (else q_proj(x)): heads x (nope + rope)
    c, k_pe = kv_a_proj_with_mqa(x)                   the latent [kv_lora_rank] and one shared rope key [rope]
    k_nope, v = kv_b_proj(kv_a_layernorm(c))          heads x (nope + v_head_dim)
    q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe) on every head]       (rope: interleaved pairs)
    attention at scale qk_head_dim**-0.5, times yarn's mscale(factor, mscale_all_dim)**2 with yarn rope
    o_proj: heads x v_head_dim -> H

The TTT attention caches the decompressed k [T, heads, nope + rope] and v [T, heads, v_head_dim]: the backends
take v heads of another width than q/k (attention.py). State-dict names are vLLM's checkpoint names
(`midlayer.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj}`, `midlayer.mlp.*`, `fc`, `norm`, `lm_head`, `d2t`); vLLM fuses q_a_proj + kv_a_proj_with_mqa and
gate + up_proj when it loads them. EAGLE-3.1's fc_norm and norm_output are the Llama draft's (`fc_norm.{i}.weight`);
vLLM's MLA draft has no norm_before_fc. The module ends with the family's registration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from common.core.errors import ConfigError
from common.model.draft.config import DraftModelConfig, _text_attr, build_draft_config, draft_rope_scaling
from common.model.draft.layout import _wide
from common.model.draft.llama_eagle3 import DecoderLayer, Eagle3DraftModel, RMSNorm, fc_norm_params
from common.model.draft.registry import AttentionWidths, DraftFamily, StateDictAdapter, register

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
# vLLM reads the draft's config.json as a DeepseekV2Config. Not "deepseek_v3": vLLM's speculative config rewrites
# an EAGLE draft of that model_type into a DeepSeek MTP model, which it then cannot build.
MODEL_TYPE = "deepseek_v2"
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(kw_only=True)
class DeepseekEagle3Config(DraftModelConfig):
    """The Llama draft's fields plus MLA's sizes. num_key_value_heads and head_dim are derived (MLA decompresses
    one k and v per head; head_dim is the q/k head width, what the attention's self-check and 04's planner read)."""

    q_lora_rank: Optional[int]  # None: q_proj straight from the layer input
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_key_value_heads: int = field(init=False, default=0)
    head_dim: int = field(init=False, default=0)
    # vLLM's deepseek_eagle3.py reads fc_norm and norm_output, and no norm_before_fc: a draft trained with it would be
    # served without that norm, so it is refused
    norm_flags = frozenset({"fc_norm", "norm_output"})

    def __post_init__(self):
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.qk_head_dim
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"MLA draft config {name} must be a positive integer, got {value!r}")
        if not isinstance(self.qk_nope_head_dim, int) or self.qk_nope_head_dim < 0:
            raise ConfigError(f"MLA draft config qk_nope_head_dim must be an integer >= 0, got {self.qk_nope_head_dim!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ConfigError(f"MLA draft config q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"MLA draft config qk_rope_head_dim must be even (rope rotates pairs), got {self.qk_rope_head_dim}")
        super().__post_init__()
        if self.hidden_size % self.num_attention_heads:  # transformers' DeepseekV2Config refuses it when vLLM loads
            raise ConfigError(f"MLA draft num_attention_heads ({self.num_attention_heads}) must divide hidden_size "
                              f"({self.hidden_size}), as vLLM's DeepseekV2Config requires")
        if self.hidden_act != "silu":  # vLLM's DeepseekV2MLP has no other
            raise ConfigError(f"MLA draft hidden_act {self.hidden_act!r} is not supported: vLLM's DeepseekV2MLP takes silu only")
        self.rope_scaling = _mla_rope_scaling(self.rope_scaling)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim

    def to_vllm_config(self, **extra) -> dict:
        """config.json of the official format vLLM 0.32 loads as Eagle3DeepseekV2ForCausalLM."""
        d = super().to_vllm_config(**extra)  # the EAGLE-3 keys (aux ids, vocab sizes, norms, rope), kept consistent
        del d["head_dim"], d["mlp_bias"]  # the Llama layer's; MLA's widths follow
        d.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, **{k: getattr(self, k) for k in MLA_KEYS})
        d.update({k: v for k, v in extra.items() if k != "eagle_aux_hidden_state_layer_ids"})  # the caller's keys win
        return d

    @classmethod
    def fields_from_vllm_config(cls, d: dict) -> dict:
        """Also reads a published MLA draft's config.json (model_type kimi_k2 or deepseek_v3, legacy rope keys)."""
        fields = super().fields_from_vllm_config(d)
        del fields["num_key_value_heads"], fields["head_dim"]
        missing = [k for k in MLA_KEYS[1:] if d.get(k) is None]
        if missing:
            raise KeyError(missing[0])
        q_lora = d.get("q_lora_rank")
        return {**fields, **{k: int(d[k]) for k in MLA_KEYS[1:]}, "q_lora_rank": None if q_lora is None else int(q_lora)}


def _mla_rope_scaling(scaling: dict | None) -> dict | None:
    """The MLA draft's rope scaling in one form: None or yarn. vLLM's MLA attention turns any non-default rope
    type into DeepSeek's yarn, so the draft supports yarn alone (as DeepSeek-V3 and Kimi use it)."""
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    kind = {"deepseek_yarn": "yarn"}.get(kind, kind)
    if kind == "default":
        return None
    if kind != "yarn" or "factor" not in scaling or "original_max_position_embeddings" not in scaling:
        raise ConfigError(f"the MLA draft's rope_scaling {scaling} is not yarn with factor and "
                          f"original_max_position_embeddings, the only scaling vLLM's MLA attention applies; use the "
                          f"target's (draft.rope_scaling: target) or none ({{rope_type: default}})")
    return {**scaling, "rope_type": "yarn"}


# -- rotary (vllm/model_executor/layers/rotary_embedding: get_rope with is_neox_style=False; with yarn,
#    deepseek_scaling_rope.py DeepseekScalingRotaryEmbedding and common.py's yarn helpers) -----------------


def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, factor: float, original_max_positions: int, beta_fast: float,
                   beta_slow: float) -> torch.Tensor:
    """DeepseekScalingRotaryEmbedding._compute_inv_freq: the extrapolated frequencies above the correction range,
    the interpolated (divided by factor) below it, a linear ramp between."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # as vLLM: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


class MLARotaryEmbedding(nn.Module):
    """RoPE of the qk_rope slice as vLLM's MLA applies it: interleaved pairs (x[2i], x[2i+1]); with yarn, DeepSeek's
    frequencies, cos/sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the attention's softmax
    scale times mscale(factor, mscale_all_dim)**2 (vLLM's "deepseek_yarn"; not with attention_factor 1.0, which vLLM
    names "deepseek_llama_scaling"). inv_freq is a plain fp32 attribute, as in the Llama rotary."""

    def __init__(self, config: DeepseekEagle3Config):
        super().__init__()
        dim, base, s = config.qk_rope_head_dim, config.rope_theta, config.rope_scaling
        softmax_mscale = 1.0
        if s is None:
            self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.mscale = 1.0
        else:
            factor = float(s["factor"])
            self.inv_freq = _yarn_inv_freq(dim, base, factor, int(s["original_max_position_embeddings"]),
                                           float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1)))
            mscale_all_dim = float(s.get("mscale_all_dim", 0))
            self.mscale = yarn_get_mscale(factor, float(s.get("mscale", 1))) / yarn_get_mscale(factor, mscale_all_dim)
            if s.get("attention_factor") != 1.0:
                softmax_mscale = yarn_get_mscale(factor, mscale_all_dim) ** 2
        self.softmax_scale = config.qk_head_dim ** -0.5 * softmax_mscale

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, qk_rope_head_dim] fp32, each frequency repeated for its pair."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = (positions.float()[:, None] * self.inv_freq[None, :]).repeat_interleave(2, dim=-1)
        return freqs.cos() * self.mscale, freqs.sin() * self.mscale


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; pair (x[2i], x[2i+1]) rotated by angle i (vLLM's rotate_gptj); cos/sin [T, 1, d] fp32."""
    xf = _wide(x)
    rotated = torch.stack((-xf[..., 1::2], xf[..., 0::2]), dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(x.dtype)


# -- the modules ----------------------------------------------------------------------------------------------


class MLAAttention(nn.Module):
    """DeepseekV2MLAAttention's projections under vLLM's names; forward gives the decompressed q, k, v."""

    def __init__(self, config: DeepseekEagle3Config, input_size: int):
        super().__init__()
        c = config
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
        self.nope, self.rope, self.v_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        qk_width = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(input_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, qk_width, bias=False)
        else:
            self.q_proj = nn.Linear(input_size, qk_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(input_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        """x [T, in] -> q, k [T, heads, nope + rope] (rope on the last rope values) and v [T, heads, v_head_dim]."""
        T, nh = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank is not None else self.q_proj(x)
        q_nope, q_pe = q.view(T, nh, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(latent)).view(T, nh, self.nope + self.v_head_dim).split(
            [self.nope, self.v_head_dim], dim=-1)
        k_pe = apply_interleaved_rope(k_pe.unsqueeze(1), cos, sin).expand(T, nh, self.rope)
        q = torch.cat((q_nope, apply_interleaved_rope(q_pe, cos, sin)), dim=-1)
        return q, torch.cat((k_nope, k_pe), dim=-1), v.contiguous()


class MLADecoderLayer(DecoderLayer):
    """vLLM's DeepseekV2Eagle3DecoderLayer: the Llama layer's norms, residual and dense MLP around MLA."""

    attention_class = MLAAttention


class Eagle3DeepseekV2Draft(Eagle3DraftModel):
    """The MLA EAGLE-3 draft: the Llama draft's TTT loop and heads, MLA layers, interleaved (yarn) rope."""

    layer_class = MLADecoderLayer
    rotary_class = MLARotaryEmbedding


# -- the family (common/model/draft/registry.py) --------------------------------------------------------------


def build_mla_draft_config(cfg, info, draft_vocab_size: int, aux_layer_ids: list[int]) -> DeepseekEagle3Config:
    """The MLA draft's config: MLA's sizes are the target's (it must be an MLA target), the other keys as the Llama
    family builds them (draft.* nulls take the target's), rope the target's unless draft.rope_scaling names one."""
    d, tc = cfg.draft, info.text_config
    DEEPSEEK_EAGLE3_FAMILY.check_draft_keys(d)  # its heads are the target's MLA sizes: no head_dim, num_key_value_heads
    missing = [k for k in MLA_KEYS[1:] if _text_attr(tc, k) is None]
    if missing:
        raise ConfigError(f"the {ARCHITECTURE} draft takes its MLA sizes from the target, whose config has no "
                          f"{missing[0]} (not an MLA model); use draft.architecture: LlamaForCausalLMEagle3 for this target")
    base = build_draft_config(cfg, info, draft_vocab_size, aux_layer_ids)
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__ if base.__dataclass_fields__[k].init}
    del fields["num_key_value_heads"], fields["head_dim"]
    fields["rope_scaling"] = draft_rope_scaling("target" if d.rope_scaling is None else d.rope_scaling, tc)
    q_lora = _text_attr(tc, "q_lora_rank")
    return DeepseekEagle3Config(**fields, **{k: int(_text_attr(tc, k)) for k in MLA_KEYS[1:]},
                                q_lora_rank=None if q_lora is None else int(q_lora))


def _layer_params(d: DeepseekEagle3Config, inp: int, first: bool) -> int:
    H, nh = d.hidden_size, d.num_attention_heads
    q = inp * nh * d.qk_head_dim if d.q_lora_rank is None else inp * d.q_lora_rank + d.q_lora_rank * (1 + nh * d.qk_head_dim)
    kv = inp * (d.kv_lora_rank + d.qk_rope_head_dim) + d.kv_lora_rank * (1 + nh * (d.qk_nope_head_dim + d.v_head_dim))
    return q + kv + nh * d.v_head_dim * H + 3 * H * d.intermediate_size + 2 * H + (H if first else 0)


def trainable_params(d: DeepseekEagle3Config) -> int:
    """P: fc (and fc_norm), every decoder layer (layer 0 reads 2H and has hidden_norm), norm, lm_head (embed_tokens is
    frozen)."""
    H = d.hidden_size
    return (d.num_aux * d.target_hidden_size * H + fc_norm_params(d) + _layer_params(d, 2 * H, True)
            + (d.num_hidden_layers - 1) * _layer_params(d, H, False) + H + d.draft_vocab_size * H)


def largest_param(d: DeepseekEagle3Config) -> int:
    """The largest trainable tensor: fc, lm_head, an MLP projection, or one of layer 0's attention projections."""
    H, nh = d.hidden_size, d.num_attention_heads
    q = [2 * H * nh * d.qk_head_dim] if d.q_lora_rank is None else [2 * H * d.q_lora_rank, d.q_lora_rank * nh * d.qk_head_dim]
    return max(d.num_aux * d.target_hidden_size * H, d.draft_vocab_size * H, H * d.intermediate_size, *q,
               2 * H * (d.kv_lora_rank + d.qk_rope_head_dim), d.kv_lora_rank * nh * (d.qk_nope_head_dim + d.v_head_dim),
               nh * d.v_head_dim * H)


def kv_bytes_per_token(d: DeepseekEagle3Config, tensor_parallel_size: int, bytes_per_value: int) -> int:
    """vLLM caches MLA's latent (kv_lora_rank + qk_rope_head_dim values) per layer, whole on every tensor-parallel
    rank: the heads are split, the latent is not (common/serving/sizing.py)."""
    return d.num_hidden_layers * (d.kv_lora_rank + d.qk_rope_head_dim) * bytes_per_value


def attention_widths(d: DeepseekEagle3Config) -> AttentionWidths:
    """What MLAAttention.forward keeps per token (04's memory planner): q and k of nope + rope per head, v and the
    output of v_head_dim per head, cos/sin of the rope slice, and the q latent (q_a_proj's output, with q_lora_rank)
    and the kv latent (kv_a_proj_with_mqa's latent part), each through its RMSNorm into q_b_proj / kv_b_proj."""
    nh = d.num_attention_heads
    return AttentionWidths(q=nh * d.qk_head_dim, k=nh * d.qk_head_dim, v=nh * d.v_head_dim, out=nh * d.v_head_dim,
                           rope=d.qk_rope_head_dim, normed_latents=(d.q_lora_rank or 0) + d.kv_lora_rank)


DEEPSEEK_EAGLE3_FAMILY = register(DraftFamily(
    architecture=ARCHITECTURE,  # what vLLM's deepseek_eagle3.py serves
    aliases=("Eagle3DeepseekV3ForCausalLM",),  # vLLM's alias of the same class
    config_class=DeepseekEagle3Config,
    model_class=Eagle3DeepseekV2Draft,
    build_config=build_mla_draft_config,
    adapter=StateDictAdapter(),  # our names are vLLM's; there is no speculators format of this draft
    trainable_params=trainable_params,
    largest_param=largest_param,
    kv_bytes_per_token=kv_bytes_per_token,
    attention_widths=attention_widths,
    fsdp_unit_classes=(),  # one unit, as the Llama draft (a layer runs once per TTT step)
    # draft.* keys build_mla_draft_config reads: not head_dim or num_key_value_heads (the MLA sizes are the target's),
    # nor norm_before_fc (vLLM's MLA draft has none), and the EAGLE-3.1 flags its config reads
    draft_keys=frozenset({"hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "rope_theta",
                          "rms_norm_eps", "norm_before_residual", "max_position_embeddings", "rope_scaling"})
    | DeepseekEagle3Config.norm_flags,
    label="the MLA draft",
    latent_attention=True,
))
