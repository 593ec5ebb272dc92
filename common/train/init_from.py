"""train.init_from: 04 starts from a vLLM-format EAGLE-3 draft, another run's export or a published one for
this target, instead of random weights (docs/design.md#starting-from-a-published-draft).

    init = InitDraft.read(cfg, info, aux_layer_ids, d2t, t2d, layout, env)  # Trainer.__init__: every check, and
                                                                            # the weights read whole, before
                                                                            # anything is written or deleted
    init.draft_cfg, init.d2t, init.t2d   # what 04 trains: the init's architecture, the vocab of train.init_vocab
    init.load_into(draft)                # build_model: its weights over the fresh draft (a resume's checkpoint
                                         # is loaded over them next)

The draft's architecture comes from the init's config.json (its family, common/model/draft/registry.py, and its
sizes); a `draft.*` key left at its default takes the init's value, one set to anything else must agree with it.
Without an init, draft.architecture names the family: `draft_family_for` decides, for 04 and its memory planner.
The vocabulary (train.init_vocab): `own` keeps the init's draft vocab (its d2t; without one, target ids
0..V_d-1, as vLLM reads such a draft), `remap` trains on 03's and carries over the init's lm_head rows of the
tokens both vocabularies hold. The EAGLE-3.1 norm flags (draft.fc_norm, draft.norm_before_fc, draft.norm_output;
train.init_norms): `match` refuses an init trained with other flags than draft.*'s (a 3.1 draft into a 3 run, or the
reverse), `convert` trains draft.*'s flags from its weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from common.core.config import DraftConfig
from common.core.distributed import DistEnv, on_rank0
from common.core.errors import ConfigError, DataError
from common.core.run_folder import Layout
from common.model.draft import (EMBEDDING_PREFIX, EMBEDDING_TENSOR, HEAD_TENSOR, NORM_FLAGS, VOCAB_MAP_TENSORS,
                                DraftConfigContract, DraftFamily, draft_rope_scaling, family_of, family_of_config)
from common.model.export import CONFIG_NAME, check_draft_tensors, draft_weight_files, read_draft_config, read_draft_tensors
from common.target.loading import load_target_tensors, target_fingerprint

D2T = VOCAB_MAP_TENSORS[0]
# DraftConfig keys -> the draft config fields they set (rope_scaling is compared resolved)
_DRAFT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "num_hidden_layers", "rope_theta", "rms_norm_eps", "norm_before_residual", "max_position_embeddings")


@dataclasses.dataclass
class InitDraft:
    path: Path
    mode: str  # train.init_vocab: own | remap
    family: DraftFamily  # the init's architecture (its config.json's `architectures`)
    config: DraftConfigContract  # the init's own
    draft_cfg: DraftConfigContract  # what 04 trains: the init's architecture with the draft vocab of `mode`
    d2t: torch.Tensor  # the vocab map 04 trains with (the init's, or 03's)
    t2d: torch.Tensor
    init_ids: torch.Tensor  # [V_d of the init] the target id of each of the init's lm_head rows
    has_d2t: bool  # whether the init's weights hold d2t (else its draft ids are target ids 0..V_d-1)
    shared: int  # tokens in both the init's draft vocab and 03's
    fingerprint: str  # of its config.json and weights, by content
    # Read whole by `read`, before --overwrite deletes train/: the init may be train/final or train/best ("continue
    # from my last draft"). load_into hands them to the draft and drops them.
    weights: dict[str, torch.Tensor]

    @classmethod
    def read(cls, cfg, info, aux_layer_ids: list[int], d2t: torch.Tensor, t2d: torch.Tensor, layout: Layout,
             env: DistEnv) -> "InitDraft":
        """The init in cfg.train.init_from, checked against this target, hidden/'s aux layers and the config's
        draft.* keys: ConfigError (one line listing every mismatch) or DataError (unreadable files)."""
        t = cfg.train
        path = Path(t.init_from)
        if not (path / CONFIG_NAME).is_file():
            raise ConfigError(f"train.init_from {path} is not a draft directory (no {CONFIG_NAME}); give a vLLM-format "
                              f"EAGLE-3 draft (config.json + *.safetensors), e.g. another run's train/final")
        config = read_draft_config(path)  # an architecture no family knows: one line, naming the file
        family = family_of_config(config)
        shapes = read_draft_tensors(path, shapes_only=True, family=family)
        problems = _target_problems(config, info, aux_layer_ids) + _draft_key_problems(cfg, config, info, family)
        if not problems and EMBEDDING_TENSOR in shapes:
            problems += on_rank0(lambda: _embedding_problems(path, cfg.target.model, family), env)
        if problems:
            raise ConfigError(f"train.init_from {path} does not fit this run: {'; '.join(problems)}; use a draft trained "
                              f"for this target (hidden size {info.hidden_size}, vocab {info.vocab_size}, aux layers "
                              f"{list(aux_layer_ids)}), or set train.init_from: null")
        norms = _norm_flags(cfg.draft)  # what 04 trains: draft.*'s EAGLE-3.1 norms
        if t.init_norms == "match" and _norm_flags(config) != norms:
            raise ConfigError(_norm_mismatch(path, config, cfg.draft))
        # vLLM loads a draft without d2t too: its draft_id_to_target_id stays zeros (draft id i = target id i)
        check_draft_tensors(shapes, config, draft_weight_files(path)[0], optional=set(VOCAB_MAP_TENSORS))
        weights = _read_finite(path, shapes, family)
        has_d2t = D2T in weights
        init_ids = torch.arange(config.draft_vocab_size)
        if has_d2t:
            init_ids = init_ids + weights[D2T].long()
        if init_ids.min() < 0 or init_ids.max() >= info.vocab_size or init_ids.unique().numel() != init_ids.numel():
            raise DataError(f"train.init_from {path}: its d2t maps draft ids outside the target vocab of {info.vocab_size} "
                            f"or two onto one target id; the draft is damaged: re-export or re-download it")
        shared = int(t2d[init_ids].sum())
        if t.init_vocab == "own":
            init_t2d = torch.zeros(info.vocab_size, dtype=torch.bool)
            init_t2d[init_ids] = True
            d2t, t2d = init_ids - torch.arange(init_ids.numel()), init_t2d
        draft_cfg = dataclasses.replace(config, draft_vocab_size=d2t.numel(), aux_layer_ids=list(aux_layer_ids), **norms)
        fingerprint = on_rank0(lambda: target_fingerprint(layout, str(path)), env)
        return cls(path, t.init_vocab, family, config, draft_cfg, d2t, t2d, init_ids, has_d2t, shared, fingerprint, weights)

    @property
    def identity(self) -> dict:
        """What a checkpoint trained from this init depends on (04's resume fingerprint): its content and the mode."""
        return {"weights": self.fingerprint, "vocab": self.mode}

    @torch.no_grad()
    def load_into(self, draft) -> str:
        """The init's weights into `draft` (built from draft_cfg, its vocab map set, lm_head initialised as
        train.init_lm_head says): every tensor; lm_head whole (own) or the rows of the shared tokens (remap).
        Returns the line 04 prints: which vocabulary, and how many rows were carried over."""
        weights, self.weights = self.weights, {}
        own = draft.state_dict()  # tensors sharing the draft's storage
        head = weights.pop(HEAD_TENSOR)
        for name, tensor in weights.items():
            # the map is set, the embedding the target's; a norm the draft has not (train.init_norms: convert) dropped
            if name not in VOCAB_MAP_TENSORS and not name.startswith(EMBEDDING_PREFIX) and name in own:
                own[name].copy_(tensor)
        where = f"04_train: init_from {self.path}"
        if self.mode == "own":
            draft.head_weight.copy_(head)
            vocab = "its d2t" if self.has_d2t else f"no d2t: target ids 0..{self.init_ids.numel() - 1}, as vLLM reads it"
            return (f"{where}: its own draft vocab kept ({self.init_ids.numel()} tokens, {vocab}; vocab/vocab_map.safetensors "
                    f"is not used, {self.shared} of its tokens are in it); all {self.init_ids.numel()} lm_head rows "
                    f"carried over")
        row_of = torch.full((self.config.vocab_size,), -1, dtype=torch.long)  # target id -> the init's lm_head row
        row_of[self.init_ids] = torch.arange(self.init_ids.numel())
        rows = row_of[draft.draft_vocab_target_ids().cpu()]
        carried = rows >= 0
        draft.head_weight[carried.to(draft.head_weight.device)] = head[rows[carried]].to(draft.head_weight)
        n, total = int(carried.sum()), rows.numel()
        return (f"{where}: remapped onto 03's draft vocab ({total} tokens): {n} lm_head rows carried over (the tokens both "
                f"vocabularies hold), {total - n} start as train.init_lm_head says")


def _norm_flags(source) -> dict[str, bool]:
    """The EAGLE-3.1 norm flags of a draft config or of the run config's draft section."""
    return {flag: bool(getattr(source, flag)) for flag in NORM_FLAGS}


def _norm_mismatch(path: Path, config: DraftConfigContract, draft_section) -> str:
    """The line refusing an init trained with other EAGLE-3.1 norms than draft.* asks for (train.init_norms: match):
    vLLM serves a draft with the norms its config.json names, so training it with others would be a silent change."""
    def variant(flags: dict) -> str:
        on = [f for f, v in flags.items() if v]
        return f"EAGLE-3.1 ({', '.join(on)})" if on else "EAGLE-3 (no norm flags)"

    theirs, ours = _norm_flags(config), _norm_flags(draft_section)
    differ = [f for f in NORM_FLAGS if theirs[f] != ours[f]]
    keep = ", ".join(f"draft.{f}: {str(theirs[f]).lower()}" for f in differ)
    return (f"train.init_from {path} is an {variant(theirs)} draft and this run trains {variant(ours)}; set {keep} to "
            f"train it as it was trained, or train.init_norms: convert to retrain it with draft.*'s norms (a norm the "
            f"init lacks starts at 1, one it has that the run has not is dropped)")


def _target_problems(config: DraftConfigContract, info, aux_layer_ids: list[int]) -> list[str]:
    problems = []
    if config.target_hidden_size != info.hidden_size:
        problems.append(f"it reads target hidden states of size {config.target_hidden_size}, this target's are {info.hidden_size}")
    if config.hidden_size != info.hidden_size:
        problems.append(f"its hidden_size is {config.hidden_size}, not the target's {info.hidden_size} (the draft reads the "
                        f"target's token embedding)")
    if config.vocab_size != info.vocab_size:
        problems.append(f"its vocab_size is {config.vocab_size}, this target's vocab is {info.vocab_size}")
    if list(config.aux_layer_ids) != list(aux_layer_ids):
        problems.append(f"it reads aux layers {list(config.aux_layer_ids)}, hidden/ holds layers {list(aux_layer_ids)} "
                        f"(set target.aux_layer_ids to its ids and rerun 02_extract_hidden.py --overwrite to train it)")
    return problems


def _draft_key_problems(cfg, config: DraftConfigContract, info, family: DraftFamily) -> list[str]:
    """draft.* keys set to something else than their default and than the init's value (the init's architecture
    is what 04 trains: a conflicting key is a mistake, not a wish to resize it)."""
    default = DraftConfig()
    problems = [f"draft.{key}={getattr(cfg.draft, key)} but the init has {getattr(config, key)}" for key in _DRAFT_KEYS
                if getattr(cfg.draft, key) != getattr(default, key) and getattr(cfg.draft, key) != getattr(config, key)]
    if cfg.draft.architecture != default.architecture and cfg.draft.architecture not in family.names:
        problems.append(f"draft.architecture={cfg.draft.architecture} but the init is a {family.architecture} draft")
    if cfg.draft.rope_scaling is not None:  # compared resolved: "target" is the target's scaling
        asked = draft_rope_scaling(cfg.draft.rope_scaling, info.text_config)
        theirs = draft_rope_scaling(config.rope_scaling, info.text_config) if config.rope_scaling else None
        if asked != theirs:
            problems.append(f"draft.rope_scaling resolves to {asked} but the init has {theirs}")
    return [p + " (leave draft.* unset: the init's architecture is trained)" for p in problems]


def _read_finite(path: Path, shapes: dict, family: DraftFamily) -> dict[str, torch.Tensor]:
    """The init's tensors but embed_tokens (the target's is used; _embedding_problems compared it), every value
    finite: a diverged or damaged draft is refused here, before --overwrite deletes anything, not reported as a
    divergence of this run after it."""
    weights = read_draft_tensors(path, names={n for n in shapes if not n.startswith(EMBEDDING_PREFIX)}, family=family)
    counts = {n: int(w.isfinite().logical_not().sum()) for n, w in weights.items() if w.is_floating_point()}
    bad = {n: c for n, c in counts.items() if c}
    if bad:
        name, count = next(iter(bad.items()))
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise DataError(f"train.init_from {path}: its tensor {name} holds {count} NaN or inf values{more}; the draft "
                        f"diverged or is damaged: start from another draft (an earlier export), or set train.init_from: null")
    return weights


def _embedding_problems(path: Path, target_model: str, family: DraftFamily) -> list[str]:
    """A draft that carries its own embed_tokens (the speculators format does) carries its target's: vLLM serves
    it with that one unless it equals this target's, so another one means another target."""
    theirs = read_draft_tensors(path, names={EMBEDDING_TENSOR}, family=family)[EMBEDDING_TENSOR]
    ours = load_target_tensors(target_model, kinds=("embed",))["embed"]
    if theirs.shape == ours.shape and torch.equal(theirs, ours.to(theirs.dtype)):
        return []
    return ["its embed_tokens differ from target.model's embedding (a draft of another target or revision)"]


def draft_family_for(cfg, init: InitDraft | None = None) -> DraftFamily:
    """The draft family 04 trains, decided here for the trainer and the memory planner alike: train.init_from's (the
    architectures of its config.json; `init` when the trainer has read it already) when set, else
    draft.architecture's. A name no family knows, or a draft.* key its family does not read, is one ConfigError line."""
    if cfg.train.init_from:
        return init.family if init is not None else family_of_config(read_draft_config(cfg.train.init_from))
    family = family_of([cfg.draft.architecture], where="config key 'draft.architecture'",
                       fix="set draft.architecture to one of them")
    # a draft.* key the family does not read is one line (with an init, _draft_key_problems compares the keys instead)
    family.check_draft_keys(cfg.draft)
    return family
