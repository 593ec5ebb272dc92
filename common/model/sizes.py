"""The sizes a model's config gives (a target's text config, a draft's config.json), range-checked where the
planners read them (common/serving/sizing.py, common/train/memory_plan.py): a string, a bool, NaN, zero or a
negative count is one ConfigError naming the key and the value, not a traceback or an absurd plan."""

from __future__ import annotations

from typing import Any

from common.core.config import Range
from common.core.errors import ConfigError

# Each size's range; the bounds keep the planners' arithmetic in sane numbers (scripts/plan_memory.py's
# --target-* flags take the same ranges).
SIZES = {
    "num_hidden_layers": Range(ge=1, le=4096),
    "hidden_size": Range(ge=1, le=2**17),
    "vocab_size": Range(ge=1, le=2**24),
    "num_attention_heads": Range(ge=1, le=2**14),
    "num_key_value_heads": Range(ge=1, le=2**14),
    "head_dim": Range(ge=1, le=2**14),
    "intermediate_size": Range(ge=1, le=2**20),
    "max_position_embeddings": Range(ge=1, le=2**32),
    "kv_lora_rank": Range(ge=0, le=2**17),  # MLA's latent; 0 or absent: not MLA
    "qk_rope_head_dim": Range(ge=0, le=2**14),
}


def model_size(config: Any, name: str, default: Any = None) -> Any:
    """config's `name` (a dict key or an attribute), an int in SIZES[name]; `default` when absent or null."""
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    if value is None:
        return default
    # bool is an int to Python, and JSON's 64.0 or NaN are floats: a size is a JSON integer
    if isinstance(value, bool) or not isinstance(value, int) or not SIZES[name].holds(value):
        raise ConfigError(f"{name} must be an integer {SIZES[name].describe()}, got {value!r}")
    return value


def check_model_sizes(config: Any) -> None:
    """Every size of SIZES the config gives is in range (absent ones are the reader's to require)."""
    for name in SIZES:
        model_size(config, name)
