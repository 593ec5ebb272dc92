"""The draft registry (common/model/draft/registry.py): a second draft architecture is one module plus one
`register` line. A test-only family (an RMSNorm over the aux states before fc, a tensor the Llama draft does not
have, under a name of its own in the official format) is registered here only, picked by draft.architecture,
planned, trained by the real step, exported by the real exporter and read back by train.init_from's loader and
load_exported_draft with equal tensors; a config.json naming an architecture no family knows is one error line."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from common.core.config import DraftConfig, config_from_dict
from common.core.distributed import DistEnv
from common.core.errors import ConfigError
from common.core.run_folder import Layout
from common.model.draft import (DEFAULT_ARCHITECTURE, DRAFT_FAMILIES, LLAMA_EAGLE3_FAMILY, DraftFamily, DraftModelConfig,
                                Eagle3DraftModel, StateDictAdapter, build_draft_config, family_of, family_of_config,
                                family_of_model, register, unregister)
from common.model.draft.llama_eagle3 import RMSNorm
from common.model.export import (export_speculators_draft, export_vllm_draft, load_exported_draft, read_draft_aux_layer_ids,
                                 read_draft_config)
from common.train.data import MicroBatch
from common.train.init_from import InitDraft, draft_family_for
from common.train.memory_plan import draft_config_from, plan_memory, trainable_params
from common.train.step import StepSettings, build_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = "AuxNormTestEagle3"
H, V, V_D, HEADS, KV_HEADS, INTER = 32, 200, 64, 4, 2, 64  # the draft's hidden size is the target's
AUX = [1, 2, 3]
SEQ = [9, 13, 6]


# ---------------------------------------------------------------------------------------------- the test family


@dataclasses.dataclass(kw_only=True)
class AuxNormConfig(DraftModelConfig):
    """The Llama draft's fields in a class of its own: a config tells its family by its class."""


class AuxNormDraft(Eagle3DraftModel):
    """The Llama EAGLE-3 draft with an RMSNorm over the concatenated aux states before fc."""

    def __init__(self, config: AuxNormConfig, **settings):
        super().__init__(config, **settings)
        self.aux_norm = RMSNorm(config.num_aux * config.target_hidden_size, config.rms_norm_eps)

    def combine_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return super().combine_aux(self.aux_norm(aux_hidden.to(self.fc.weight.dtype)))


def aux_norm_params(d: AuxNormConfig) -> int:
    return LLAMA_EAGLE3_FAMILY.trainable_params(d) + d.num_aux * d.target_hidden_size  # + the norm's weight


AUX_NORM_FAMILY = DraftFamily(
    architecture=ARCH,
    aliases=("AuxNormTestEagle3Speculator",),
    config_class=AuxNormConfig,
    model_class=AuxNormDraft,
    build_config=lambda cfg, info, vocab, aux: AuxNormConfig(**dataclasses.asdict(build_draft_config(cfg, info, vocab, aux))),
    # its official name for the norm differs from ours, so the test sees the adapter at work both ways
    adapter=StateDictAdapter(official=(("aux_norm.", "aux_layernorm."),)),
    trainable_params=aux_norm_params,
    largest_param=LLAMA_EAGLE3_FAMILY.largest_param,
    kv_bytes_per_token=LLAMA_EAGLE3_FAMILY.kv_bytes_per_token,
)


@pytest.fixture
def aux_norm_family():
    """The test family, registered for one test and removed after it (the registry as it was for the others)."""
    before = dict(DRAFT_FAMILIES)
    register(AUX_NORM_FAMILY)
    try:
        yield AUX_NORM_FAMILY
    finally:
        unregister(AUX_NORM_FAMILY)
    assert DRAFT_FAMILIES == before


# ---------------------------------------------------------------------------------------------- helpers


def run_config(tmp_path, **sections):
    return config_from_dict({"run_dir": str(tmp_path / "run"), "vocab": {"draft_vocab_size": V_D}, **sections})


def target_info():
    """What 04 reads of the target to size the draft (common.target.loading.load_target_info's fields)."""
    text = dict(num_hidden_layers=8, hidden_size=H, vocab_size=V, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                intermediate_size=INTER, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512)
    return SimpleNamespace(hidden_size=H, vocab_size=V, text_config=SimpleNamespace(**text)), text


def vocab_map():
    used = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:V_D].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(V_D), t2d


def micro_batch():
    g = torch.Generator().manual_seed(4)
    T = sum(SEQ)
    aux, ids = torch.randn(T, len(AUX) * H, generator=g), torch.randint(0, V, (T,), generator=g)
    final, loss_mask = torch.randn(T, H, generator=g) * 3, (torch.rand(T, generator=g) < 0.7).long()
    pos = torch.cat([torch.arange(n) for n in SEQ])
    lm_head = torch.randn(V, H, generator=g) / H ** 0.5
    return MicroBatch(ids, loss_mask, aux, final, pos, list(SEQ), [f"s{i}" for i in range(len(SEQ))]), lm_head


def trainable_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------- tests


def test_the_llama_family_is_registered_under_its_three_names():
    assert DraftConfig().architecture == DEFAULT_ARCHITECTURE == LLAMA_EAGLE3_FAMILY.architecture == "LlamaForCausalLMEagle3"
    for name in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator"):
        assert family_of([name]) is LLAMA_EAGLE3_FAMILY
    assert family_of(None) is family_of([]) is LLAMA_EAGLE3_FAMILY  # a config.json naming none: read as ever
    config = DraftModelConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                              head_dim=8, num_hidden_layers=2, vocab_size=V, draft_vocab_size=V_D, target_hidden_size=48,
                              aux_layer_ids=AUX)
    model = LLAMA_EAGLE3_FAMILY.build(config)
    assert type(model) is Eagle3DraftModel and family_of_config(config) is family_of_model(model) is LLAMA_EAGLE3_FAMILY
    assert LLAMA_EAGLE3_FAMILY.trainable_params(config) == trainable_count(model) == trainable_params(config)
    assert LLAMA_EAGLE3_FAMILY.adapter.to_speculators("midlayer.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert LLAMA_EAGLE3_FAMILY.adapter.to_ours("layers.0.mlp.up_proj.weight") == "midlayer.mlp.up_proj.weight"
    assert LLAMA_EAGLE3_FAMILY.adapter.to_ours("layers.1.mlp.up_proj.weight") == "layers.1.mlp.up_proj.weight"


def test_a_family_needs_names_and_classes_of_its_own(aux_norm_family):
    own_classes = dict(config_class=type("OtherConfig", (AuxNormConfig,), {}), model_class=type("OtherDraft", (AuxNormDraft,), {}))
    clash = dataclasses.replace(aux_norm_family, architecture="Other", aliases=("Eagle3Speculator",), **own_classes)
    with pytest.raises(ValueError, match=r"the names \['Eagle3Speculator'\] belong to the family LlamaForCausalLMEagle3"):
        register(clash)
    with pytest.raises(ValueError, match="its config class or model class belong to the family AuxNormTestEagle3"):
        register(dataclasses.replace(aux_norm_family, architecture="Other", aliases=()))
    assert "Other" not in DRAFT_FAMILIES


def test_a_registered_family_is_planned_trained_exported_and_read_back_by_init_from(tmp_path, aux_norm_family):
    info, target = target_info()
    cfg = run_config(tmp_path / "a", draft={"architecture": ARCH})
    # 04 and its memory planner pick the family by the one function, and build its config
    assert draft_family_for(cfg) is aux_norm_family
    planned = draft_config_from(cfg, target)
    assert type(planned) is AuxNormConfig and planned.aux_layer_ids == [2, 4, 5]  # vLLM's default for 8 layers
    d = aux_norm_family.build_config(cfg, info, V_D, AUX)
    assert dataclasses.replace(planned, aux_layer_ids=AUX) == d
    torch.manual_seed(0)
    draft = aux_norm_family.build(d, attention="chunked")
    assert type(draft) is AuxNormDraft and family_of_model(draft) is aux_norm_family
    assert trainable_params(d) == aux_norm_family.trainable_params(d) == trainable_count(draft)
    plan = plan_memory(d, cfg.train, world_size=1, device_type="cpu")
    assert plan.setting["trainable_params"] == trainable_count(draft)

    # trained by 04's step
    d2t, t2d = vocab_map()
    draft.set_vocab_map(d2t, t2d)
    draft.load_target_embedding(torch.randn(V, H, generator=torch.Generator().manual_seed(2)))
    mb, lm_head = micro_batch()
    step = build_step(draft, lm_head, StepSettings(ttt_steps=3, loss_decay=0.8, grad_clip=0.5, lr=1e-2, betas=(0.9, 0.95),
                                                   weight_decay=0.0))
    losses = [float(step.run([(mb, True)], 1, denominator=None).outputs[0][0].loss.detach()) for _ in range(4)]
    assert losses[-1] < losses[0]
    assert not torch.equal(draft.aux_norm.weight, torch.ones_like(draft.aux_norm.weight))  # the new tensor trained too

    # exported by the real exporter: the family's name and its official tensor names
    out = export_vllm_draft(draft, tmp_path / "draft", dtype=torch.float32, extra_config={"eagle_aux_hidden_state_layer_ids": AUX})
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["architectures"] == [ARCH]
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert "aux_layernorm.weight" in names and "aux_norm.weight" not in names and "midlayer.hidden_norm.weight" in names
    with pytest.raises(ConfigError, match=f"the {ARCH} draft has no speculators format"):
        export_speculators_draft(draft, tmp_path / "spec", "target", 3)

    # read back by train.init_from's loader into a fresh model of the family: every tensor equal
    trained = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    init_cfg = run_config(tmp_path / "b", train={"init_from": str(out)})
    layout = Layout.of(init_cfg)
    layout.run_dir.mkdir(parents=True)
    init = InitDraft.read(init_cfg, info, AUX, *vocab_map(), layout, DistEnv())
    assert draft_family_for(init_cfg, init) is draft_family_for(init_cfg) is aux_norm_family
    assert type(init.draft_cfg) is AuxNormConfig
    fresh = draft_family_for(init_cfg, init).build(init.draft_cfg)
    fresh.load_target_embedding(trained["embed_tokens.weight"])
    fresh.set_vocab_map(init.d2t, init.t2d)
    init.load_into(fresh)
    assert type(fresh) is AuxNormDraft
    back = fresh.state_dict()
    assert set(back) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(back[name], tensor), name
    # and by 05's loader
    loaded = load_exported_draft(out, embedding=trained["embed_tokens.weight"])
    assert type(loaded) is AuxNormDraft
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    # draft.architecture set to another family than the init's is a conflict, in the init's one line
    other = run_config(tmp_path / "c", train={"init_from": str(out)}, draft={"architecture": "Eagle3Speculator"})
    with pytest.raises(ConfigError, match=f"draft.architecture=Eagle3Speculator but the init is a {ARCH} draft"):
        InitDraft.read(other, info, AUX, *vocab_map(), Layout.of(other), DistEnv())


def test_an_unknown_architecture_is_one_error_line(tmp_path):
    torch.manual_seed(0)
    config = DraftModelConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                              head_dim=8, vocab_size=V, draft_vocab_size=V_D, target_hidden_size=H, aux_layer_ids=AUX)
    out = export_vllm_draft(Eagle3DraftModel(config), tmp_path / "draft")
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "architectures": ["DeepseekV3ForCausalLMEagle3"]}))
    want = (f"{out / 'config.json'} names the draft architecture 'DeepseekV3ForCausalLMEagle3', which this pipeline does "
            f"not know (known: Eagle3DeepseekV2ForCausalLM, Eagle3DeepseekV3ForCausalLM, Eagle3LlamaForCausalLM, "
            f"Eagle3Speculator, LlamaForCausalLMEagle3); use a draft of a known architecture, or register its family "
            f"(common/model/draft/registry.py)")
    for read in (load_exported_draft, read_draft_config,
                 lambda path: draft_family_for(run_config(tmp_path / "run", train={"init_from": str(path)}))):
        with pytest.raises(ConfigError) as e:
            read(out)
        assert str(e.value) == want
    assert read_draft_aux_layer_ids(out) == config.aux_layer_ids  # 05 reads its aux layer ids all the same
    # draft.architecture: the config key is named, and what to set
    with pytest.raises(ConfigError) as e:
        draft_family_for(run_config(tmp_path / "run", draft={"architecture": "LlamaForCausalLMEagle4"}))
    assert str(e.value) == ("config key 'draft.architecture' names the draft architecture 'LlamaForCausalLMEagle4', which "
                            "this pipeline does not know (known: Eagle3DeepseekV2ForCausalLM, Eagle3DeepseekV3ForCausalLM, "
                            "Eagle3LlamaForCausalLM, Eagle3Speculator, LlamaForCausalLMEagle3); set draft.architecture to one "
                            "of them, or register its family (common/model/draft/registry.py)")
