"""A stage-04 run folder for an MLA (DeepSeek-V3-shaped) target, for the tests of the MLA draft's memory plan and of
train.init_from with a draft in the published Kimi-K2.5 MLA layout: the target, tokenized data, hidden states (the
real stage-02 code, hf backend) and a vocab map; and a draft folder in that published layout.

    cfg_path = build_mla_run(root, target_dir, draft_vocab_size=VOCAB)      # run config (draft.architecture: MLA)
    write_published_mla_draft(folder, sizes)                                 # config.json + model.safetensors
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import AUX_IDS, VOCAB, base_config, structured_samples, write_yaml

ARCH = "Eagle3DeepseekV2ForCausalLM"
# A tiny MLA target whose v heads (8) are narrower than its q/k heads (24 nope + 8 rope), with a q latent (32) and a
# kv latent (48): every width the planner reads differs from the others.
MLA_TARGET = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=48,
                  qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=128)


def build_mla_target(path: Path, sizes: dict | None = None, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V3 (MLA, a dense layer 0 then MoE), fp32, VOCAB ids, 4 layers."""
    import torch
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, num_hidden_layers=4, max_position_embeddings=512, initializer_range=0.1, moe_intermediate_size=32,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        tie_word_embeddings=False, **{**MLA_TARGET, **(sizes or {})})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # as tests.helpers.make_target: a teacher whose top-1 a draft can learn in a few steps
        model.model.embed_tokens.weight.mul_(10.0)
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path)
    return path


def build_mla_run(root: Path, target: Path, *, draft_vocab_size: int, ids_below: int = VOCAB, n_train: int = 32,
                  n_eval: int = 8, **train) -> Path:
    """root/run: data, hidden states (02's code), vocab map of the target's most frequent top-1 ids; returns the
    config path (draft.architecture the MLA family, train.* from `train`)."""
    import torch
    from safetensors.torch import load_file, save_file

    from common.core.config import load_config
    from common.core.io import write_jsonl_atomic
    from common.extract.stage import run_extraction
    from common.target.loading import load_target_tensors

    run_dir = root / "run"

    def samples(n, seed, prefix):
        return [{**row, "input_ids": [i % ids_below for i in row["input_ids"]]} for row in structured_samples(n, seed, prefix)]

    write_jsonl_atomic(run_dir / "data" / "train.jsonl", samples(n_train, 1, "tr"))
    write_jsonl_atomic(run_dir / "data" / "eval.jsonl", samples(n_eval, 2, "ev"))
    tree = base_config(run_dir, target, **train)
    tree["vocab"] = {"draft_vocab_size": draft_vocab_size}
    tree["draft"] = {"architecture": ARCH}
    cfg_path = write_yaml(root / "run.yaml", tree)
    run_extraction(load_config(cfg_path))
    lm_head = load_target_tensors(str(target), kinds=("lm_head",))["lm_head"].float()
    vocab = lm_head.shape[0]
    counts = torch.zeros(vocab, dtype=torch.long)
    for shard in sorted((run_dir / "hidden").glob("shard-*.safetensors")):
        final = load_file(str(shard))["final_hidden"].float()
        counts += torch.bincount((final @ lm_head.T).argmax(-1), minlength=vocab)
    ids = torch.sort(torch.argsort(-counts, stable=True)[:draft_vocab_size]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    (run_dir / "vocab").mkdir(parents=True, exist_ok=True)
    save_file({"d2t": (ids - torch.arange(draft_vocab_size)).long(), "t2d": t2d}, str(run_dir / "vocab" / "vocab_map.safetensors"))
    return cfg_path


# The published K2.5 MLA draft's rope (Kimi's yarn), in the legacy form its config.json gives
KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
             "mscale": 1.0, "mscale_all_dim": 1.0}


def published_mla_config(sizes: dict) -> dict:
    """config.json in the layout of lightseekorg/kimi-k2.5-eagle3-mla (model_type kimi_k2, full vocab so no d2t,
    num_key_value_heads given, legacy `type: yarn` rope, the aux ids under eagle_config), at `sizes`."""
    s = {"num_hidden_layers": 1, "rope_theta": 50000.0, "rope_scaling": KIMI_YARN, "max_position_embeddings": 262144,
         "rms_norm_eps": 1e-5, "aux_layer_ids": AUX_IDS, **sizes}
    return {"architectures": [ARCH], "model_type": "kimi_k2", "hidden_size": s["hidden_size"],
            "intermediate_size": s["intermediate_size"], "num_attention_heads": s["num_attention_heads"],
            "num_key_value_heads": s["num_attention_heads"], "num_hidden_layers": s["num_hidden_layers"],
            "q_lora_rank": s["q_lora_rank"], "kv_lora_rank": s["kv_lora_rank"], "qk_nope_head_dim": s["qk_nope_head_dim"],
            "qk_rope_head_dim": s["qk_rope_head_dim"], "v_head_dim": s["v_head_dim"], "vocab_size": s["vocab_size"],
            "draft_vocab_size": s["vocab_size"], "hidden_act": "silu", "rms_norm_eps": s["rms_norm_eps"],
            "rope_theta": s["rope_theta"], "rope_scaling": s["rope_scaling"],
            "max_position_embeddings": s["max_position_embeddings"], "target_hidden_size": s["hidden_size"],
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(s["aux_layer_ids"]), "use_aux_hidden_state": True}}


def published_mla_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of the published draft's model.safetensors under vLLM's checkpoint names (no d2t, no t2d, no
    embed_tokens: vLLM shares the target's)."""
    H, nh, q, kv = config["hidden_size"], config["num_attention_heads"], config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v, inter = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"], config["intermediate_size"]
    a = "midlayer.self_attn."
    return {"fc.weight": (H, 3 * config["target_hidden_size"]), f"{a}q_a_proj.weight": (q, 2 * H),
            f"{a}q_a_layernorm.weight": (q,), f"{a}q_b_proj.weight": (nh * (nope + rope), q),
            f"{a}kv_a_proj_with_mqa.weight": (kv + rope, 2 * H), f"{a}kv_a_layernorm.weight": (kv,),
            f"{a}kv_b_proj.weight": (nh * (nope + v), kv), f"{a}o_proj.weight": (H, nh * v),
            "midlayer.mlp.gate_proj.weight": (inter, H), "midlayer.mlp.up_proj.weight": (inter, H),
            "midlayer.mlp.down_proj.weight": (H, inter), "midlayer.input_layernorm.weight": (H,),
            "midlayer.hidden_norm.weight": (H,), "midlayer.post_attention_layernorm.weight": (H,), "norm.weight": (H,),
            "lm_head.weight": (config["draft_vocab_size"], H)}


def write_published_mla_draft(folder: Path, sizes: dict, seed: int = 0) -> Path:
    """A draft folder as the published one is laid out (config.json + model.safetensors, bf16), random weights of
    `sizes` (hidden_size, num_attention_heads, intermediate_size, MLA's sizes, vocab_size)."""
    import torch
    from safetensors.torch import save_file

    config = published_mla_config(sizes)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.ones(shape) + 0.01 * torch.randn(shape, generator=g) if len(shape) == 1
                      else 0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)
               for name, shape in published_mla_tensor_shapes(config).items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
