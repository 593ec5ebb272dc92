"""The draft contract: what the rest of the pipeline may ask of a draft family's config and model
(docs/design.md#draft-families-the-registry). Everything outside common/model/draft/ works through these members,
the tensor names below and the family's `DraftFamily` record (registry.py); a family's own modules, their
attributes and tensor names stay inside its module (tests/model/test_draft_contract.py checks both).

Who asks what:
    04's TTT loop (common/model/ttt.py)     model(...step_fn=), final_norm, head_weight, compute_logits,
                                            draft_to_target_ids, d2t, t2d
    the step (common/train/step.py)         embedding (shared by the bf16 compute copy), compile_regions,
                                            parameters (requires_grad: the trainable ones)
    the trainer (common/train/trainer.py)   family.build_config, family.build; load_target_embedding, embedding,
                                            set_vocab_map, draft_vocab_target_ids, head_weight, attention_impl; the
                                            config's num_attention_heads / num_key_value_heads / head_dim / value_head_dim choose the
                                            attention backend (choose_attention)
    init_from (common/train/init_from.py)   the config's sizes, aux_layer_ids and NORM_FLAGS (dataclasses.replace),
                                            head_weight, draft_vocab_target_ids, HEAD_TENSOR, EMBEDDING_TENSOR,
                                            VOCAB_MAP_TENSORS; the family reads and checks the tensors
    the export (common/model/export.py)     state_dict (the family's names; the adapter renames them),
                                            config.to_vllm_config, d2t, embedding
    the memory planner (train/memory_plan)  family.trainable_params / largest_param; the config's sizes
    plan_serving, sizing (common/serving)   family.kv_bytes_per_token
    05 (common/evaluate)                    load_exported_draft -> model(...), the config's aux_layer_ids
    benches (bench/)                        compiled_regions, forward_ttt

A family declares the contract by subclassing: its config class subclasses DraftConfigContract (the Llama config
does; the MLA config subclasses it), its model class DraftModelContract; `register` refuses a family whose classes
do not.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterator, Optional, Protocol, runtime_checkable

import torch
import torch.nn as nn

# Tensor names every EAGLE-3 family shares, in its state dict and in both formats vLLM loads (vLLM's EAGLE-3 loaders
# route these by name, whatever the family): the rest of a state dict is the family's own.
EMBEDDING_PREFIX = "embed_tokens."
EMBEDDING_TENSOR = "embed_tokens.weight"  # [V, H] the target's input embedding, frozen (not exported: vLLM shares it)
HEAD_TENSOR = "lm_head.weight"  # [V_d, H] the draft's head over the draft vocabulary
VOCAB_MAP_TENSORS = ("d2t", "t2d")  # d2t int64 [V_d]: target id = i + d2t[i]; t2d bool [V]: in the draft vocab
# The EAGLE-3.1 flags (docs/design.md#eagle-31-the-norm-flags), config.json keys vLLM reads, all false = EAGLE-3:
#   fc_norm         one RMSNorm per aux hidden state before fc (tensors fc_norm.{i}.weight [H_t])
#   norm_before_fc  one RMSNorm over their concatenation before fc (input_norm.weight [num_aux * H_t]); exclusive with
#                   fc_norm
#   norm_output     the next draft step reads the normed output (lm_head reads it in every mode), not the pre-norm one
NORM_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")


@runtime_checkable
class DraftConfigContract(Protocol):
    """A draft config: a dataclass (init_from replaces draft_vocab_size and aux_layer_ids with dataclasses.replace,
    04's run fingerprint is its dataclasses.asdict), one class per family (family_of_config tells the family by it)."""

    hidden_size: int  # H: the draft's width, = the target's (the draft reads the target's embedding)
    intermediate_size: int  # the MLP's width
    num_hidden_layers: int  # decoder layers (layer 0 reads [embedding, hidden], 2H)
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads the TTT attention caches per layer (MLA: one per query head)
    head_dim: int  # q/k head width (MLA: qk_nope_head_dim + qk_rope_head_dim)
    vocab_size: int  # V: the target's vocabulary
    draft_vocab_size: int  # V_d: the draft's head (d2t maps it onto the target's ids)
    target_hidden_size: int  # H_t: the width of each aux hidden state
    aux_layer_ids: list  # the target layers whose hidden states fc reads (num_aux of them)
    rope_theta: float
    rope_scaling: Optional[dict]  # transformers' form, or None
    rms_norm_eps: float
    norm_before_residual: bool
    max_position_embeddings: int
    fc_norm: bool  # NORM_FLAGS
    norm_before_fc: bool
    norm_output: bool
    # the NORM_FLAGS this family's vLLM model reads (a config setting another is a ConfigError: vLLM would serve the
    # draft without it) and its config.json writes
    norm_flags: ClassVar[frozenset]

    @property
    def num_aux(self) -> int:
        """How many aux hidden states the draft reads (len(aux_layer_ids))."""
        ...

    @property
    def value_head_dim(self) -> int:
        """A value head's width (MLA: v_head_dim, narrower than head_dim; Llama: head_dim)."""
        ...

    def to_vllm_config(self, **extra) -> dict:
        """The config.json of the official format (extra: keys that win, e.g. torch_dtype)."""
        ...

    @classmethod
    def from_vllm_config(cls, raw: dict):
        """The config of a config.json of this family (either format); KeyError naming a missing key."""
        ...


@runtime_checkable
class DraftModelContract(Protocol):
    """A draft model: an nn.Module built as family.build(config, attention=, attn_chunk_size=,
    gradient_checkpointing=), whose state_dict names are the family's (its official format's, but for the adapter's
    renames) and include EMBEDDING_TENSOR, HEAD_TENSOR and the VOCAB_MAP_TENSORS buffers. Shapes: T tokens of one
    packed row, H the draft's width, V_d the draft vocabulary."""

    config: DraftConfigContract
    attention_impl: str  # the TTT attention backend it runs (common.model.draft.attention.ATTENTION_BACKENDS)
    d2t: torch.Tensor  # [V_d] int64 buffer: target id of draft id i = i + d2t[i]
    t2d: torch.Tensor  # [V] bool buffer: the target ids in the draft vocabulary

    def forward(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, seq_lens,
                ttt_steps: int, step_fn: Optional[Callable] = None) -> list:
        """The TTT unroll over one packed row (docs/design.md#ttt-alignment-and-loss): aux_hidden [T, num_aux * H_t],
        input_ids [T] (the raw tokens), position_ids [T] (within each sample), seq_lens (summing to T). Returns per
        step i the logits [T, V_d] (index t predicts x_{t+2+i}), or step_fn(model, i, h_i) of its pre-norm output
        h_i [T, H] when given (ttt_loss computes each step's loss inside forward, for DDP/FSDP)."""
        ...

    def forward_ttt(self, aux_hidden, input_ids, position_ids, seq_lens, ttt_steps: int) -> list:
        """forward without step_fn: per-step logits [T, V_d]."""
        ...

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm output [.., H] -> what the head reads [.., H] (ttt_loss fuses the head with the loss after it)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm output [.., H] -> logits over the draft vocab [.., V_d]: final_norm, then the head."""
        ...

    @property
    def head_weight(self) -> nn.Parameter:
        """The head's weight [V_d, H], trainable (HEAD_TENSOR): row i scores draft id i."""
        ...

    @property
    def embedding(self) -> nn.Embedding:
        """The target's input embedding [V, H] (EMBEDDING_TENSOR), frozen; 04 may keep it in bf16."""
        ...

    def load_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's embedding [V, H] in (DataError on another shape) and keep it frozen."""
        ...

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Set d2t [V_d] and t2d [V] (DataError when they disagree with each other or with the sizes)."""
        ...

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids."""
        ...

    def draft_vocab_target_ids(self) -> torch.Tensor:
        """[V_d] the target id of each draft id (the head's rows, in order)."""
        ...

    def trainable_parameters(self) -> list:
        """The parameters 04 trains (requires_grad): all but the embedding."""
        ...

    def compile_regions(self, backend: str = "inductor") -> None:
        """torch.compile the family's dense regions in place (04 with train.compile); the attention stays eager."""
        ...

    def compiled_regions(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                         seq_lens) -> Iterator[tuple[str, Callable, tuple]]:
        """(name, region, args) of each region compile_regions compiles, with its inputs of TTT step 0 for this
        row (forward's arguments), in call order, under torch.no_grad() (bench/step_instruments.py runs
        torch._dynamo.explain on each)."""
        ...


def contract_problems(config_class: type, model_class: type) -> list[str]:
    """Why a family's classes do not declare the contract (register refuses them), or []: each subclasses its
    Protocol, and defines every method and property of it itself (not the Protocol's empty stub)."""
    problems = []
    for cls, protocol in ((config_class, DraftConfigContract), (model_class, DraftModelContract)):
        if protocol not in cls.__mro__:  # declared by subclassing (issubclass does not take data members)
            problems.append(f"{cls.__name__} does not subclass {protocol.__name__}")
            continue
        members = [name for name, value in vars(protocol).items()
                   if not name.startswith("_") and (callable(value) or isinstance(value, (property, classmethod)))]
        stubs = [name for name in members if _defining_class(cls, name) is protocol]
        if stubs:
            problems.append(f"{cls.__name__} does not define {', '.join(stubs)} of {protocol.__name__}")
    if not issubclass(model_class, nn.Module):
        problems.append(f"{model_class.__name__} is not an nn.Module")
    return problems


def _defining_class(cls: type, name: str) -> Any:
    return next((c for c in cls.__mro__ if name in vars(c)), None)
