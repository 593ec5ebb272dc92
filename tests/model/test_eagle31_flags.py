"""EAGLE-3.1's norm flags (draft.fc_norm, draft.norm_before_fc, draft.norm_output) in both draft families: the TTT
forward equals a reference written from vLLM 0.32's modules for every flag combination (llama_eagle3.py,
deepseek_eagle3.py: combine_hidden_states, the decoder layer with its fused residual norms, the model's final
`norm(h, residual)` and its aux_output); norm_output changes only the state the next step reads; the export writes
vLLM's keys and tensor names and reads them back; the families declare the flags they read, and the config errors
are one line (exit 2 from a stage)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from common.core.errors import ConfigError, DataError
from common.model.draft import DEEPSEEK_EAGLE3_FAMILY, LLAMA_EAGLE3_FAMILY, NORM_FLAGS, DraftModelConfig, Eagle3DraftModel
from common.model.draft.deepseek_eagle3 import DeepseekEagle3Config, Eagle3DeepseekV2Draft
from common.model.export import export_speculators_draft, export_vllm_draft, load_exported_draft, read_draft_config
from tests.helpers import error_line, run_stage, write_yaml

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, H_T, V, V_D = 32, 24, 96, 48  # H_T != H: fc_norm's width is the target's
AUX = [1, 2, 3]
SEQ = [7, 3, 9]
STEPS = 3


def llama_config(**kw) -> DraftModelConfig:
    return DraftModelConfig(**{**dict(hidden_size=H, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, vocab_size=V, draft_vocab_size=V_D, target_hidden_size=H_T,
                                      aux_layer_ids=AUX, rms_norm_eps=1e-5), **kw})


def mla_config(**kw) -> DeepseekEagle3Config:
    return DeepseekEagle3Config(**{**dict(hidden_size=H, intermediate_size=40, num_attention_heads=4, q_lora_rank=16,
                                          kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10,
                                          vocab_size=V, draft_vocab_size=V_D, target_hidden_size=H_T, aux_layer_ids=AUX,
                                          rms_norm_eps=1e-5), **kw})


def random_draft(config, seed: int = 0):
    """Weights far from the init (norm weights around 1, not 1), so that a misplaced or missing norm shows."""
    torch.manual_seed(seed)
    model = (Eagle3DeepseekV2Draft if isinstance(config, DeepseekEagle3Config) else Eagle3DraftModel)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.25) if p.dim() == 2 else p.uniform_(0.5, 1.5)
        model.embed_tokens.weight.normal_(0, 1.0)
    return model


def make_row(seed: int = 1):
    """aux states of unequal sizes per layer (x1, x4, x7), as the target's grow with depth: what fc_norm evens out."""
    g = torch.Generator().manual_seed(seed)
    T = sum(SEQ)
    aux = torch.randn(T, len(AUX), H_T, generator=g) * torch.tensor([1.0, 4.0, 7.0])[:, None]
    return aux.reshape(T, -1), torch.randint(0, V, (T,), generator=g), torch.cat([torch.arange(n) for n in SEQ])


# ---------------------------------------------------------------------------------------------- vLLM's math


def rms(x, w, eps):  # vLLM's RMSNorm.forward_native
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rms_add(x, residual, w, eps):  # vLLM's RMSNorm(x, residual): the residual added first, both returned
    x = x + residual
    return rms(x, w, eps), x


def combine_hidden_states(w, c, aux):
    """Eagle3LlamaForCausalLM / Eagle3DeepseekV2ForCausalLM.combine_hidden_states: input_norm (norm_before_fc, Llama
    only), then one fc_norm per aux chunk, then fc."""
    if c.norm_before_fc:
        aux = rms(aux, w["input_norm.weight"], c.rms_norm_eps)
    if c.fc_norm:
        aux = torch.cat([rms(chunk, w[f"fc_norm.{i}.weight"], c.rms_norm_eps)
                         for i, chunk in enumerate(aux.chunk(c.num_aux, dim=-1))], dim=-1)
    return aux @ w["fc.weight"].T


def rope_neox(x, pos, theta):  # vLLM's get_rope(is_neox_style=True): halves rotated
    d = x.shape[-1]
    ang = pos.double()[:, None] * (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))[None]
    cos, sin = (torch.cat([f, f], -1).float()[:, None] for f in (ang.cos(), ang.sin()))
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def rope_interleaved(x, pos, theta):  # is_neox_style=False (DeepseekV2MLAAttention): pairs (2i, 2i + 1) rotated
    d = x.shape[-1]
    ang = pos.double()[:, None] * (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))[None]
    cos, sin = (f.float().repeat_interleave(2, -1)[:, None] for f in (ang.cos(), ang.sin()))
    return x * cos + torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2) * sin


def llama_qkv(w, p, c, x, pos):
    """LlamaAttention's qkv_proj (q, k, v stacked) and neox rope; scale head_dim**-0.5."""
    T = x.shape[0]
    q = rope_neox((x @ w[p + "q_proj.weight"].T).view(T, c.num_attention_heads, c.head_dim), pos, c.rope_theta)
    k = rope_neox((x @ w[p + "k_proj.weight"].T).view(T, c.num_key_value_heads, c.head_dim), pos, c.rope_theta)
    return q, k, (x @ w[p + "v_proj.weight"].T).view(T, c.num_key_value_heads, c.head_dim), c.head_dim ** -0.5


def mla_qkv(w, p, c, x, pos):
    """DeepseekV2MLAAttention (no yarn): q = q_b_proj(q_a_layernorm(q_a_proj(x))); the latent and the shared rope key
    from kv_a_proj_with_mqa; k_nope, v = kv_b_proj(kv_a_layernorm(latent)); interleaved rope on the rope slice."""
    T, nh, nope, r, eps = x.shape[0], c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.rms_norm_eps
    q = (rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], eps) @ w[p + "q_b_proj.weight"].T).view(T, nh, -1)
    latent, k_pe = (x @ w[p + "kv_a_proj_with_mqa.weight"].T).split([c.kv_lora_rank, r], dim=-1)
    k_nope, v = (rms(latent, w[p + "kv_a_layernorm.weight"], eps) @ w[p + "kv_b_proj.weight"].T).view(
        T, nh, nope + c.v_head_dim).split([nope, c.v_head_dim], dim=-1)
    q = torch.cat([q[..., :nope], rope_interleaved(q[..., nope:], pos, c.rope_theta)], -1)
    k = torch.cat([k_nope, rope_interleaved(k_pe[:, None], pos, c.rope_theta).expand(T, nh, r)], -1)
    return q, k, v, c.qk_head_dim ** -0.5


def vllm_reference(w, c, aux, ids, pos, seq_lens, steps):
    """Per-step logits [T, V_d] from vLLM's modules' math, written from llama_eagle3.py / deepseek_eagle3.py with
    the TTT alignment (step i at index t: token x_{t+1+i}, position pos[t] + i, the step-0 keys of its sample up to t
    and its own steps 1..i). Each step: every layer as the decoder layer computes it (layer 0: cat(input_layernorm(
    embeds), hidden_norm(hidden)), the residual the hidden (or the normed one, norm_before_residual); later layers:
    input_layernorm(hidden, residual); then post_attention_layernorm(attn, residual) -> MLP), then
    `hidden, prenorm = norm(hidden, residual)`: logits = lm_head(hidden); the next step reads hidden with norm_output,
    else prenorm (the model's aux_output)."""
    qkv = mla_qkv if isinstance(c, DeepseekEagle3Config) else llama_qkv
    eps, T = c.rms_norm_eps, ids.shape[0]
    sample = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    start = torch.tensor([sum(seq_lens[:i]) for i in range(len(seq_lens))])[sample]
    end = start + torch.tensor(seq_lens)[sample]
    prefixes = ["midlayer."] + [f"layers.{k}." for k in range(1, c.num_hidden_layers)]
    caches = [([], []) for _ in prefixes]
    hidden = combine_hidden_states(w, c, aux)
    logits = []
    for i in range(steps):
        nxt = torch.arange(T) + 1 + i
        embeds = w["embed_tokens.weight"][torch.where(nxt < end, ids[nxt.clamp(max=T - 1)], torch.zeros_like(ids))]
        residual = None
        for p, (keys, values) in zip(prefixes, caches):
            if residual is None:  # layer 0
                normed = rms(hidden, w[p + "hidden_norm.weight"], eps)
                residual = normed if c.norm_before_residual else hidden
                x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"], eps), normed], -1)
            else:
                x, residual = rms_add(hidden, residual, w[p + "input_layernorm.weight"], eps)
            q, k, v, scale = qkv(w, p + "self_attn.", c, x, pos + i)
            keys.append(k)
            values.append(v)
            out = []
            for t in range(T):
                ctx = torch.arange(int(start[t]), t + 1)
                k_t = torch.cat([keys[0][ctx]] + [keys[j][t:t + 1] for j in range(1, i + 1)])
                v_t = torch.cat([values[0][ctx]] + [values[j][t:t + 1] for j in range(1, i + 1)])
                groups = q.shape[1] // k_t.shape[1]
                probs = torch.softmax(torch.einsum("hd,shd->hs", q[t], k_t.repeat_interleave(groups, 1)) * scale, -1)
                out.append(torch.einsum("hs,shd->hd", probs, v_t.repeat_interleave(groups, 1)).reshape(-1))
            m, residual = rms_add(torch.stack(out) @ w[p + "self_attn.o_proj.weight"].T, residual,
                                  w[p + "post_attention_layernorm.weight"], eps)
            hidden = (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[
                p + "mlp.down_proj.weight"].T
        normed, prenorm = rms_add(hidden, residual, w["norm.weight"], eps)
        logits.append(normed @ w["lm_head.weight"].T)
        hidden = normed if c.norm_output else prenorm
    return logits


def weights_of(model) -> dict:
    return {n: t.detach() for n, t in model.state_dict().items()}


LLAMA_FLAGS = [dict(), dict(fc_norm=True), dict(norm_before_fc=True), dict(norm_output=True),
               dict(fc_norm=True, norm_output=True), dict(norm_before_fc=True, norm_output=True)]
MLA_FLAGS = [dict(), dict(fc_norm=True), dict(norm_output=True), dict(fc_norm=True, norm_output=True)]
CASES = ([("llama", f, 1) for f in LLAMA_FLAGS] + [("llama", dict(fc_norm=True, norm_output=True, norm_before_residual=True), 2)]
         + [("mla", f, 1) for f in MLA_FLAGS])


def case_config(family: str, flags: dict, layers: int):
    return (mla_config if family == "mla" else llama_config)(num_hidden_layers=layers, **flags)


@pytest.mark.parametrize("family,flags,layers", CASES, ids=[f"{f}-{'+'.join(fl) or 'eagle3'}-{n}l" for f, fl, n in CASES])
def test_ttt_forward_equals_vllms_math_for_every_flag_combination(family, flags, layers):
    model = random_draft(case_config(family, flags, layers))
    aux, ids, pos = make_row()
    with torch.no_grad():
        ours = model.forward_ttt(aux, ids, pos, SEQ, STEPS)
        ref = vllm_reference(weights_of(model), model.config, aux, ids, pos, SEQ, STEPS)
    for step, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=3e-5, msg=f"step {step}")


@pytest.mark.parametrize("family", ["llama", "mla"])
def test_each_norm_is_where_vllm_puts_it(family):
    """The reference tells the flags apart: with a flag's norm left out (the same weights read as EAGLE-3), the
    logits move; fc_norm per chunk differs from one norm over the concatenation."""
    flags = [dict(fc_norm=True), dict(norm_output=True)] + ([dict(norm_before_fc=True)] if family == "llama" else [])
    aux, ids, pos = make_row()
    for f in flags:
        model = random_draft(case_config(family, f, 1))
        w = weights_of(model)
        with torch.no_grad():
            ours = model.forward_ttt(aux, ids, pos, SEQ, STEPS)
            without = vllm_reference(w, dataclasses.replace(model.config, **dict.fromkeys(f, False)), aux, ids, pos, SEQ, STEPS)
        last = STEPS - 1  # norm_output moves step 1 on; the norms before fc every step
        assert (ours[last] - without[last]).abs().max() > 0.05, f
    if family == "llama":  # per chunk != over the concatenation, even with unit weights
        c = llama_config(fc_norm=True)
        w = {f"fc_norm.{i}.weight": torch.ones(H_T) for i in range(3)} | {"input_norm.weight": torch.ones(3 * H_T),
                                                                         "fc.weight": torch.eye(H, 3 * H_T)}
        per_chunk = combine_hidden_states(w, c, aux)
        over_all = combine_hidden_states(w, dataclasses.replace(c, fc_norm=False, norm_before_fc=True), aux)
        assert (per_chunk - over_all).abs().max() > 0.5


@pytest.mark.parametrize("family", ["llama", "mla"])
def test_norm_output_changes_only_the_state_the_next_step_reads(family):
    """Same weights, norm_output off and on: step 0's logits are identical (lm_head reads the normed state in both
    modes, SpecForge#879); from step 1 on they differ (the next step reads the normed state)."""
    eagle3 = random_draft(case_config(family, dict(fc_norm=True), 1))
    eagle31 = random_draft(case_config(family, dict(fc_norm=True, norm_output=True), 1))
    eagle31.load_state_dict(eagle3.state_dict())
    aux, ids, pos = make_row()
    with torch.no_grad():
        a, b = eagle3.forward_ttt(aux, ids, pos, SEQ, STEPS), eagle31.forward_ttt(aux, ids, pos, SEQ, STEPS)
        assert torch.equal(a[0], b[0])
        assert (a[1] - b[1]).abs().max() > 0.05
        # what the next step reads: the pre-norm output, or exactly what lm_head reads
        h = torch.randn(5, H)
        assert torch.equal(eagle3.next_step_hidden(h), h) and torch.equal(eagle31.next_step_hidden(h), eagle31.final_norm(h))


# ---------------------------------------------------------------------------------------------- export and read back


@pytest.mark.parametrize("family,flags", [("llama", dict(fc_norm=True, norm_output=True)), ("llama", dict(norm_before_fc=True)),
                                          ("mla", dict(fc_norm=True, norm_output=True))])
def test_export_writes_vllms_keys_and_tensor_names_and_reads_them_back(tmp_path, family, flags):
    model = random_draft(case_config(family, flags, 1))
    out = export_vllm_draft(model, tmp_path / "draft", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    # vLLM's keys: fc_norm and norm_output at the top (both families); norm_before_fc only where vLLM reads it
    written = {flag: config[flag] for flag in NORM_FLAGS if flag in config}
    expected_keys = NORM_FLAGS if family == "llama" else ("fc_norm", "norm_output")
    assert written == {flag: flags.get(flag, False) for flag in expected_keys}
    tensors = load_file(str(out / "model.safetensors"))
    norms = {n: tuple(t.shape) for n, t in tensors.items() if n.startswith(("fc_norm.", "input_norm."))}
    if flags.get("fc_norm"):  # vLLM: model.fc_norm = ModuleList(RMSNorm(target_hidden_size)) per aux state
        assert norms == {f"fc_norm.{i}.weight": (H_T,) for i in range(3)}
    else:  # vLLM: model.input_norm = RMSNorm(target_hidden_size * num_aux)
        assert norms == {"input_norm.weight": (3 * H_T,)}
    back = load_exported_draft(out, embedding=model.embed_tokens.weight.detach())
    assert {flag: getattr(back.config, flag) for flag in NORM_FLAGS} == {flag: flags.get(flag, False) for flag in NORM_FLAGS}
    aux, ids, pos = make_row()
    with torch.no_grad():
        for a, b in zip(model.forward_ttt(aux, ids, pos, SEQ, STEPS), back.forward_ttt(aux, ids, pos, SEQ, STEPS)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the export load-check covers the new tensors: one missing is refused in one line naming it
    from safetensors.torch import save_file

    name = next(iter(norms))
    save_file({n: t for n, t in tensors.items() if n != name}, str(out / "model.safetensors"))
    with pytest.raises(DataError, match=f"missing \\['{name}'\\]"):
        load_exported_draft(out)


def test_the_speculators_export_carries_the_flags_and_vllm_reads_them(tmp_path):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    model = random_draft(llama_config(fc_norm=True, norm_output=True))
    out = export_speculators_draft(model, tmp_path / "spec", verifier_name_or_path="target", speculative_tokens=3)
    config = json.loads((out / "config.json").read_text())
    assert {flag: config[flag] for flag in NORM_FLAGS} == {"fc_norm": True, "norm_before_fc": False, "norm_output": True}
    assert {"fc_norm.0.weight", "fc_norm.2.weight"} <= set(load_file(str(out / "model.safetensors")))
    vllm_view = SpeculatorsConfig.from_pretrained(str(out))  # what vLLM builds its draft config from
    assert (vllm_view.fc_norm, vllm_view.norm_before_fc, vllm_view.norm_output) == (True, False, True)
    assert {flag: getattr(read_draft_config(out), flag) for flag in NORM_FLAGS} == {
        "fc_norm": True, "norm_before_fc": False, "norm_output": True}


def test_vllm_reads_norm_before_fc_from_eagle_config_first(tmp_path):
    raw = llama_config().to_vllm_config()
    raw["eagle_config"] = {**raw["eagle_config"], "norm_before_fc": True}
    assert DraftModelConfig.from_vllm_config(raw).norm_before_fc is True
    assert DraftModelConfig.from_vllm_config({k: v for k, v in raw.items() if k not in NORM_FLAGS}).norm_before_fc is True


# ---------------------------------------------------------------------------------------------- declared flags, errors


def test_each_family_declares_the_flags_it_reads_and_counts_their_weights():
    assert LLAMA_EAGLE3_FAMILY.config_class.norm_flags == frozenset(NORM_FLAGS)
    assert DEEPSEEK_EAGLE3_FAMILY.config_class.norm_flags == frozenset({"fc_norm", "norm_output"})
    for family, flags in ((LLAMA_EAGLE3_FAMILY, dict(fc_norm=True)), (LLAMA_EAGLE3_FAMILY, dict(norm_before_fc=True)),
                          (LLAMA_EAGLE3_FAMILY, dict(norm_output=True)), (DEEPSEEK_EAGLE3_FAMILY, dict(fc_norm=True))):
        config = case_config("mla" if family is DEEPSEEK_EAGLE3_FAMILY else "llama", flags, 1)
        counted = sum(p.numel() for p in family.build(config).trainable_parameters())
        assert family.trainable_params(config) == counted, flags  # 04's memory planner counts parameters exactly


def test_a_flag_the_family_does_not_read_or_both_norms_before_fc_are_one_line():
    with pytest.raises(ConfigError) as e:
        mla_config(norm_before_fc=True)
    assert str(e.value) == ("norm_before_fc is set, but vLLM's model of this draft architecture does not read it and "
                            "would serve the draft without that norm; set draft.norm_before_fc: false (it reads only "
                            "fc_norm, norm_output)")
    with pytest.raises(ConfigError) as e:
        llama_config(fc_norm=True, norm_before_fc=True)
    assert str(e.value) == ("draft.fc_norm and draft.norm_before_fc are both true, and they are exclusive (fc_norm "
                            "normalises each aux hidden state before fc, norm_before_fc their concatenation); set one of "
                            "them to false")


def test_a_draft_config_json_with_a_norm_vllm_would_skip_is_refused_when_read(tmp_path):
    """A config.json of an MLA draft with norm_before_fc (vLLM would serve it without): one DataError line naming the
    file, as init_from and 05 read it."""
    out = export_vllm_draft(random_draft(mla_config()), tmp_path / "mla")
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "norm_before_fc": True}))
    with pytest.raises(DataError) as e:
        read_draft_config(out)
    assert str(e.value).startswith(f"{out / 'config.json'} is not a valid EAGLE-3 draft config (norm_before_fc is set, "
                                   f"but vLLM's model of this draft architecture does not read it")


@pytest.mark.parametrize("sets,says", [
    (["draft.fc_norm=true", "draft.norm_before_fc=true"],
     ["draft.fc_norm and draft.norm_before_fc are both true, and they are exclusive", "set one of them to false"]),
    (["draft.architecture=Eagle3DeepseekV2ForCausalLM", "draft.norm_before_fc=true"],
     ["draft.norm_before_fc does not apply to the MLA draft (Eagle3DeepseekV2ForCausalLM)",
      "remove draft.norm_before_fc from the config"]),
])
def test_04_refuses_the_bad_combinations_in_one_line_before_reading_anything(tmp_path, sets, says):
    """Before any input is read (there is none here: an empty run folder), exit 2 and one error line."""
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), "target": {"model": str(tmp_path / "none")}})
    res = run_stage("04_train.py", cfg, *[a for s in sets for a in ("--set", s)], timeout=300)
    error_line(res, *says)
    assert not (tmp_path / "run" / "train").exists()
