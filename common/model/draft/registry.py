"""The draft registry: every draft architecture the pipeline trains, exports and loads, one `DraftFamily` each
(docs/design.md#draft-families-the-registry). A new architecture is one module beside llama_eagle3.py (its config,
model and the functions below, ending with its `register(DraftFamily(...))`) plus its import in the package's
__init__.py, which registers it: the stages, the export and the planners ask the family, never a class.

    family = family_of(config_json["architectures"])  # by the names a config.json gives (aliases included)
    family = family_of_config(draft_cfg)               # by a config object (the most specific class registered)
    family = family_of_model(draft)                    # by a model object
    draft = family.build(draft_cfg, attention="chunked", gradient_checkpointing=False)

The Llama EAGLE-3 family registers itself in common/model/draft/llama_eagle3.py, which the package imports, so
it is always known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from common.core.config import DraftConfig
from common.core.errors import ConfigError
from common.model.draft.config import OFFICIAL_ARCHITECTURE
from common.model.draft.contract import contract_problems

# draft.architecture's default (common/core/config.py spells it too: core imports no model), and the family of a
# config.json that names no architecture
DEFAULT_ARCHITECTURE = OFFICIAL_ARCHITECTURE


@dataclass(frozen=True)
class StateDictAdapter:
    """Our state-dict names <-> the names of the two formats vLLM loads, as (our prefix, their prefix) pairs; a name
    under none of the prefixes is spelt the same. The formats must not use one another's prefixes for other tensors:
    reading maps a name of either format back to ours."""

    official: tuple[tuple[str, str], ...] = ()  # vLLM's official format (config.json `architectures`: the family's)
    speculators: tuple[tuple[str, str], ...] = ()  # the speculators format
    speculators_architecture: Optional[str] = None  # its config.json `architectures`; None: no speculators format

    def to_official(self, name: str) -> str:
        return _renamed(name, self.official)

    def to_speculators(self, name: str) -> str:
        return _renamed(name, self.speculators)

    def to_ours(self, name: str) -> str:
        """A tensor name of either format under our name."""
        return _renamed(name, [(theirs, ours) for ours, theirs in (*self.official, *self.speculators)])


def _renamed(name: str, prefixes) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


@dataclass(frozen=True)
class AttentionWidths:
    """What one decoder layer's attention holds per token, in values (04's memory planner multiplies them by the
    bytes of the dtype each is kept in): the family's layout, so the planner names no family's internals."""

    q: int  # q after the rotary, all heads
    k: int  # the key each TTT step keeps for the later steps, all (KV) heads
    v: int  # the value, likewise
    out: int  # the attention's output, o_proj's input
    rope: int  # the rotary's cos (and sin) width
    # values inside the attention that pass an RMSNorm into a projection (MLA's q and kv latents), each kept for the
    # backward as the norm's fp32 input and its output; 0 when q/k/v come straight from the layer input
    normed_latents: int = 0


def grouped_query_widths(config) -> AttentionWidths:
    """q/k/v projections straight from the layer input (a Llama layer): num_attention_heads q heads and
    num_key_value_heads k and v heads, all of head_dim, rotary over the whole head."""
    hd = config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return AttentionWidths(q=q, k=kv, v=kv, out=q, rope=hd)


@dataclass(frozen=True)
class DraftFamily:
    """One draft architecture: what 04 trains, the export writes and the loaders read, and what the planners count.
    Its config and model classes implement the draft contract (common/model/draft/contract.py)."""

    architecture: str  # the config.json `architectures` name our export writes (vLLM picks its model class by it)
    aliases: tuple[str, ...]  # other names read as this family (the speculators format's, the official repo's)
    config_class: type  # from_vllm_config(dict) / to_vllm_config(**extra): the draft's config.json
    model_class: type  # model_class(config, attention=, attn_chunk_size=, gradient_checkpointing=)
    # the config 04 builds from the run config and the target: (cfg, target info, draft_vocab_size, aux_layer_ids)
    build_config: Callable[[Any, Any, int, list[int]], Any]
    adapter: StateDictAdapter
    # 04's memory planner (common/train/memory_plan.py): the trainable parameters P of a config, and its largest
    # trainable tensor (the CPU optimizer step's temporaries are per tensor)
    trainable_params: Callable[[Any], int]
    largest_param: Callable[[Any], int]
    # serving sizing (common/serving/sizing.py): KV cache bytes one token takes in the draft's layers on one GPU,
    # (config, tensor_parallel_size, bytes per cached value) -> bytes
    kv_bytes_per_token: Callable[[Any, int, int], int]
    # 04's memory planner: the widths one layer's attention holds per token (AttentionWidths); the default reads
    # num_attention_heads / num_key_value_heads / head_dim as a Llama layer lays them out
    attention_widths: Callable[[Any], AttentionWidths] = grouped_query_widths
    # module classes FSDP shards as units of their own inside the draft (common.core.distributed.wrap_parallel);
    # () = the whole draft is one unit
    fsdp_unit_classes: tuple[type, ...] = ()
    # the run config's draft.* keys its build_config reads (draft.architecture aside); None = every one. A key it does
    # not read, set to anything but its default, is refused (check_draft_keys) rather than silently ignored.
    draft_keys: Optional[frozenset[str]] = None
    label: str = ""  # how error lines name it ("the MLA draft"); "" = "the <architecture> draft"
    # its attention is multi-head latent attention: vLLM serves it on an MLA target's attention backend (on vLLM-CPU
    # the only kind of draft an MLA target can be served with: common/evaluate/draft.py check_servable_on_cpu)
    latent_attention: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (self.architecture, *self.aliases)

    def build(self, config, **settings):
        """A fresh draft of `config` (random init from torch's generator; settings: the model class's keywords)."""
        return self.model_class(config, **settings)

    def read_config(self, raw: dict):
        """The config object of a config.json (either format) of this family."""
        return self.config_class.from_vllm_config(raw)

    def vllm_config(self, config, **extra) -> dict:
        """config.json of the official format, naming this family's architecture."""
        return {**config.to_vllm_config(**extra), "architectures": [self.architecture]}

    def describe(self) -> str:
        return f"{self.label} ({self.architecture})" if self.label else f"the {self.architecture} draft"

    def check_draft_keys(self, draft_section) -> None:
        """ConfigError, one line, naming the first draft.* key of the run config (core.config.DraftConfig) that is
        set but that this family does not read."""
        if self.draft_keys is None:
            return
        default = DraftConfig()
        for f in dataclasses.fields(DraftConfig):
            key = f.name
            if key == "architecture" or key in self.draft_keys:
                continue
            if getattr(draft_section, key) != getattr(default, key):
                raise ConfigError(f"draft.{key} does not apply to {self.describe()}, which reads only draft."
                                  f"{', draft.'.join(sorted(self.draft_keys))}; remove draft.{key} from the config")


DRAFT_FAMILIES: dict[str, DraftFamily] = {}  # every name (architecture and aliases) -> its family


def register(family: DraftFamily) -> DraftFamily:
    """Add `family` under its architecture and aliases. Its names, config class and model class must be its own: a
    config or a model tells its family by its class (family_of_config, family_of_model)."""
    broken = contract_problems(family.config_class, family.model_class)
    if broken:
        raise ValueError(f"draft family {family.architecture}: {'; '.join(broken)} (common/model/draft/contract.py)")
    for other in dict.fromkeys(DRAFT_FAMILIES.values()):  # each family once, in registration order
        if other is family:
            continue
        taken = [n for n in family.names if n in other.names]
        if taken or other.config_class is family.config_class or other.model_class is family.model_class:
            what = f"the names {taken}" if taken else "its config class or model class"
            raise ValueError(f"draft family {family.architecture}: {what} belong to the family {other.architecture}; "
                             f"give it names and classes of its own (a subclass is enough)")
    for name in family.names:
        DRAFT_FAMILIES[name] = family
    return family


def unregister(family: DraftFamily) -> None:
    """Remove `family` (tests register families of their own and remove them after)."""
    for name in family.names:
        if DRAFT_FAMILIES.get(name) is family:
            del DRAFT_FAMILIES[name]


def known_architectures() -> list[str]:
    return sorted(DRAFT_FAMILIES)


def latent_attention_families() -> list[DraftFamily]:
    """The registered families whose attention is MLA, each once."""
    return [f for f in dict.fromkeys(DRAFT_FAMILIES.values()) if f.latent_attention]


def family_of(architectures, where: str = "the draft's config.json",
              fix: str = "use a draft of a known architecture") -> DraftFamily:
    """The family of a config.json's `architectures` list (no list at all: the default family, as a config.json
    that names none has always been read). A name no family has, or names of two families, is one ConfigError
    line: where it was found, the names known, and `fix` (what to do)."""
    if isinstance(architectures, (list, tuple)):
        names = list(architectures)
    else:  # a config.json holding one name, or something else: a name to report
        names = [architectures] if architectures else []
    if not names:
        return DRAFT_FAMILIES[DEFAULT_ARCHITECTURE]
    unknown = [n for n in names if not isinstance(n, str) or n not in DRAFT_FAMILIES]
    if unknown:
        raise ConfigError(f"{where} names the draft architecture {', '.join(map(repr, unknown))}, which this pipeline "
                          f"does not know (known: {', '.join(known_architectures())}); {fix}, or register its family "
                          f"(common/model/draft/registry.py)")
    families = {DRAFT_FAMILIES[n].architecture: DRAFT_FAMILIES[n] for n in names}
    if len(families) > 1:
        raise ConfigError(f"{where} names architectures of {len(families)} draft families ({', '.join(names)}); a "
                          f"draft is of one family: keep the name of the one its weights are")
    return next(iter(families.values()))


def _most_specific(cls: type, attribute: str) -> Optional[DraftFamily]:
    """The family whose `attribute` class is nearest to `cls` in its method resolution order (a subclass's family
    before its base's)."""
    by_class = {getattr(f, attribute): f for f in DRAFT_FAMILIES.values()}
    return next((by_class[c] for c in cls.__mro__ if c in by_class), None)


def family_of_config(config) -> DraftFamily:
    family = _most_specific(type(config), "config_class")
    if family is None:
        raise TypeError(f"{type(config).__name__} is the config class of no registered draft family "
                        f"(known: {', '.join(known_architectures())})")
    return family


def family_of_model(model) -> DraftFamily:
    """The family of a draft (or of its DDP/FSDP wrapper's module: FSDP2 subclasses the model's class)."""
    model = getattr(model, "module", model)
    family = _most_specific(type(model), "model_class")
    if family is None:
        raise TypeError(f"{type(model).__name__} is the model class of no registered draft family "
                        f"(known: {', '.join(known_architectures())})")
    return family
