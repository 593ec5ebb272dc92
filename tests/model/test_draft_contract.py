"""The draft contract (common/model/draft/contract.py): both registered families' configs and models implement it,
register() refuses a family that does not declare it, each family refuses the draft.* keys it does not read, and
no file outside common/model/draft/ names a family's modules, tensor names or classes."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from common.core.config import config_from_dict
from common.core.errors import ConfigError
from common.model.draft import (DRAFT_FAMILIES, EMBEDDING_TENSOR, HEAD_TENSOR, VOCAB_MAP_TENSORS, DraftConfigContract,
                                DraftFamily, DraftModelContract, StateDictAdapter, family_of, register, unregister)
from common.model.export import export_vllm_draft, load_exported_draft
from common.model.ttt import ttt_loss
from common.train.init_from import draft_family_for

REPO = Path(__file__).resolve().parents[2]
LLAMA, MLA = "LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"
H, V, V_D, T = 32, 64, 40, 24
SEQ = [10, 14]


def tiny_config(architecture: str):
    family = family_of([architecture])
    common = dict(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_hidden_layers=2, vocab_size=V,
                  draft_vocab_size=V_D, target_hidden_size=H, aux_layer_ids=[0, 1, 2])
    if architecture == MLA:
        return family.config_class(**common, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=6)
    return family.config_class(**common, num_key_value_heads=2, head_dim=8)


def row(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, 3 * H, generator=g), torch.randint(0, V, (T,), generator=g),
            torch.cat([torch.arange(n) for n in SEQ]))


@pytest.mark.parametrize("architecture", [LLAMA, MLA])
def test_each_family_implements_the_contract(architecture, tmp_path):
    """isinstance against the runtime-checkable Protocols, and every member called on a tiny draft with the shapes the
    contract states; then through ttt_loss, the export and the loader, which use nothing else."""
    torch.manual_seed(0)
    family = family_of([architecture])
    config = tiny_config(architecture)
    assert isinstance(config, DraftConfigContract) and dataclasses.is_dataclass(config)
    assert DraftConfigContract in type(config).__mro__ and DraftModelContract in family.model_class.__mro__  # declared
    assert config.num_aux == 3 and config.head_dim > 0 and config.num_key_value_heads > 0
    raw = config.to_vllm_config(torch_dtype="float32")
    assert family.read_config({**raw, "architectures": [architecture]}) == config
    assert type(config).from_vllm_config(raw) == config
    assert dataclasses.replace(config, draft_vocab_size=V_D) == config

    draft = family.build(config, attention="chunked")
    assert isinstance(draft, DraftModelContract) and isinstance(draft, nn.Module)
    assert draft.config is config and draft.attention_impl == "chunked"
    state = draft.state_dict()
    assert {EMBEDDING_TENSOR, HEAD_TENSOR, *VOCAB_MAP_TENSORS} <= set(state)
    embedding = torch.randn(V, H)
    draft.load_target_embedding(embedding)
    assert draft.embedding.weight.shape == (V, H) and not draft.embedding.weight.requires_grad
    assert torch.equal(draft.embedding.weight, embedding)
    assert draft.embedding.weight.data_ptr() == draft.state_dict()[EMBEDDING_TENSOR].data_ptr()
    ids = torch.sort(torch.randperm(V)[:V_D]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(V_D), t2d)
    assert torch.equal(draft.draft_vocab_target_ids(), ids) and torch.equal(draft.t2d, t2d)
    assert torch.equal(draft.draft_to_target_ids(torch.tensor([[0, V_D - 1]])), ids[[0, V_D - 1]][None])
    assert draft.head_weight.shape == (V_D, H) and draft.head_weight.requires_grad
    assert draft.head_weight is dict(draft.named_parameters())[HEAD_TENSOR]
    assert all(p.requires_grad for p in draft.trainable_parameters())
    assert sum(p.numel() for p in draft.trainable_parameters()) == family.trainable_params(config)

    aux, input_ids, positions = row()
    hidden = torch.randn(5, H)
    assert draft.final_norm(hidden).shape == (5, H)
    assert torch.equal(draft.compute_logits(hidden), draft.final_norm(hidden) @ draft.head_weight.T)
    logits = draft(aux, input_ids, positions, SEQ, 3)
    assert [tuple(x.shape) for x in logits] == [(T, V_D)] * 3
    assert all(torch.equal(a, b) for a, b in zip(logits, draft.forward_ttt(aux, input_ids, positions, SEQ, 3)))
    steps = draft(aux, input_ids, positions, SEQ, 2, step_fn=lambda m, i, h: (i, tuple(h.shape)))
    assert steps == [(0, (T, H)), (1, (T, H))]
    with torch.no_grad():
        regions = list(draft.compiled_regions(aux, input_ids, positions, SEQ))
    assert [name for name, _, _ in regions] == [f"layer {k} {half}" for k in range(2) for half in ("pre_attention", "post_attention")]
    assert all(callable(region) and isinstance(args, tuple) for _, region, args in regions)

    out = ttt_loss(draft, aux, input_ids, torch.randn(T, H), torch.ones(T, dtype=torch.long), positions, SEQ,
                   torch.randn(V, H), 3, 0.8)
    out.loss.backward()
    assert torch.isfinite(out.loss) and draft.head_weight.grad is not None and draft.embedding.weight.grad is None

    back = load_exported_draft(export_vllm_draft(draft, tmp_path / "draft", dtype=torch.float32), embedding=embedding)
    assert isinstance(back, family.model_class) and back.config == config
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())
    draft.compile_regions("eager")  # in place, no error


def test_a_family_whose_classes_do_not_declare_the_contract_is_refused():
    llama = family_of([LLAMA])

    class Undeclared(nn.Module):  # everything a draft has, by inheritance from nn.Module only
        pass

    class Incomplete(llama.model_class.__mro__[1], DraftModelContract):  # nn.Module + the contract, no members
        pass

    class OwnConfig(llama.config_class):
        pass

    base = dict(aliases=(), build_config=llama.build_config, adapter=StateDictAdapter(),
                trainable_params=llama.trainable_params, largest_param=llama.largest_param,
                kv_bytes_per_token=llama.kv_bytes_per_token)
    with pytest.raises(ValueError) as e:
        register(DraftFamily(architecture="Undeclared", config_class=OwnConfig, model_class=Undeclared, **base))
    assert str(e.value) == ("draft family Undeclared: Undeclared does not subclass DraftModelContract "
                            "(common/model/draft/contract.py)")
    with pytest.raises(ValueError) as e:
        register(DraftFamily(architecture="Incomplete", config_class=OwnConfig, model_class=Incomplete, **base))
    assert str(e.value).startswith("draft family Incomplete: Incomplete does not define forward_ttt, final_norm, "
                                   "compute_logits, head_weight, embedding, ")
    assert "Undeclared" not in DRAFT_FAMILIES and "Incomplete" not in DRAFT_FAMILIES


# ------------------------------------------------------------------------------ the family owns its draft.* keys


def run_config(tmp_path, **draft):
    return config_from_dict({"run_dir": str(tmp_path / "run"), "draft": draft})


def test_a_draft_key_the_family_does_not_read_is_one_error_line(tmp_path):
    keys = ("draft.fc_norm, draft.hidden_size, draft.intermediate_size, draft.max_position_embeddings, "
            "draft.norm_before_residual, draft.norm_output, draft.num_attention_heads, draft.num_hidden_layers, "
            "draft.rms_norm_eps, draft.rope_scaling, draft.rope_theta")
    for key, value in (("head_dim", 64), ("num_key_value_heads", 8)):
        with pytest.raises(ConfigError) as e:
            draft_family_for(run_config(tmp_path, architecture=MLA, **{key: value}))
        assert str(e.value) == (f"draft.{key} does not apply to the MLA draft ({MLA}), which reads only {keys}; "
                                f"remove draft.{key} from the config")
    # the keys it reads, and its alias; the Llama draft reads every key
    assert draft_family_for(run_config(tmp_path, architecture="Eagle3DeepseekV3ForCausalLM", num_hidden_layers=2,
                                       intermediate_size=96)).architecture == MLA
    assert draft_family_for(run_config(tmp_path, head_dim=64, num_key_value_heads=8)).architecture == LLAMA


def test_run_pipeline_refuses_a_key_the_draft_family_does_not_read_before_01(tmp_path, tiny_target_dir):
    """Before any stage runs: exit 2, one error line, no run folder content written by a stage."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\ntarget:\n  model: {tiny_target_dir}\n"
                   f"draft:\n  architecture: {MLA}\n  head_dim: 128\n", encoding="utf-8")
    from tests.helpers import error_line, stage_env

    res = subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), "--config", str(cfg)], cwd=REPO,
                         env=stage_env(), capture_output=True, text=True, timeout=600)
    line = error_line(res, f"draft.head_dim does not apply to the MLA draft ({MLA})", "remove draft.head_dim")
    assert "01_prepare_data" not in res.stdout, line
    assert not (tmp_path / "run" / "data").exists()


# ------------------------------------------------------------------ no family internals outside common/model/draft/

# The names that belong to one family: its modules' attribute names and tensor names (the MLA family's, the Llama
# family's own layer-0 names), its classes, its module files and the architecture names its registration holds.
FAMILY_NAMES = (
    # the MLA family's modules and tensor names (vLLM's deepseek_eagle3.py)
    "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
    # the Llama family's layer-0 names and fc's tensor
    "midlayer", "hidden_norm", "fc.weight",
    # the families' classes, modules and registrations
    "Eagle3DraftModel", "DraftModelConfig", "DecoderLayer", "DeepseekEagle3Config", "Eagle3DeepseekV2Draft",
    "MLAAttention", "MLADecoderLayer", "MLARotaryEmbedding", "LLAMA_EAGLE3_FAMILY", "DEEPSEEK_EAGLE3_FAMILY",
    "llama_eagle3", "deepseek_eagle3",
    # the architectures the families register (outside the registry a family is asked for by family_of)
    "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM",
)
# (file, name): where a name is allowed, and why. Keep it short: a new entry needs a reason no contract member covers.
ALLOWED = {
    # draft.architecture's default: core imports no model, so the config loader spells the default family's name
    ("common/core/config.py", "LlamaForCausalLMEagle3"),
    # the peer benches build SpecForge's own Llama draft class (a peer's, not ours) and reach into its modules
    ("bench/peer_bench.py", "LlamaForCausalLMEagle3"),
    ("bench/peer_bench.py", "midlayer"),
    ("bench/peer_bench.py", "fc.weight"),  # SpecForge's TargetHead.fc (the target's lm_head), not a draft's fc
    ("bench/peer_quality.py", "LlamaForCausalLMEagle3"),
    # docstrings of the sizing and memory-planner files, reworded by their own change (issue 43's sizing item)
    ("common/serving/sizing.py", "deepseek_eagle3"),
    ("common/serving/sizing.py", "DraftModelConfig"),
    ("common/train/memory_plan.py", "DraftModelConfig"),
    ("scripts/plan_serving.py", "DraftModelConfig"),
}
SCANNED = ("common", "bench", "scripts", "run_pipeline.py", "0*.py")


def scanned_files(root: Path = REPO) -> list[Path]:
    files = []
    for pattern in SCANNED:
        for path in sorted(root.glob(pattern)):
            files += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".py", ".sh"))
    draft_package = root / "common" / "model" / "draft"
    return [f for f in files if draft_package not in f.parents]


def family_name_uses(files, root: Path = REPO) -> list[str]:
    """'file:line: name: the line' for each family name in `files` that ALLOWED does not allow."""
    pattern = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, FAMILY_NAMES)) + r")(?![A-Za-z0-9_])")
    uses = []
    for path in files:
        where = path.relative_to(root).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            uses += [f"{where}:{number}: {m.group(1)}: {line.strip()}" for m in pattern.finditer(line)
                     if (where, m.group(1)) not in ALLOWED]
    return uses


def test_no_file_outside_the_draft_package_names_a_familys_internals():
    files = scanned_files()
    assert REPO / "common" / "model" / "ttt.py" in files and REPO / "04_train.py" in files and len(files) > 50
    uses = family_name_uses(files)
    assert not uses, ("these lines name a draft family's modules, tensors or classes outside common/model/draft/; go "
                      "through the draft contract (common/model/draft/contract.py) or the family:\n" + "\n".join(uses))


def test_the_scan_reports_file_and_line_and_spares_the_draft_package_and_the_allowlist(tmp_path):
    use = "w = draft.midlayer.self_attn.kv_a_proj_with_mqa.weight  # q_a_projx is another name"
    files = {"common/model/ttt.py": f"x = 1\n{use}\n", "common/model/draft/mine.py": use,
             "common/core/config.py": 'architecture: str = "LlamaForCausalLMEagle3"\n', "bench/b.py": "DEEPSEEK_EAGLE3_FAMILY\n",
             "05_evaluate.py": "from common.model.draft.llama_eagle3 import RMSNorm\n", "docs/design.md": use}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert family_name_uses(scanned_files(tmp_path), tmp_path) == [
        f"common/model/ttt.py:2: midlayer: {use}",
        f"common/model/ttt.py:2: kv_a_proj_with_mqa: {use}",
        "bench/b.py:1: DEEPSEEK_EAGLE3_FAMILY: DEEPSEEK_EAGLE3_FAMILY",
        "05_evaluate.py:1: llama_eagle3: from common.model.draft.llama_eagle3 import RMSNorm",
    ]
