"""The EAGLE-3 draft model: names/shapes, TTT attention (efficient vs naive), packing, and the
TTT forward against an independent step-by-step (vLLM-style) drafting reference."""

from __future__ import annotations

import math

import pytest
import torch

from common.model.draft import AttentionMeta, DraftModelConfig, Eagle3DraftModel, PackedLayout
from common.model.draft.attention import build_ttt_mask, chunked_ttt_attention, naive_ttt_attention
from common.core.errors import ConfigError, DataError

H, H_T, V, V_D = 64, 48, 300, 100


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_config(**kw) -> DraftModelConfig:
    base = dict(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=V, draft_vocab_size=V_D, target_hidden_size=H_T, aux_layer_ids=[1, 2, 3],
                rope_theta=10000.0, rms_norm_eps=1e-6)
    base.update(kw)
    return DraftModelConfig(**base)


def make_model(seed=0, **kw) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    model = Eagle3DraftModel(make_config(**kw))
    with torch.no_grad():  # larger weights than the 0.02 init so differences are not hidden by tiny values
        for name, p in model.named_parameters():
            if p.dim() == 2 and p.requires_grad:
                p.normal_(0, 0.2)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)
        model.embed_tokens.weight.normal_(0, 1.0)
    return model


def make_row(seq_lens, seed=1, n_aux=3):
    g = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    aux = torch.randn(T, n_aux * H_T, generator=g)
    ids = torch.randint(0, V, (T,), generator=g)
    pos = torch.cat([torch.arange(n) for n in seq_lens])
    return aux, ids, pos


# ---------------------------------------------------------------------------------------------
# names, shapes, config
# ---------------------------------------------------------------------------------------------


def test_state_dict_uses_official_vllm_names_and_shapes():
    model = Eagle3DraftModel(make_config(num_hidden_layers=2))
    sd = model.state_dict()
    qkv_in = 2 * H
    expected = {
        "fc.weight": (H, 3 * H_T),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (4 * 16, qkv_in),
        "midlayer.self_attn.k_proj.weight": (2 * 16, qkv_in),
        "midlayer.self_attn.v_proj.weight": (2 * 16, qkv_in),
        "midlayer.self_attn.o_proj.weight": (H, 4 * 16),
        "midlayer.mlp.gate_proj.weight": (96, H),
        "midlayer.mlp.up_proj.weight": (96, H),
        "midlayer.mlp.down_proj.weight": (H, 96),
        # extra layers: vLLM's LlamaModel.layers[1] (plain decoder layer, H-wide input, no hidden_norm)
        "layers.1.input_layernorm.weight": (H,),
        "layers.1.post_attention_layernorm.weight": (H,),
        "layers.1.self_attn.q_proj.weight": (64, H),
        "layers.1.self_attn.k_proj.weight": (32, H),
        "layers.1.self_attn.v_proj.weight": (32, H),
        "layers.1.self_attn.o_proj.weight": (H, 64),
        "layers.1.mlp.gate_proj.weight": (96, H),
        "layers.1.mlp.up_proj.weight": (96, H),
        "layers.1.mlp.down_proj.weight": (H, 96),
        "norm.weight": (H,),
        "lm_head.weight": (V_D, H),
        "embed_tokens.weight": (V, H),
        "d2t": (V_D,),
        "t2d": (V,),
    }
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert not model.embed_tokens.weight.requires_grad
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(expected) - {"embed_tokens.weight", "d2t", "t2d"}


def test_forward_ttt_shapes_and_batch_of_one():
    model = make_model()
    seq = [6, 4]
    aux, ids, pos = make_row(seq)
    out = model.forward_ttt(aux, ids, pos, seq, 3)
    assert len(out) == 3 and all(o.shape == (10, V_D) for o in out)
    hidden = model.forward_ttt_hidden(aux[None], ids[None], pos[None], seq, 2)
    assert all(h.shape == (10, H) for h in hidden)
    torch.testing.assert_close(model.compute_logits(hidden[1]), out[1], rtol=0, atol=1e-6)


def test_config_round_trip_and_vllm_fields():
    cfg = make_config(num_hidden_layers=2, norm_before_residual=True,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 2048})
    d = cfg.to_vllm_config(torch_dtype="float16", bos_token_id=5)
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["model_type"] == "llama"
    assert d["draft_vocab_size"] == V_D and d["vocab_size"] == V and d["target_hidden_size"] == H_T
    assert d["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert d["norm_before_residual"] is True and d["tie_word_embeddings"] is False
    assert d["torch_dtype"] == "float16" and d["bos_token_id"] == 5 and d["num_hidden_layers"] == 2
    assert DraftModelConfig.from_vllm_config(d) == cfg
    # ids passed as extra config update every copy; a wrong count is refused
    d3 = cfg.to_vllm_config(eagle_aux_hidden_state_layer_ids=[4, 5, 6])
    assert d3["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [4, 5, 6] == d3["eagle_aux_hidden_state_layer_ids"]
    with pytest.raises(ConfigError, match="aux layers"):
        cfg.to_vllm_config(eagle_aux_hidden_state_layer_ids=[4, 5])
    # transformers-5 style rope_parameters are understood too
    d2 = dict(d)
    del d2["rope_theta"], d2["rope_scaling"]
    d2["rope_parameters"] = {"rope_theta": 10000.0, **cfg.rope_scaling}
    assert DraftModelConfig.from_vllm_config(d2) == cfg


def test_config_validation_errors():
    with pytest.raises(ConfigError, match="distinct"):
        make_config(aux_layer_ids=[2, 2, 1])
    with pytest.raises(ConfigError, match="multiple"):
        make_config(num_key_value_heads=3)
    with pytest.raises(ConfigError, match="larger than the target vocab"):
        make_config(draft_vocab_size=V + 1)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                                     {"rope_type": "linear", "factor": 2.0}])
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = make_config(rope_theta=50000.0, rope_scaling=scaling, max_position_embeddings=1024)
    model = Eagle3DraftModel(cfg)
    pos = torch.arange(0, 900, 7)
    cos, sin = model.rotary(pos)
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H, num_attention_heads=4, head_dim=16, rope_theta=50000.0,
                                          rope_scaling=scaling, max_position_embeddings=1024))
    hcos, hsin = hf(torch.zeros(1, dtype=torch.float32), pos[None])
    torch.testing.assert_close(cos, hcos[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, hsin[0], rtol=0, atol=1e-5)
    # bf16 model: RoPE frequencies stay fp32
    model.to(torch.bfloat16)
    assert model.rotary.inv_freq.dtype == torch.float32


def test_vocab_map_and_draft_to_target_ids():
    model = Eagle3DraftModel(make_config(vocab_size=10, draft_vocab_size=3))
    # draft ids 0, 1, 2 -> target ids 2, 5, 7
    d2t = torch.tensor([2, 4, 5])
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[2, 5, 7]] = True
    model.set_vocab_map(d2t, t2d)
    assert model.draft_to_target_ids(torch.tensor([0, 1, 2, 1, 0])).tolist() == [2, 5, 7, 5, 2]
    assert model.draft_vocab_target_ids().tolist() == [2, 5, 7]
    bad = t2d.clone()
    bad[3] = True
    with pytest.raises(DataError, match="inconsistent"):
        model.set_vocab_map(d2t, bad)
    with pytest.raises(DataError, match="expects"):
        model.set_vocab_map(d2t[:2], t2d)


def test_load_target_embedding_copies_and_freezes():
    model = Eagle3DraftModel(make_config())
    w = torch.randn(V, H)
    model.load_target_embedding(w)
    assert torch.equal(model.embed_tokens.weight, w) and not model.embed_tokens.weight.requires_grad
    with pytest.raises(DataError, match="shape"):
        model.load_target_embedding(torch.randn(V, H + 1))


# ---------------------------------------------------------------------------------------------
# TTT attention
# ---------------------------------------------------------------------------------------------


def test_ttt_mask_matches_spec_example():
    # docs/design.md#ttt-alignment-and-loss: T=4 (one sample), step 2 rows
    mask = build_ttt_mask([4], 3)
    rows = mask[8:12].int().tolist()
    assert rows == [
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
    ]
    # step 0 rows never see later steps; samples never see each other
    mask = build_ttt_mask([2, 2], 2)
    assert not mask[:4, 4:].any()
    assert mask[0:4, 0:4].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


@pytest.mark.parametrize("seq_lens,chunk", [([9], 4), ([5, 1, 7, 3], 3), ([2, 11, 4], 5), ([6, 6], 100)])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("nh,nkv", [(6, 2), (2, 2), (3, 1)])  # GQA, MHA (Kimi's draft), one kv head
def test_chunked_attention_equals_naive_outputs_and_grads(seq_lens, chunk, steps, nh, nkv):
    torch.manual_seed(0)
    T, d = sum(seq_lens), 8
    q = torch.randn(T, nh, d, requires_grad=True)
    ks = [torch.randn(T, nkv, d, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(T, nkv, d, requires_grad=True) for _ in range(steps)]
    meta = AttentionMeta(PackedLayout.build(seq_lens, T, "cpu"), chunk_size=chunk)
    weights = torch.randn(T, nh, d)
    outs, grads = [], []
    for fn in (chunked_ttt_attention, naive_ttt_attention):
        out = fn(q, ks, vs, meta)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, *ks, *vs)])
        for t in (q, *ks, *vs):
            t.grad = None
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def outputs_and_grads(model, seq, steps, impl, chunk=4, gc=False, row=None):
    """The TTT logits of one packed row (`row` = (aux, ids, pos), default make_row(seq)) and the gradients of a
    fixed random projection of them, with attention `impl`."""
    aux, ids, pos = row if row is not None else make_row(seq)
    aux = aux.to(model.fc.weight.dtype).requires_grad_(True)
    model.zero_grad(set_to_none=True)
    model.attention_impl, model.attn_chunk_size, model.gradient_checkpointing = impl, chunk, gc
    logits = model.forward_ttt(aux, ids, pos, seq, steps)
    g = torch.Generator().manual_seed(7)
    # scaled so gradients are O(1): the fp32 comparison below is then an absolute 1e-5
    loss = sum((l * torch.randn(l.shape, generator=g)).sum() / math.sqrt(l.numel()) for l in logits)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    grads["aux"] = aux.grad.clone()
    return [l.detach() for l in logits], grads


def assert_same_outputs_and_grads(got: tuple, ref: tuple, atol: float) -> None:
    """Two outputs_and_grads results equal up to `atol`, every logit and every gradient."""
    (out, grads), (ref_out, ref_grads) = got, ref
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    assert set(grads) == set(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_model_chunked_equals_naive_outputs_and_grads(layers):
    """In float64, so that equal means equal: the chunked attention (its hand-written backward included) is the
    naive full-mask attention up to rounding, 1e-10 (fp32 differs by summation order alone, ~1e-5)."""
    model = make_model(num_hidden_layers=layers).double()
    model.rotary.inv_freq = model.rotary.inv_freq.double()
    seq = [7, 2, 9, 1, 5]
    ref = outputs_and_grads(model, seq, 3, "naive")
    for chunk, gc in [(4, False), (3, False), (100, False), (4, True)]:  # gradient checkpointing changes nothing
        assert_same_outputs_and_grads(outputs_and_grads(model, seq, 3, "chunked", chunk=chunk, gc=gc), ref, 1e-10)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_attention_forward_equals_naive():
    pytest.importorskip("torch.nn.attention.flex_attention")
    assert_flex_forward_equals_naive(make_model(num_hidden_layers=2), make_row([5, 3, 6]), [5, 3, 6])


def assert_flex_forward_equals_naive(model, row: tuple, seq: list[int]) -> None:
    """3 TTT steps over the packed row (aux, ids, pos) of samples `seq`: flex's logits are naive's (fp32)."""
    aux, ids, pos = row
    with torch.no_grad():  # flex has no CPU backward; CUDA runs it compiled
        model.attention_impl = "naive"
        ref = model.forward_ttt(aux, ids, pos, seq, 3)
        model.attention_impl = "flex"
        out = model.forward_ttt(aux, ids, pos, seq, 3)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_packed_row_equals_each_sample_alone():
    model = make_model(num_hidden_layers=2)
    seq = [6, 1, 9, 4]
    aux, ids, pos = make_row(seq)
    model.attn_chunk_size = 5
    with torch.no_grad():
        packed = model.forward_ttt(aux, ids, pos, seq, 4)
    start = 0
    for n in seq:
        with torch.no_grad():
            alone = model.forward_ttt(aux[start:start + n], ids[start:start + n], pos[start:start + n], [n], 4)
        for step in range(4):
            valid = n - 2 - step  # positions with a target inside the sample
            if valid > 0:
                torch.testing.assert_close(packed[step][start:start + valid], alone[step][:valid], rtol=0, atol=1e-5)
        start += n


# ---------------------------------------------------------------------------------------------
# TTT forward == step-by-step drafting as vLLM does it at inference
# ---------------------------------------------------------------------------------------------


def _rope(x, pos, theta, d):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _layer_reference(layer, cfg, hidden, embeds, pos, cache):
    """One decoder layer on new positions `pos` (rows of hidden), appending to `cache` [(k, v)]:
    plain causal attention over everything in the cache (vLLM's KV cache semantics)."""
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if embeds is not None:
        normed = _rms(hidden, layer.hidden_norm.weight, cfg.rms_norm_eps)
        residual = normed if cfg.norm_before_residual else hidden
        x = torch.cat([_rms(embeds, layer.input_layernorm.weight, cfg.rms_norm_eps), normed], -1)
    else:
        residual, x = hidden, _rms(hidden, layer.input_layernorm.weight, cfg.rms_norm_eps)
    a = layer.self_attn
    n = x.shape[0]
    q = _rope(a.q_proj(x).view(n, nh, d), pos, cfg.rope_theta, d)
    k = _rope(a.k_proj(x).view(n, nkv, d), pos, cfg.rope_theta, d)
    v = a.v_proj(x).view(n, nkv, d)
    outs = []
    for r in range(n):  # each new row sees the old cache plus the new rows up to itself
        cache.append((k[r], v[r]))
        K = torch.stack([c[0] for c in cache]).repeat_interleave(nh // nkv, 1)
        Vv = torch.stack([c[1] for c in cache]).repeat_interleave(nh // nkv, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[r], K) / math.sqrt(d), -1)
        outs.append(torch.einsum("hs,shd->hd", p, Vv).reshape(nh * d))
    h = residual + a.o_proj(torch.stack(outs))
    m = layer.mlp
    return h + m.down_proj(torch.nn.functional.silu(m.gate_proj(_rms(h, layer.post_attention_layernorm.weight,
                                                                       cfg.rms_norm_eps))) * m.up_proj(
        _rms(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)))


@pytest.mark.parametrize("layers,norm_before_residual", [(1, False), (2, True)])
def test_ttt_equals_step_by_step_drafting(layers, norm_before_residual):
    """TTT step i at index t == vLLM-style chain drafting from anchor t: a first pass over the
    context 0..t with target features and tokens x_1..x_{t+1}, then draft steps that feed the
    previous pre-norm output back, with token x_{t+1+i} (teacher forcing) at position t+i."""
    model = make_model(num_hidden_layers=layers, norm_before_residual=norm_before_residual)
    cfg = model.config
    seq, steps = [9], 4
    aux, ids, pos = make_row(seq)
    pos = pos + 3  # positions need not start at 0
    with torch.no_grad():
        ttt = model.forward_ttt(aux, ids, pos, seq, steps)
        L = seq[0]
        for t in range(L - 2):
            caches = [[] for _ in range(layers)]
            # first pass over the context 0..t
            h = model.fc(aux[: t + 1])
            e = model.embed_tokens(ids[1: t + 2])
            for layer, cache in zip(model.decoder_layers, caches):
                h = _layer_reference(layer, cfg, h, e if layer.first else None, pos[: t + 1], cache)
            hidden = h[-1:]
            torch.testing.assert_close(model.compute_logits(hidden)[0], ttt[0][t], rtol=0, atol=1e-4)
            for i in range(1, steps):
                if t + 2 + i > L - 1:
                    break
                h = hidden
                e = model.embed_tokens(ids[t + 1 + i: t + 2 + i])
                for layer, cache in zip(model.decoder_layers, caches):
                    h = _layer_reference(layer, cfg, h, e if layer.first else None, pos[t:t + 1] + i, cache)
                hidden = h
                torch.testing.assert_close(model.compute_logits(hidden)[0], ttt[i][t], rtol=0, atol=1e-4)


def test_future_tokens_and_features_do_not_leak():
    model = make_model(num_hidden_layers=2)
    seq = [10]
    aux, ids, pos = make_row(seq)
    base = model.forward_ttt(aux, ids, pos, seq, 3)
    t = 3
    aux2, ids2 = aux.clone(), ids.clone()
    aux2[t + 1:] += 1.0
    for step in range(3):
        ids2[t + 2 + step:] = (ids[t + 2 + step:] + 1) % V  # everything after the step's input token
        out = model.forward_ttt(aux2, ids2, pos, seq, 3)
        torch.testing.assert_close(out[step][t], base[step][t], rtol=0, atol=1e-6)
        ids2 = ids.clone()
    # while the step's own input token does matter
    ids3 = ids.clone()
    ids3[t + 1 + 2] = (ids[t + 3] + 1) % V
    assert not torch.allclose(model.forward_ttt(aux, ids3, pos, seq, 3)[2][t], base[2][t])


def test_bad_inputs_raise_clear_errors():
    model = make_model()
    aux, ids, pos = make_row([4, 4])
    with pytest.raises(DataError, match="sum to the row length"):
        model.forward_ttt(aux, ids, pos, [4, 3], 2)
    with pytest.raises(DataError, match="width"):
        model.forward_ttt(aux[:, :10], ids, pos, [4, 4], 2)


# Kimi-K2.5's text_config.rope_scaling (DeepSeek-V3 style), which draft.rope_scaling: target copies.
KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("scaling", [KIMI_YARN, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                                     {"rope_type": "linear", "factor": 2.0}])
def test_scaled_rope_matches_what_vllm_builds_from_the_exported_config(scaling):
    """The draft trains with the rotary vLLM builds from its exported config.json (transformers reads
    rope_scaling into rope_parameters, vLLM's get_rope builds the rotary from those), at positions past 8192."""
    from types import SimpleNamespace

    from transformers import LlamaConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from common.model.draft import draft_rope_scaling

    resolved = draft_rope_scaling("target", SimpleNamespace(rope_scaling=scaling))
    max_pos = int(scaling["original_max_position_embeddings"] * scaling["factor"]) if "original_max_position_embeddings" in scaling else 4096
    cfg = make_config(rope_theta=50000.0, rope_scaling=resolved, max_position_embeddings=max_pos)
    exported = LlamaConfig(**cfg.to_vllm_config())
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(exported.head_dim, exported.max_position_embeddings, is_neox_style=True,
                        rope_parameters=exported.rope_parameters, dtype=torch.float32)
    pos = torch.arange(0, min(max_pos, rope.cos_sin_cache.shape[0]), 97)
    assert pos[-1] > 8192 or max_pos <= 8192
    cos, sin = Eagle3DraftModel(cfg).rotary(pos)
    vcos, vsin = rope.cos_sin_cache[pos].float().chunk(2, dim=-1)  # vLLM keeps one half; neox style repeats it
    half = cfg.head_dim // 2
    torch.testing.assert_close(cos[:, :half], vcos, rtol=0, atol=1e-4)
    torch.testing.assert_close(sin[:, :half], vsin, rtol=0, atol=1e-4)
    if scaling is KIMI_YARN:  # mscale == mscale_all_dim: no attention scaling (vLLM and transformers agree)
        assert float(cos[0, 0]) == pytest.approx(1.0)


def test_rope_scaling_from_the_target_and_its_errors():
    from types import SimpleNamespace

    from common.model.draft import draft_rope_scaling

    assert draft_rope_scaling(None, SimpleNamespace(rope_scaling=KIMI_YARN)) is None
    assert draft_rope_scaling("target", SimpleNamespace(rope_scaling=None)) is None  # plain RoPE target
    got = draft_rope_scaling("target", SimpleNamespace(rope_scaling={**KIMI_YARN, "type": "deepseek_yarn"}))
    assert got == {"rope_type": "yarn", **{k: v for k, v in KIMI_YARN.items() if k != "type"}}
    # transformers >= 5 keeps it in rope_parameters, with rope_theta beside it
    params = SimpleNamespace(rope_scaling=None, rope_parameters={"rope_theta": 50000.0, "rope_type": "yarn", "factor": 64.0,
                                                                 "original_max_position_embeddings": 4096})
    assert draft_rope_scaling("target", params) == {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}
    with pytest.raises(ConfigError, match=r"draft.rope_scaling \(yarn\) lacks original_max_position_embeddings"):
        draft_rope_scaling({"rope_type": "yarn", "factor": 8}, None)
    with pytest.raises(ConfigError, match=r"rope_type 'mrope'.*draft.rope_scaling: null"):
        draft_rope_scaling("target", SimpleNamespace(rope_scaling={"rope_type": "mrope", "mrope_section": [1]}))
