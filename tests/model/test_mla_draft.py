"""The MLA draft family (common/model/draft/deepseek_eagle3.py, vLLM's Eagle3DeepseekV2ForCausalLM): its TTT forward
equals a reference re-derived from vLLM 0.32's deepseek_eagle3.py / deepseek_v2.py with vLLM's own rotary; the
exact attention backends agree with q/k heads wider than v heads; the export carries the names and config keys
vLLM loads and reads back through the family; it is registered beside the Llama family; and it trains through
04's real step."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common.core.config import config_from_dict
from common.core.distributed import DistEnv
from common.core.errors import ConfigError
from common.core.run_folder import Layout
from common.model.draft import (DEEPSEEK_EAGLE3_FAMILY, DEFAULT_ARCHITECTURE, LLAMA_EAGLE3_FAMILY, AttentionMeta,
                                PackedLayout, family_of, family_of_config, family_of_model)
from common.model.draft.attention import chunked_ttt_attention, naive_ttt_attention
from common.model.draft.deepseek_eagle3 import DeepseekEagle3Config, Eagle3DeepseekV2Draft
from common.model.export import export_vllm_draft, load_exported_draft, read_draft_config
from common.serving.sizing import draft_kv_bytes_per_token
from common.train.data import MicroBatch
from common.train.init_from import InitDraft, draft_family_for
from common.train.memory_plan import draft_config_from, plan_memory
from common.train.step import StepSettings, build_step
from tests.model.test_draft_model import (assert_flex_forward_equals_naive, assert_same_outputs_and_grads,
                                         outputs_and_grads)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = "Eagle3DeepseekV2ForCausalLM"
H, H_T, V, V_D = 32, 32, 200, 64
AUX = [1, 2, 3]
# Kimi-K2.5's rope (DeepSeek-V3's yarn), in the legacy form its config.json gives
KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# mscale != mscale_all_dim: cos/sin scaled too, and a softmax mscale from mscale_all_dim alone
OTHER_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16,
              "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5}


def mla_config(**kw) -> DeepseekEagle3Config:
    base = dict(hidden_size=H, intermediate_size=48, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=24,
                qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, vocab_size=V, draft_vocab_size=V_D,
                target_hidden_size=H_T, aux_layer_ids=AUX, rope_theta=10000.0, rms_norm_eps=1e-6,
                max_position_embeddings=262144)
    base.update(kw)
    return DeepseekEagle3Config(**base)


def mla_model(seed=0, **kw) -> Eagle3DeepseekV2Draft:
    torch.manual_seed(seed)
    model = Eagle3DeepseekV2Draft(mla_config(**kw))
    with torch.no_grad():  # larger weights than the 0.02 init, so that a wrong term shows
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.25) if p.dim() == 2 else p.uniform_(0.5, 1.5)
        model.embed_tokens.weight.normal_(0, 1.0)
    return model


def make_row(seq_lens, seed=1, offset=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    aux = torch.randn(T, len(AUX) * H_T, generator=g)
    ids = torch.randint(0, V, (T,), generator=g)
    pos = torch.cat([torch.arange(n) for n in seq_lens]) + offset
    return aux, ids, pos


# ---------------------------------------------------------------------------------------------- vLLM's math


def vllm_rotary_and_scale(config_json: dict):
    """The rotary and the softmax scale vLLM 0.32 builds for the draft's attention from its config.json:
    transformers reads it as a DeepseekV2Config; DeepseekV2MLAAttention.__init__ (deepseek_v2.py) renames a
    non-default rope type to deepseek_yarn (deepseek_llama_scaling with attention_factor 1.0), calls
    get_rope(qk_rope_head_dim, is_neox_style=False) and, for deepseek_yarn, multiplies qk_head_dim**-0.5 by
    yarn_get_mscale(factor, mscale_all_dim)**2."""
    from transformers import DeepseekV2Config
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale

    hf = DeepseekV2Config.from_dict(config_json)
    params = dict(hf.rope_parameters)
    scaling = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    if params["rope_type"] != "default":
        params["rope_type"] = "deepseek_llama_scaling" if params.get("attention_factor") == 1.0 else "deepseek_yarn"
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(hf.qk_rope_head_dim, max_position=hf.max_position_embeddings, is_neox_style=False,
                        rope_parameters=params, dtype=torch.float32)
    if params["rope_type"] == "deepseek_yarn":
        scaling *= yarn_get_mscale(params["factor"], float(params.get("mscale_all_dim", False))) ** 2
    return rope, scaling


def _rms(x, w, eps):  # vLLM's RMSNorm.forward_native: fp32 variance, times the weight
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def vllm_reference(model, config_json, aux, ids, pos, seq_lens, steps):
    """The draft's per-step logits computed straight from vLLM's modules' math, one draft step after another,
    with vLLM's own rotary. Step i at index t: token x_{t+1+i}, position pos[t] + i, attending the step-0 keys
    of its sample up to t and its own steps 1..i (the TTT alignment). One layer:
      combine_hidden_states: fc(aux)                                            (deepseek_eagle3.py)
      DeepseekV2Eagle3DecoderLayer.forward: cat(input_layernorm(embeds), hidden_norm(hidden)) -> self_attn ->
          post_attention_layernorm(h, residual) -> DeepseekV2MLP (silu(gate) * up -> down)
      MLA (layers/mla.py MultiHeadLatentAttentionWrapper.forward): fused_qkv_a_proj = [q_a_proj | kv_a_proj_with_mqa];
          q = q_b_proj(q_a_layernorm(q_c)) (or q_proj(x)); kv_c, k_pe = split; rotary_emb(positions, q[..., nope:], k_pe);
          mla_attention.py: k_nope, v = kv_b_proj(kv_a_layernorm(kv_c)).split; k = cat(k_nope, k_pe expanded)
      DeepseekV2Eagle3Model.forward: norm(h, residual) -> logits = lm_head(normed)."""
    rope, scale = vllm_rotary_and_scale(config_json)
    c = model.config
    w = {n: p.detach() for n, p in model.named_parameters()}
    a = "midlayer.self_attn."
    eps, nh, nope, r, dv = c.rms_norm_eps, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    T = ids.shape[0]
    sample = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    start = torch.tensor([sum(seq_lens[:i]) for i in range(len(seq_lens))])[sample]
    end = start + torch.tensor(seq_lens)[sample]
    hidden = aux @ w["fc.weight"].T
    keys, values, logits = [], [], []
    for i in range(steps):
        nxt = torch.arange(T) + 1 + i
        tokens = torch.where(nxt < end, ids[nxt.clamp(max=T - 1)], torch.zeros_like(ids))
        embeds = w["embed_tokens.weight"][tokens]
        x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                       _rms(hidden, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
        kv_lora = x @ w[a + "kv_a_proj_with_mqa.weight"].T
        if c.q_lora_rank is not None:
            q = _rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], eps) @ w[a + "q_b_proj.weight"].T
        else:  # without q_lora_rank: q_proj from the layer input
            q = x @ w[a + "q_proj.weight"].T
        q = q.view(T, nh, nope + r)
        kv_c, k_pe = kv_lora.split([c.kv_lora_rank, r], dim=-1)
        q_pe, k_pe = rope.forward_native(pos + i, q[..., nope:].clone(), k_pe.unsqueeze(1).clone())
        kv = (_rms(kv_c, w[a + "kv_a_layernorm.weight"], eps) @ w[a + "kv_b_proj.weight"].T).view(T, nh, nope + dv)
        k_nope, v = kv.split([nope, dv], dim=-1)
        q = torch.cat([q[..., :nope], q_pe], dim=-1)
        keys.append(torch.cat([k_nope, k_pe.expand(T, nh, r)], dim=-1))
        values.append(v)
        out = torch.empty(T, nh, dv)
        for t in range(T):
            context = torch.arange(int(start[t]), t + 1)
            k_t = torch.cat([keys[0][context]] + [keys[j][t:t + 1] for j in range(1, i + 1)])
            v_t = torch.cat([values[0][context]] + [values[j][t:t + 1] for j in range(1, i + 1)])
            p = torch.softmax(torch.einsum("hd,shd->hs", q[t], k_t) * scale, dim=-1)
            out[t] = torch.einsum("hs,shd->hd", p, v_t)
        h = hidden + out.reshape(T, -1) @ w[a + "o_proj.weight"].T
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
        mlp = "midlayer.mlp."
        h = h + (F.silu(m @ w[mlp + "gate_proj.weight"].T) * (m @ w[mlp + "up_proj.weight"].T)) @ w[mlp + "down_proj.weight"].T
        logits.append(_rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T)
        hidden = h
    return logits


# ---------------------------------------------------------------------------------------------- (1) vLLM's math


@pytest.mark.parametrize("rope_scaling,q_lora_rank,offset,max_pos", [(KIMI_YARN, 16, 5000, 262144), (None, None, 0, 4096),
                                                                     (OTHER_YARN, 8, 900, 4096)])
def test_ttt_forward_equals_vllms_math(rope_scaling, q_lora_rank, offset, max_pos):
    """Every TTT step's logits equal the reference above (fp32 tolerance): interleaved rope on the rope slice only,
    yarn's frequencies and its mscale in cos/sin and in the softmax scale, q_lora or q_proj. (Each of these, left
    out of the draft, moves the logits by 0.2 to 4.7; the agreement is ~2e-6.)"""
    model = mla_model(q_lora_rank=q_lora_rank, rope_scaling=rope_scaling, max_position_embeddings=max_pos)
    config_json = model.config.to_vllm_config()
    seq = [7, 3, 9]
    aux, ids, pos = make_row(seq, offset=offset)
    with torch.no_grad():
        ours = model.forward_ttt(aux, ids, pos, seq, 3)
        ref = vllm_reference(model, config_json, aux, ids, pos, seq, 3)
    for step, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, msg=f"step {step}")
    if rope_scaling is not None:  # the softmax mscale really is in play
        assert model.rotary.softmax_scale != pytest.approx(model.config.qk_head_dim ** -0.5)


def test_the_rope_is_interleaved_and_on_the_rope_slice_only():
    """A position shift changes only the last qk_rope_head_dim values of q and k, in pairs (x[2i], x[2i+1])."""
    model = mla_model(q_lora_rank=None)
    attn, T = model.midlayer.self_attn, 5
    x = torch.randn(T, 2 * H)
    q0, k0, v0 = attn(x, *(c[:, None, :] for c in model.rotary(torch.zeros(T, dtype=torch.long))))
    q1, k1, v1 = attn(x, *(c[:, None, :] for c in model.rotary(torch.full((T,), 3))))
    nope = model.config.qk_nope_head_dim
    assert torch.equal(q0[..., :nope], q1[..., :nope]) and torch.equal(k0[..., :nope], k1[..., :nope]) and torch.equal(v0, v1)
    assert not torch.allclose(q0[..., nope:], q1[..., nope:])
    # at position 0 nothing rotates; the pair norms are kept at any position (mscale 1 without yarn)
    pairs = lambda t: t[..., nope:].unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pairs(q0), pairs(q1))
    assert torch.allclose(k1[:, 0, nope:], k1[:, 3, nope:])  # one rope key shared by every head


# ---------------------------------------------------------------------------------------------- (2) backends


@pytest.mark.parametrize("seq_lens,chunk", [([9], 4), ([5, 1, 7, 3], 3), ([6, 6], 100)])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("nh,nkv,d,dv", [(4, 4, 12, 8), (6, 2, 6, 10), (3, 3, 20, 4)])
def test_chunked_attention_equals_naive_with_v_heads_of_another_width(seq_lens, chunk, steps, nh, nkv, d, dv):
    torch.manual_seed(0)
    T = sum(seq_lens)
    q = torch.randn(T, nh, d, requires_grad=True)
    ks = [torch.randn(T, nkv, d, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(T, nkv, dv, requires_grad=True) for _ in range(steps)]
    meta = AttentionMeta(PackedLayout.build(seq_lens, T, "cpu"), chunk_size=chunk, scale=0.7 / math.sqrt(d))
    weights = torch.randn(T, nh, dv)
    outs, grads = [], []
    for fn in (chunked_ttt_attention, naive_ttt_attention):
        out = fn(q, ks, vs, meta)
        assert out.shape == (T, nh, dv)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, *ks, *vs)])
        for t in (q, *ks, *vs):
            t.grad = None
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_model_chunked_equals_naive_through_ttt_steps(layers):
    """The whole MLA draft (yarn rope, its softmax scale) through 4 TTT steps in float64: chunked == naive, outputs
    and every gradient, up to rounding."""
    model = mla_model(num_hidden_layers=layers, rope_scaling=KIMI_YARN).double()
    model.rotary.inv_freq = model.rotary.inv_freq.double()
    seq = [7, 2, 9, 1]
    row = make_row(seq, offset=3000)  # positions past yarn's original 4096 / 64 range
    ref = outputs_and_grads(model, seq, 4, "naive", row=row)
    for chunk in (4, 3, 100):
        assert_same_outputs_and_grads(outputs_and_grads(model, seq, 4, "chunked", chunk, row=row), ref, 1e-10)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_attention_forward_equals_naive():
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = mla_model(num_hidden_layers=2, rope_scaling=KIMI_YARN)
    assert_flex_forward_equals_naive(model, make_row([5, 3, 6]), [5, 3, 6])


# ---------------------------------------------------------------------------------------------- (3) export


MLA_TENSORS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
               *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
               *(f"midlayer.self_attn.{n}.weight" for n in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))}
Q_LORA = {f"midlayer.self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj")}


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_export_writes_what_vllm_loads_and_reads_back_through_the_family(tmp_path, q_lora_rank):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model = mla_model(q_lora_rank=q_lora_rank, rope_scaling=KIMI_YARN)
    vocab_ids = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:V_D].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vocab_ids] = True
    model.set_vocab_map(vocab_ids - torch.arange(V_D), t2d)
    out = export_vllm_draft(model, tmp_path / "draft", dtype=torch.float32, extra_config={"eagle_aux_hidden_state_layer_ids": AUX})

    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [ARCH] and raw["model_type"] == "deepseek_v2"
    assert raw["eagle_aux_hidden_state_layer_ids"] == AUX and raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert (raw["draft_vocab_size"], raw["vocab_size"], raw["target_hidden_size"]) == (V_D, V, H_T)
    assert {k: raw[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                "num_attention_heads", "intermediate_size", "hidden_act")} == dict(
        q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
        num_attention_heads=4, intermediate_size=48, hidden_act="silu")
    assert raw["rope_theta"] == 10000.0 and raw["rope_scaling"] == {**{k: v for k, v in KIMI_YARN.items() if k != "type"},
                                                                     "rope_type": "yarn"}
    assert "n_routed_experts" not in raw and "head_dim" not in raw  # a null n_routed_experts fails vLLM's validation
    # transformers reads it as vLLM will: the MLA sizes (q_lora_rank null kept: its default is 1536) and the yarn rope
    hf = AutoConfig.from_pretrained(out)
    assert type(hf).__name__ == "DeepseekV2Config" and hf.q_lora_rank == q_lora_rank and hf.v_head_dim == 10
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 64.0

    tensors = load_file(str(out / "model.safetensors"))
    q_names = Q_LORA if q_lora_rank else {"midlayer.self_attn.q_proj.weight"}
    assert set(tensors) == MLA_TENSORS | q_names  # vLLM's names; embed_tokens is the target's
    assert tensors["midlayer.self_attn.kv_b_proj.weight"].shape == (4 * (8 + 10), 24)
    assert tensors["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (24 + 6, 2 * H)

    assert family_of(raw["architectures"]) is DEEPSEEK_EAGLE3_FAMILY and read_draft_config(out) == model.config
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loaded = load_exported_draft(out, embedding=trained["embed_tokens.weight"])
    assert type(loaded) is Eagle3DeepseekV2Draft
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    # and by train.init_from's reader, into a fresh draft of the family
    info, _ = mla_target()
    cfg = config_from_dict({"run_dir": str(tmp_path / "run"), "vocab": {"draft_vocab_size": V_D},
                            "train": {"init_from": str(out)}})
    Layout.of(cfg).run_dir.mkdir(parents=True)
    init = InitDraft.read(cfg, info, AUX, model.d2t.clone(), model.t2d.clone(), Layout.of(cfg), DistEnv())
    assert init.family is draft_family_for(cfg) is DEEPSEEK_EAGLE3_FAMILY and init.draft_cfg == model.config
    fresh = DEEPSEEK_EAGLE3_FAMILY.build(init.draft_cfg)
    fresh.load_target_embedding(trained["embed_tokens.weight"])
    fresh.set_vocab_map(init.d2t, init.t2d)
    init.load_into(fresh)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_a_full_vocab_draft_exports_no_vocab_map(tmp_path):
    from safetensors.torch import load_file

    out = export_vllm_draft(mla_model(draft_vocab_size=V), tmp_path / "draft")
    assert "d2t" not in load_file(str(out / "model.safetensors"))
    assert load_exported_draft(out).config.draft_vocab_size == V


def test_a_draft_in_the_published_kimi_layout_reads_back(tmp_path):
    """The published K2.5 MLA draft's config.json layout (model_type kimi_k2, full vocab and no d2t, legacy
    `type: yarn` rope, num_key_value_heads given), at small sizes: read as this family, its tensors loaded; our
    export of it says model_type deepseek_v2 and rope_type yarn."""
    from safetensors.torch import save_file

    model = mla_model(draft_vocab_size=V, rope_scaling=KIMI_YARN)
    published = {"architectures": [ARCH], "model_type": "kimi_k2", "hidden_size": H, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "intermediate_size": 48, "q_lora_rank": 16, "kv_lora_rank": 24,
                 "qk_nope_head_dim": 8, "qk_rope_head_dim": 6, "v_head_dim": 10, "vocab_size": V, "draft_vocab_size": V,
                 "rope_theta": 10000.0, "rope_scaling": KIMI_YARN, "max_position_embeddings": 262144,
                 "rms_norm_eps": 1e-6, "hidden_act": "silu", "num_hidden_layers": 1, "target_hidden_size": H_T,
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True}}
    (tmp_path / "published").mkdir()
    (tmp_path / "published" / "config.json").write_text(json.dumps(published))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    save_file(tensors, str(tmp_path / "published" / "model.safetensors"))
    assert read_draft_config(tmp_path / "published") == model.config
    loaded = load_exported_draft(tmp_path / "published", embedding=model.embed_tokens.weight)
    for name, tensor in tensors.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    raw = json.loads((export_vllm_draft(loaded, tmp_path / "ours") / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v2" and raw["rope_scaling"]["rope_type"] == "yarn" and "type" not in raw["rope_scaling"]


# ---------------------------------------------------------------------------------------------- (4) registry, sizes


def mla_target(**overrides):
    """A tiny DeepSeek-V3-shaped target config (common.target.loading.load_target_info's fields)."""
    text = dict(num_hidden_layers=8, hidden_size=H, vocab_size=V, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=48, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=50000.0,
                max_position_embeddings=262144, q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8,
                qk_rope_head_dim=6, v_head_dim=10, rope_scaling=KIMI_YARN)
    text.update(overrides)
    return SimpleNamespace(hidden_size=H, vocab_size=V, text_config=SimpleNamespace(**text)), text


def test_the_registry_holds_both_families():
    assert family_of([ARCH]) is family_of(["Eagle3DeepseekV3ForCausalLM"]) is DEEPSEEK_EAGLE3_FAMILY
    assert family_of(["LlamaForCausalLMEagle3"]) is family_of(None) is LLAMA_EAGLE3_FAMILY
    assert DEFAULT_ARCHITECTURE == "LlamaForCausalLMEagle3"
    config = mla_config(num_hidden_layers=2)
    model = DEEPSEEK_EAGLE3_FAMILY.build(config)
    assert family_of_config(config) is family_of_model(model) is DEEPSEEK_EAGLE3_FAMILY
    for q_lora in (16, None):
        c = mla_config(q_lora_rank=q_lora, num_hidden_layers=2)
        m = DEEPSEEK_EAGLE3_FAMILY.build(c)
        trainable = [p for p in m.parameters() if p.requires_grad]
        assert DEEPSEEK_EAGLE3_FAMILY.trainable_params(c) == sum(p.numel() for p in trainable)
        assert DEEPSEEK_EAGLE3_FAMILY.largest_param(c) == max(p.numel() for p in trainable)


def test_kv_bytes_are_the_latent_on_every_tensor_parallel_rank(tmp_path):
    """(kv_lora_rank + qk_rope_head_dim) per layer, whole on each rank: Kimi's sizes give 1,152 B in bf16 at any TP."""
    kimi = mla_config(kv_lora_rank=512, qk_rope_head_dim=64)
    assert [DEEPSEEK_EAGLE3_FAMILY.kv_bytes_per_token(kimi, tp, 2) for tp in (1, 8)] == [1152, 1152]
    assert DEEPSEEK_EAGLE3_FAMILY.kv_bytes_per_token(mla_config(num_hidden_layers=2), 8, 2) == 2 * (24 + 6) * 2
    out = export_vllm_draft(mla_model(), tmp_path / "draft")
    assert draft_kv_bytes_per_token(json.loads((out / "config.json").read_text()), 8) == (24 + 6) * 2


def test_the_config_takes_the_targets_mla_sizes_and_rope(tmp_path):
    info, target = mla_target()
    cfg = config_from_dict({"run_dir": str(tmp_path / "run"), "vocab": {"draft_vocab_size": V_D},
                            "draft": {"architecture": ARCH}})
    d = DEEPSEEK_EAGLE3_FAMILY.build_config(cfg, info, V_D, AUX)
    assert type(d) is DeepseekEagle3Config
    assert (d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim) == (16, 24, 8, 6, 10)
    assert (d.num_attention_heads, d.intermediate_size, d.rope_theta, d.head_dim) == (4, 48, 50000.0, 14)
    assert d.rope_scaling["rope_type"] == "yarn" and d.rope_scaling["factor"] == 64.0  # the target's, by default
    assert draft_config_from(cfg, target) == d.__class__(**{**_init_fields(d), "aux_layer_ids": [2, 4, 5]})
    no_q_lora, _ = mla_target(q_lora_rank=None)
    assert DEEPSEEK_EAGLE3_FAMILY.build_config(cfg, no_q_lora, V_D, AUX).q_lora_rank is None
    plain = config_from_dict({"run_dir": str(tmp_path / "run"), "draft": {"architecture": ARCH,
                                                                          "rope_scaling": {"rope_type": "default"}}})
    assert DEEPSEEK_EAGLE3_FAMILY.build_config(plain, info, V_D, AUX).rope_scaling is None
    # a Llama-shaped target has no MLA sizes; a Llama key set for the MLA draft: one line each
    llama, _ = mla_target(kv_lora_rank=None)
    with pytest.raises(ConfigError, match=f"the {ARCH} draft takes its MLA sizes from the target, whose config has no "
                                          f"kv_lora_rank"):
        DEEPSEEK_EAGLE3_FAMILY.build_config(cfg, llama, V_D, AUX)
    head_dim = config_from_dict({"run_dir": str(tmp_path / "run"), "draft": {"architecture": ARCH, "head_dim": 64}})
    with pytest.raises(ConfigError, match=r"draft.head_dim does not apply to the MLA draft"):
        DEEPSEEK_EAGLE3_FAMILY.build_config(head_dim, info, V_D, AUX)
    with pytest.raises(ConfigError, match="not yarn"):
        mla_config(rope_scaling={"rope_type": "llama3", "factor": 8.0})


def _init_fields(d):
    return {k: getattr(d, k) for k, f in d.__dataclass_fields__.items() if f.init}


# ---------------------------------------------------------------------------------------------- (5) training


def test_a_tiny_mla_draft_trains_through_the_real_step(tmp_path):
    info, target = mla_target()
    cfg = config_from_dict({"run_dir": str(tmp_path / "run"), "vocab": {"draft_vocab_size": V_D},
                            "draft": {"architecture": ARCH}})
    assert draft_family_for(cfg) is DEEPSEEK_EAGLE3_FAMILY
    d = DEEPSEEK_EAGLE3_FAMILY.build_config(cfg, info, V_D, AUX)
    plan = plan_memory(d, cfg.train, world_size=1, device_type="cpu")
    torch.manual_seed(0)
    draft = DEEPSEEK_EAGLE3_FAMILY.build(d, attention="chunked")
    assert plan.setting["trainable_params"] == sum(p.numel() for p in draft.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(4)
    used = torch.randperm(V, generator=g)[:V_D].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    draft.set_vocab_map(used - torch.arange(V_D), t2d)
    draft.load_target_embedding(torch.randn(V, H, generator=g))
    seq = [9, 13, 6]
    T = sum(seq)
    aux, ids = torch.randn(T, len(AUX) * H, generator=g), torch.randint(0, V, (T,), generator=g)
    final, loss_mask = torch.randn(T, H, generator=g) * 3, (torch.rand(T, generator=g) < 0.7).long()
    pos = torch.cat([torch.arange(n) for n in seq])
    mb = MicroBatch(ids, loss_mask, aux, final, pos, seq, [f"s{i}" for i in range(len(seq))])
    lm_head = torch.randn(V, H, generator=g) / H ** 0.5
    before = draft.midlayer.self_attn.kv_b_proj.weight.detach().clone()
    step = build_step(draft, lm_head, StepSettings(ttt_steps=3, loss_decay=0.8, grad_clip=0.5, lr=1e-2, betas=(0.9, 0.95),
                                                   weight_decay=0.0))
    losses = [float(step.run([(mb, True)], 1, denominator=None).outputs[0][0].loss.detach()) for _ in range(5)]
    assert losses[-1] < losses[0] * 0.9, losses
    assert not torch.equal(draft.midlayer.self_attn.kv_b_proj.weight, before)  # the MLA projections train


# ---------------------------------------------------------------------------------------------- (6) vLLM (slow)

# vLLM serving an exported MLA draft beside the tiny DeepSeek-V3 target: tests/train/test_init_from_published_mla.py (a
# full-vocab draft fine-tuned from the published layout) and tests/pipeline/test_kimi_proxy_serves_mla_draft.py (the
# proxy end to end, a draft vocab with d2t), with tests/helpers.serve_offline.
