"""The draft's config (common.model.draft.DraftModelConfig): its sizes, checks and the official config.json
fields vLLM reads, built from our YAML and the target's config (build_draft_config), with the target's rope
scaling carried over (draft_rope_scaling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from common.core.config import FC_NORMS_EXCLUSIVE
from common.core.errors import ConfigError
from common.model.draft.contract import NORM_FLAGS, DraftConfigContract

OFFICIAL_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(kw_only=True)
class DraftModelConfig(DraftConfigContract):  # the Llama family's; the contract says what the stages read of it
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
    # EAGLE-3.1 (contract.NORM_FLAGS; all false = EAGLE-3): vLLM's llama_eagle3.py reads all three
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02

    norm_flags = frozenset(NORM_FLAGS)  # no annotation: a class attribute, not a dataclass field

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
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"draft hidden_act '{self.hidden_act}' is not supported; use one of {sorted(ACTIVATIONS)}")
        unread = [flag for flag in NORM_FLAGS if getattr(self, flag) and flag not in self.norm_flags]
        if unread:
            raise ConfigError(f"{unread[0]} is set, but vLLM's model of this draft architecture does not read it and "
                              f"would serve the draft without that norm; set draft.{unread[0]}: false (it reads only "
                              f"{', '.join(sorted(self.norm_flags))})")
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError(FC_NORMS_EXCLUSIVE)

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def value_head_dim(self) -> int:
        """The width of a value head (the attention output's per head): head_dim here."""
        return self.head_dim

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
            **{flag: getattr(self, flag) for flag in NORM_FLAGS if flag in self.norm_flags},
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
        return cls(**cls.fields_from_vllm_config(d))

    @classmethod
    def fields_from_vllm_config(cls, d: dict) -> dict:
        """The constructor's keywords read from a config.json (a subclass adds its own keys to them)."""
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
        return dict(
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
            # vLLM's llama_eagle3.py reads norm_before_fc from eagle_config first, the others at the top
            fc_norm=bool(d.get("fc_norm", False)),
            norm_before_fc=bool(eagle_config.get("norm_before_fc", d.get("norm_before_fc", False))),
            norm_output=bool(d.get("norm_output", False)),
            hidden_act=d.get("hidden_act", "silu"),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )


ACTIVATIONS = {
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
        fc_norm=d.fc_norm,
        norm_before_fc=d.norm_before_fc,
        norm_output=d.norm_output,
        hidden_act=str(_text_attr(tc, "hidden_act", "silu")),
    )
