"""Export to vLLM's official EAGLE-3 format (and the speculators format): names, shapes, dtypes,
config fields, round trip; and (slow, vllm) real vLLM CPU runs with exported drafts."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.model.draft import DraftModelConfig, Eagle3DraftModel
from common.core.errors import DataError
from common.model.export import export_speculators_draft, export_vllm_draft, load_exported_draft
from common.model.ttt import ttt_loss
from tests.helpers import serve_offline

H, H_T, V, V_D = 64, 48, 300, 100


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(layers=1, seed=0, **kw) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    cfg = dict(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               vocab_size=V, draft_vocab_size=V_D, target_hidden_size=H_T, aux_layer_ids=[1, 2, 3],
               num_hidden_layers=layers)
    cfg.update(kw)
    model = Eagle3DraftModel(DraftModelConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    g = torch.Generator().manual_seed(seed)
    used = torch.randperm(V, generator=g)[:V_D].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab_map(used - torch.arange(V_D), t2d)
    model.load_target_embedding(torch.randn(V, H, generator=g))
    return model


def read_safetensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def row(seq):
    g = torch.Generator().manual_seed(3)
    T = sum(seq)
    return (torch.randn(T, 3 * H_T, generator=g), torch.randint(0, V, (T,), generator=g),
            torch.cat([torch.arange(n) for n in seq]))


@pytest.mark.parametrize("layers", [1, 2])
def test_export_writes_official_names_shapes_dtypes_and_config(tmp_path, layers):
    model = make_model(layers)
    out = export_vllm_draft(model, tmp_path / "draft", extra_config={"bos_token_id": 1})
    assert out == tmp_path / "draft"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors = read_safetensors(out / "model.safetensors")
    expected = {
        "fc.weight": (H, 3 * H_T),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (64, 2 * H),
        "midlayer.self_attn.k_proj.weight": (32, 2 * H),
        "midlayer.self_attn.v_proj.weight": (32, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, 64),
        "midlayer.mlp.gate_proj.weight": (96, H),
        "midlayer.mlp.up_proj.weight": (96, H),
        "midlayer.mlp.down_proj.weight": (H, 96),
        "norm.weight": (H,),
        "lm_head.weight": (V_D, H),
        "d2t": (V_D,),
        "t2d": (V,),
    }
    if layers == 2:
        expected.update({
            "layers.1.input_layernorm.weight": (H,),
            "layers.1.post_attention_layernorm.weight": (H,),
            "layers.1.self_attn.q_proj.weight": (64, H),
            "layers.1.self_attn.k_proj.weight": (32, H),
            "layers.1.self_attn.v_proj.weight": (32, H),
            "layers.1.self_attn.o_proj.weight": (H, 64),
            "layers.1.mlp.gate_proj.weight": (96, H),
            "layers.1.mlp.up_proj.weight": (96, H),
            "layers.1.mlp.down_proj.weight": (H, 96),
        })
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k not in ("d2t", "t2d"))
    assert torch.equal(tensors["d2t"], model.d2t) and torch.equal(tensors["t2d"], model.t2d)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == layers and config["draft_vocab_size"] == V_D and config["vocab_size"] == V
    assert config["target_hidden_size"] == H_T and config["hidden_size"] == H and config["head_dim"] == 16
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["norm_before_residual"] is False and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "bfloat16" and config["bos_token_id"] == 1
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None


def test_round_trip_gives_identical_logits_and_overwrites_atomically(tmp_path):
    model = make_model(2)
    seq = [7, 5]
    aux, ids, pos = row(seq)
    with torch.no_grad():
        want = model.forward_ttt(aux, ids, pos, seq, 3)
    out = export_vllm_draft(model, tmp_path / "draft", dtype=torch.float32)
    loaded = load_exported_draft(out, embedding=model.embed_tokens.weight)
    assert loaded.config == model.config
    with torch.no_grad():
        got = loaded.forward_ttt(aux, ids, pos, seq, 3)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # bf16 export == the model rounded to bf16
    out = export_vllm_draft(model, tmp_path / "draft")  # overwrite in place
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp / old dirs left behind
    loaded = load_exported_draft(out, dtype=torch.bfloat16, embedding=model.embed_tokens.weight)
    rounded = model.to(torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(loaded.forward_ttt(aux, ids, pos, seq, 3), rounded.forward_ttt(aux, ids, pos, seq, 3)):
            assert torch.equal(a, b)
    # embedding only on request
    out = export_vllm_draft(model, tmp_path / "with-embed", include_embedding=True)
    assert "embed_tokens.weight" in read_safetensors(out / "model.safetensors")
    assert torch.equal(load_exported_draft(out, dtype=torch.bfloat16).embed_tokens.weight, model.embed_tokens.weight)


def test_failed_export_leaves_previous_export_intact(tmp_path, monkeypatch):
    model = make_model()
    out = export_vllm_draft(model, tmp_path / "draft")
    before = (out / "model.safetensors").read_bytes()
    import common.model.export as export_mod

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_mod, "_safetensors_writer", lambda *a, **k: boom)
    with pytest.raises(RuntimeError, match="disk full"):
        export_vllm_draft(make_model(seed=1), out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_full_vocab_export_has_no_vocab_map_and_round_trips(tmp_path):
    """draft_vocab_size = target vocab: no d2t/t2d in the file (vLLM 0.32 would route d2t to a
    draft_id_to_target_id it never built); loading gives back the identity map and the same logits."""
    torch.manual_seed(0)
    model = Eagle3DraftModel(DraftModelConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=16, vocab_size=V, draft_vocab_size=V,
                                              target_hidden_size=H_T, aux_layer_ids=[1, 2, 3]))
    model.load_target_embedding(torch.randn(V, H))
    model.set_vocab_map(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    out = export_vllm_draft(model, tmp_path / "draft", dtype=torch.float32)
    tensors = read_safetensors(out / "model.safetensors")
    assert "d2t" not in tensors and "t2d" not in tensors
    assert tensors["lm_head.weight"].shape == (V, H)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == V
    back = load_exported_draft(out, embedding=model.embed_tokens.weight.detach())
    assert torch.equal(back.d2t, torch.zeros(V, dtype=torch.long)) and bool(back.t2d.all())
    aux, ids, pos = row([7, 5])
    with torch.no_grad():
        for a, b in zip(model.forward_ttt(aux, ids, pos, [7, 5], 2), back.forward_ttt(aux, ids, pos, [7, 5], 2)):
            torch.testing.assert_close(a, b)
    # speculators format: the same rule
    spec = export_speculators_draft(model, tmp_path / "spec", "target", 3)
    assert not {"d2t", "t2d"} & set(read_safetensors(spec / "model.safetensors"))
    # a full vocab in another order cannot be expressed without d2t: a clear error, no export
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    model.set_vocab_map(perm - torch.arange(V), torch.ones(V, dtype=torch.bool))
    with pytest.raises(DataError, match="reorders it"):
        export_vllm_draft(model, tmp_path / "reordered")
    assert not (tmp_path / "reordered").exists()
    # a smaller draft vocab keeps both tensors
    assert {"d2t", "t2d"} <= set(read_safetensors(export_vllm_draft(make_model(), tmp_path / "small") / "model.safetensors"))


def test_load_rejects_mismatched_files(tmp_path):
    out = export_vllm_draft(make_model(), tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    config["intermediate_size"] = 128
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match="does not match"):
        load_exported_draft(out)
    with pytest.raises(DataError, match="missing"):
        load_exported_draft(tmp_path / "nowhere")


def test_speculators_export(tmp_path):
    model = make_model(2)
    out = export_speculators_draft(model, tmp_path / "spec", verifier_name_or_path="/models/target",
                                   speculative_tokens=3)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "model_type" not in config
    assert config["norm_before_residual"] is False  # written explicitly: vLLM defaults to True here
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/target"
    assert config["transformer_layer_config"]["vocab_size"] == V
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tensors = read_safetensors(out / "model.safetensors")
    assert "layers.0.self_attn.q_proj.weight" in tensors and "layers.1.self_attn.q_proj.weight" in tensors
    assert not any(k.startswith("midlayer.") for k in tensors)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (64, 2 * H)
    assert "embed_tokens.weight" in tensors
    loaded = load_exported_draft(out, dtype=torch.bfloat16)
    assert loaded.config == model.config
    seq = [6]
    aux, ids, pos = row(seq)
    rounded = make_model(2).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded.forward_ttt(aux, ids, pos, seq, 2)[1], rounded.forward_ttt(aux, ids, pos, seq, 2)[1])


def test_speculators_config_is_understood_by_vllm(tmp_path):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    out = export_speculators_draft(make_model(), tmp_path / "spec", verifier_name_or_path="/models/target",
                                   speculative_tokens=4)
    d = json.loads((out / "config.json").read_text())
    assert SpeculatorsConfig.extract_vllm_speculative_config(d) == {"method": "eagle3", "num_speculative_tokens": 4}
    cfg = SpeculatorsConfig.from_pretrained(str(out))
    assert cfg.architectures == ["Eagle3LlamaForCausalLM"]
    assert cfg.norm_before_residual is False and cfg.draft_vocab_size == V_D
    assert list(cfg.eagle_aux_hidden_state_layer_ids) == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# A hand-built target/draft pair whose draft is exact, for checking vLLM end to end
# ---------------------------------------------------------------------------------------------

TV = 128  # target vocab = target hidden size, so token embeddings can be one-hot
CHAIN = 64  # size of S, the random token subset the chain lives on (= the draft vocab)


def chain_setup():
    """Target: a Llama whose layers add nothing (o_proj = down_proj = 0) and whose lm_head maps token
    x to pi(x): its greedy continuation is x, pi(x), pi(pi(x)), ... The draft vocab S (64 tokens,
    non-trivial d2t) is closed under pi."""
    g = torch.Generator().manual_seed(11)
    S = torch.randperm(TV, generator=g)[:CHAIN].sort().values
    others = torch.tensor(sorted(set(range(TV)) - set(S.tolist())))
    pi = torch.empty(TV, dtype=torch.long)
    pi[S] = S[torch.randperm(CHAIN, generator=g)]
    pi[others] = others[torch.randperm(TV - CHAIN, generator=g)]
    return S, pi


def build_chain_target(out_dir: Path, S, pi, random_layers: bool = False):
    """A tiny Llama target + word-level tokenizer in out_dir. random_layers=True keeps the random
    layers (a generic random target with a peaked lm_head) instead of the exact pi-chain target."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=TV, hidden_size=TV, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1,
                         pad_token_id=2)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        if random_layers:
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.2)
            model.lm_head.weight.normal_(0, 1.0)  # peaked logits: greedy is robust to numerics
        else:
            model.model.embed_tokens.weight.copy_(torch.eye(TV))
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            lm = torch.zeros(TV, TV)
            lm[pi, torch.arange(TV)] = 1.0  # logit of pi(x) is the only non-zero one
            model.lm_head.weight.copy_(lm)
    model.save_pretrained(out_dir, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(TV)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1", pad_token="w2").save_pretrained(out_dir)
    return model


def build_chain_draft(S, pi) -> Eagle3DraftModel:
    """A draft that is exact on the pi-chain: its attention copies the current input token (q.k is large
    only between equal tokens) and o_proj maps it to pi(token). RoPE is made negligible by putting q/k in
    the slowest-rotating dimensions of a head with rope_theta 1e30. fc = 0, and norm_before_residual with
    a tiny hidden_norm keeps the recurrent hidden a small residual."""
    d = TV  # one head of dim 128
    cfg = DraftModelConfig(hidden_size=TV, intermediate_size=64, num_attention_heads=1, num_key_value_heads=1,
                           head_dim=d, vocab_size=TV, draft_vocab_size=CHAIN, target_hidden_size=TV,
                           aux_layer_ids=[1, 2, 3], rms_norm_eps=1e-6, norm_before_residual=True,
                           rope_theta=1e30, max_position_embeddings=512)
    model = Eagle3DraftModel(cfg)
    d2t = S - torch.arange(CHAIN)
    t2d = torch.zeros(TV, dtype=torch.bool)
    t2d[S] = True
    model.set_vocab_map(d2t, t2d)
    model.load_target_embedding(torch.eye(TV))
    # rotate_half pairs dim j with j + d/2 at frequency theta^(-2j/d): j in [32, 64) is below 1e-15 rad/position
    slow = torch.cat([torch.arange(32, 64), torch.arange(96, 128)])
    qk = torch.zeros(d, TV)  # token S_j (normed embedding sqrt(TV) e_x) -> unit vector on slow dim j
    qk[slow, S] = 1.0 / math.sqrt(TV)
    v = torch.zeros(d, TV)  # token S_j -> unit vector on dim j
    v[torch.arange(CHAIN), S] = 1.0 / math.sqrt(TV)
    layer = model.midlayer
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        layer.hidden_norm.weight.fill_(0.01)
        model.norm.weight.fill_(1.0)
        a = layer.self_attn
        a.q_proj.weight[:, :TV] = 340.0 * qk  # score = 340 / sqrt(128) = 30 for equal tokens, 0 otherwise
        a.k_proj.weight[:, :TV] = qk
        a.v_proj.weight[:, :TV] = v
        o = torch.zeros(TV, d)
        o[pi[S], torch.arange(CHAIN)] = 1.0  # value of token y -> e_{pi(y)}
        a.o_proj.weight.copy_(o)
        lm = torch.zeros(CHAIN, TV)
        lm[torch.arange(CHAIN), S] = 10.0
        model.lm_head.weight.copy_(lm)
        # the MLP runs but adds nothing (down_proj = 0)
        layer.mlp.gate_proj.weight.normal_(0, 0.1)
        layer.mlp.up_proj.weight.normal_(0, 0.1)
    return model


def chain_sequence(S, pi, start_index: int, length: int) -> list[int]:
    x = [int(S[start_index])]
    while len(x) < length:
        x.append(int(pi[x[-1]]))
    return x


def test_chain_draft_is_exact_offline():
    """The hand-built draft predicts the target's greedy token at every TTT step (accuracy 1.0), so a
    vLLM run with the exported draft must accept every drafted token."""
    S, pi = chain_setup()
    draft = build_chain_draft(S, pi)
    seq = [20, 13]
    ids = torch.tensor(chain_sequence(S, pi, 3, 20) + chain_sequence(S, pi, 40, 13))
    aux = torch.eye(TV)[ids].repeat(1, 3)  # the target's residual stream is just the embedding
    final = torch.eye(TV)[ids] * math.sqrt(TV)  # after the final norm
    lm_head = torch.zeros(TV, TV)
    lm_head[pi, torch.arange(TV)] = 1.0
    with torch.no_grad():
        out = ttt_loss(draft, aux, ids, final, torch.ones(33, dtype=torch.uint8),
                       torch.cat([torch.arange(20), torch.arange(13)]), seq, lm_head, ttt_steps=4, decay=1.0)
    assert out.step_counts == [18 + 11, 17 + 10, 16 + 9, 15 + 8]
    assert out.step_correct == out.step_counts


# ---------------------------------------------------------------------------------------------
# vLLM (slow): the exported drafts load and run in vLLM's CPU build
# ---------------------------------------------------------------------------------------------

def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def run_vllm(tmp_path, target_dir, draft_dir, prompts, k=3):
    t0 = time.time()
    result, log = serve_offline(tmp_path, target_dir, draft_dir, prompts, k=k)
    print(f"vLLM run took {time.time() - t0:.0f}s")
    return result, log


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loads_exported_random_draft_and_output_is_lossless(tmp_path):
    """A random 2-layer draft (layers.1.* names) with a non-trivial d2t, exported in the official format,
    loads in vLLM next to a random tiny Llama target; greedy output equals the target alone (HF)."""
    pytest.importorskip("vllm")
    S, pi = chain_setup()
    target = build_chain_target(tmp_path / "target", S, pi, random_layers=True)
    draft = make_model_for_target(layers=2)
    export_vllm_draft(draft, tmp_path / "draft")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TV, (n,), generator=g).tolist() for n in (5, 9, 14, 7)]
    result, log = run_vllm(tmp_path, tmp_path / "target", tmp_path / "draft", prompts)
    assert "Using auxiliary layers from speculative config: (1, 2, 3)" in log
    want = [hf_greedy(target, p, 24) for p in prompts]
    assert result["tokens"] == want
    metrics = result["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"] == 3 * metrics["vllm:spec_decode_num_drafts"]


def make_model_for_target(layers: int, full_vocab: bool = False) -> Eagle3DraftModel:
    S, _ = chain_setup()
    torch.manual_seed(1)
    cfg = DraftModelConfig(hidden_size=TV, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, vocab_size=TV, draft_vocab_size=TV if full_vocab else CHAIN, target_hidden_size=TV,
                           aux_layer_ids=[1, 2, 3], num_hidden_layers=layers, rms_norm_eps=1e-6)
    model = Eagle3DraftModel(cfg)
    if not full_vocab:
        t2d = torch.zeros(TV, dtype=torch.bool)
        t2d[S] = True
        model.set_vocab_map(S - torch.arange(CHAIN), t2d)
    return model


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loads_and_serves_a_full_vocab_draft(tmp_path):
    """draft_vocab_size = target vocab (like the published Kimi-K2.5 draft): the export has no d2t/t2d,
    vLLM loads it (an export with d2t would fail: vLLM builds no draft_id_to_target_id for a full
    vocab), drafts with it, and greedy output equals the target alone."""
    pytest.importorskip("vllm")
    S, pi = chain_setup()
    target = build_chain_target(tmp_path / "target", S, pi, random_layers=True)
    export_vllm_draft(make_model_for_target(layers=1, full_vocab=True), tmp_path / "draft")
    assert not {"d2t", "t2d"} & set(read_safetensors(tmp_path / "draft" / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TV, (n,), generator=g).tolist() for n in (5, 9, 14, 7)]
    result, log = run_vllm(tmp_path, tmp_path / "target", tmp_path / "draft", prompts)
    assert result["tokens"] == [hf_greedy(target, p, 24) for p in prompts]
    metrics = result["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"] == 3 * metrics["vllm:spec_decode_num_drafts"]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_accepts_every_token_of_the_exact_chain_draft(tmp_path):
    """The hand-built exact draft (offline accuracy 1.0 at every TTT step) exported in the official format:
    vLLM accepts every drafted token at every position, so vLLM runs the draft exactly as we train it:
    embedding-first concat, q/k/v/o names, norm_before_residual, lm_head and d2t."""
    pytest.importorskip("vllm")
    S, pi = chain_setup()
    build_chain_target(tmp_path / "target", S, pi)
    export_vllm_draft(build_chain_draft(S, pi), tmp_path / "draft", dtype=torch.float32)
    prompts = [chain_sequence(S, pi, i, n) for i, n in ((0, 4), (17, 9), (33, 6), (50, 12))]
    result, log = run_vllm(tmp_path, tmp_path / "target", tmp_path / "draft", prompts)
    want = [chain_sequence(S, pi, int((S == p[-1]).nonzero()), 25)[1:] for p in prompts]
    assert result["tokens"] == want
    m = result["metrics"]
    drafts = m["vllm:spec_decode_num_drafts"]
    assert drafts > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"] == 3 * drafts
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos"] == [drafts] * 3
