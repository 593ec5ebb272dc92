"""The EAGLE-3 draft (docs/design.md#draft-architecture): one package, one module per concern.

    contract.py      the draft contract: what the stages ask of a family's config (DraftConfigContract) and model
                     (DraftModelContract), and the tensor names every family shares
    config.py        DraftModelConfig (sizes, checks, the config.json vLLM reads), rope scaling, build_draft_config
    layout.py        PackedLayout: where each token of a packed row sits
    attention.py     the TTT attention: chunked (exact, hand-written backward), flex, naive (the reference)
    llama_eagle3.py  the Llama EAGLE-3 modules and the TTT forward pass (Eagle3DraftModel), and its family
    deepseek_eagle3.py  the MLA EAGLE-3 draft (vLLM's Eagle3DeepseekV2ForCausalLM): the Llama draft with DeepSeek's
                     multi-head latent attention, and its family
    registry.py      the draft families (DraftFamily): each architecture's config and model classes, its tensor
                     names in vLLM's formats, its sizes for the planners; family_of* find a draft's family

The names below are the package's interface; import them from here.
"""

from common.model.draft.attention import ATTENTION_BACKENDS, ATTN_SCORES_BYTES, DEFAULT_ATTN_CHUNK, AttentionMeta, choose_attention
from common.model.draft.contract import (EMBEDDING_PREFIX, EMBEDDING_TENSOR, HEAD_TENSOR, NORM_FLAGS, VOCAB_MAP_TENSORS,
                                         DraftConfigContract, DraftModelContract)
from common.model.draft.config import OFFICIAL_ARCHITECTURE, DraftModelConfig, build_draft_config, draft_rope_scaling
from common.model.draft.layout import PackedLayout, squeeze_row
from common.model.draft.llama_eagle3 import LLAMA_EAGLE3_FAMILY, Eagle3DraftModel
from common.model.draft.deepseek_eagle3 import DEEPSEEK_EAGLE3_FAMILY
from common.model.draft.registry import (DEFAULT_ARCHITECTURE, DRAFT_FAMILIES, AttentionWidths, DraftFamily,
                                         StateDictAdapter, family_of, family_of_config, family_of_model,
                                         known_architectures, register, unregister)

__all__ = ["ATTENTION_BACKENDS", "ATTN_SCORES_BYTES", "DEEPSEEK_EAGLE3_FAMILY", "DEFAULT_ARCHITECTURE", "DEFAULT_ATTN_CHUNK",
           "DRAFT_FAMILIES", "EMBEDDING_PREFIX", "EMBEDDING_TENSOR", "HEAD_TENSOR", "NORM_FLAGS", "VOCAB_MAP_TENSORS",
           "AttentionMeta", "AttentionWidths", "DraftConfigContract", "DraftFamily", "DraftModelContract", "DraftModelConfig",
           "Eagle3DraftModel", "LLAMA_EAGLE3_FAMILY", "OFFICIAL_ARCHITECTURE", "PackedLayout", "StateDictAdapter",
           "build_draft_config", "choose_attention", "draft_rope_scaling", "family_of", "family_of_config",
           "family_of_model", "known_architectures", "register", "squeeze_row", "unregister"]
