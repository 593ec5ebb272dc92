"""train.init_from an EAGLE-3.1 draft in a published layout, built here at the tiny target's sizes: the Llama draft as
SpecForge exports it (LlamaForCausalLMEagle3, fc_norm + norm_output at the top of config.json, fc_norm.{i}.weight
beside midlayer.*) and the MLA draft as lightseekorg/kimi-k2.6-eagle3.1-mla is laid out. 04 starts from it with
draft.fc_norm / draft.norm_output set, trains and exports the same tensors and flags. A mismatch (a 3.1 init into an
EAGLE-3 run, or the reverse) is one line before --overwrite deletes anything, unless train.init_norms: convert."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import AUX_IDS, DRAFT_VOCAB, HIDDEN, VOCAB, clone_run, error_line, run_stage

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EAGLE31 = ("--set", "draft.fc_norm=true", "--set", "draft.norm_output=true")
FC_NORM_WEIGHT = 3.0  # the init's fc_norm weights: far from a fresh norm's 1, so a norm not carried over shows


def write_published_llama31_draft(folder: Path, seed: int = 0) -> Path:
    """config.json + model.safetensors (bf16) of an EAGLE-3.1 Llama draft as SpecForge writes one, at the tiny
    target's sizes (tests.helpers.make_target), random weights and a random draft vocab."""
    g = torch.Generator().manual_seed(seed)
    H, I, heads, kv, hd = HIDDEN, 128, 4, 2, HIDDEN // 4
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": 1,
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
              "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": H, "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True},
              "fc_norm": True, "norm_output": True, "torch_dtype": "bfloat16"}
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    shapes = {"fc.weight": (H, 3 * H), **{f"fc_norm.{i}.weight": (H,) for i in range(3)},
              "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
              "midlayer.post_attention_layernorm.weight": (H,), f"{a}q_proj.weight": (heads * hd, 2 * H),
              f"{a}k_proj.weight": (kv * hd, 2 * H), f"{a}v_proj.weight": (kv * hd, 2 * H), f"{a}o_proj.weight": (H, heads * hd),
              f"{m}gate_proj.weight": (I, H), f"{m}up_proj.weight": (I, H), f"{m}down_proj.weight": (H, I),
              "norm.weight": (H,), "lm_head.weight": (DRAFT_VOCAB, H)}
    tensors = {n: (torch.ones(s) + 0.01 * torch.randn(s, generator=g) if len(s) == 1 else 0.05 * torch.randn(s, generator=g))
               for n, s in shapes.items()}
    for i in range(3):
        tensors[f"fc_norm.{i}.weight"] *= FC_NORM_WEIGHT
    tensors = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
    ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    tensors.update(d2t=ids - torch.arange(DRAFT_VOCAB), t2d=t2d)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def files_of(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def flags_of(export: Path) -> dict:
    config = json.loads((export / "config.json").read_text())
    return {k: config.get(k) for k in ("fc_norm", "norm_before_fc", "norm_output")}


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    return write_published_llama31_draft(tmp_path_factory.mktemp("published") / "eagle3.1-llama")


def test_04_trains_from_a_published_eagle31_llama_draft_and_exports_it(tmp_path, hidden_run, published):
    cfg = clone_run(hidden_run, tmp_path, max_steps=2, eval_every=0, checkpoint_every=100, init_from=str(published))
    res = run_stage("04_train.py", cfg, *EAGLE31)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "run" / "train" / "final"
    assert flags_of(out) == {"fc_norm": True, "norm_before_fc": False, "norm_output": True}
    before, after = load_file(str(published / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert {n: tuple(t.shape) for n, t in after.items()} == {n: tuple(t.shape) for n, t in before.items()}
    for name in ("fc_norm.0.weight", "fc_norm.2.weight", "fc.weight", "midlayer.self_attn.q_proj.weight"):
        moved = (after[name].float() - before[name].float()).abs().max()
        assert 0 < moved < 0.2, (name, moved)  # trained on from the init's weights (a fresh fc_norm would be 2 away)
    assert torch.equal(after["d2t"], before["d2t"])  # its own draft vocab (train.init_vocab: own)


def test_a_norm_mismatch_is_refused_in_one_line_before_anything_is_deleted(tmp_path, hidden_run, published):
    """A 3.1 init into an EAGLE-3 run (draft.* left at its defaults), and an EAGLE-3 init into a 3.1 run."""
    import shutil

    cfg = clone_run(hidden_run, tmp_path, max_steps=1, eval_every=0)
    assert run_stage("04_train.py", cfg).returncode == 0  # a finished EAGLE-3 train/ that --overwrite would delete
    train_dir = tmp_path / "run" / "train"
    before = files_of(train_dir)
    eagle3 = Path(shutil.copytree(train_dir / "final", tmp_path / "eagle3-init"))  # the run's own export, copied out
    cases = [(published, (), "is an EAGLE-3.1 (fc_norm, norm_output) draft and this run trains EAGLE-3 (no norm flags); "
                             "set draft.fc_norm: true, draft.norm_output: true to train it as it was trained, or "
                             "train.init_norms: convert to retrain it with draft.*'s norms"),
             (eagle3, EAGLE31, "is an EAGLE-3 (no norm flags) draft and this run trains EAGLE-3.1 (fc_norm, norm_output); "
                               "set draft.fc_norm: false, draft.norm_output: false to train it as it was trained")]
    for init, sets, says in cases:
        res = run_stage("04_train.py", cfg, "--overwrite", "--set", f"train.init_from={init}", *sets)
        error_line(res, f"error: train.init_from {init} {says}")
        assert files_of(train_dir) == before


def test_init_norms_convert_retrains_an_eagle31_draft_as_eagle3(tmp_path, hidden_run, published):
    """train.init_norms: convert: the run's flags (EAGLE-3 here) are trained from the init's weights, its fc_norm
    dropped; the export is an EAGLE-3 draft of the init's other tensors."""
    cfg = clone_run(hidden_run, tmp_path, max_steps=1, lr=1e-12, eval_every=0, init_from=str(published))
    res = run_stage("04_train.py", cfg, "--set", "train.init_norms=convert")
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "run" / "train" / "final"
    assert flags_of(out) == {"fc_norm": False, "norm_before_fc": False, "norm_output": False}
    before, after = load_file(str(published / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(after) == {n for n in before if not n.startswith("fc_norm.")}
    for name, tensor in after.items():  # one step at lr 1e-12: the init's weights
        assert torch.equal(tensor, before[name]), name


def test_the_memory_plan_counts_the_norms_the_run_trains(tmp_path, hidden_run, published):
    """scripts/plan_memory.py's draft config with an init: the init's architecture with draft.*'s norm flags."""
    from common.core.config import load_config
    from common.train.memory_plan import draft_config_from

    cfg = clone_run(hidden_run, tmp_path, init_from=str(published))
    target = {"num_hidden_layers": 4, "hidden_size": HIDDEN, "vocab_size": VOCAB, "num_attention_heads": 4}
    as_31 = draft_config_from(load_config(cfg, ["draft.fc_norm=true", "draft.norm_output=true"]), target)
    as_3 = draft_config_from(load_config(cfg, ["train.init_norms=convert"]), target)
    assert (as_31.fc_norm, as_31.norm_output, as_3.fc_norm, as_3.norm_output) == (True, True, False, False)


# ------------------------------------------------------------------------------------- the published MLA layout


def test_04_trains_from_a_published_eagle31_mla_draft_and_exports_it(tmp_path):
    """lightseekorg/kimi-k2.6-eagle3.1-mla's layout (the K2.5 MLA draft's, plus fc_norm and norm_output) on a tiny MLA
    target: 04 trains from it with the flags set and exports them with fc_norm.{i}.weight."""
    from tests.train.mla_run import (ARCH, MLA_TARGET, build_mla_run, build_mla_target, published_mla_config,
                                     write_published_mla_draft)

    sizes = {**MLA_TARGET, "vocab_size": VOCAB, "aux_layer_ids": AUX_IDS}
    cfg = build_mla_run(tmp_path, build_mla_target(tmp_path / "target"), draft_vocab_size=VOCAB, max_steps=2,
                        eval_every=0, checkpoint_every=100, n_train=8, n_eval=2)
    init = write_published_mla_draft(tmp_path / "kimi-k2.6-eagle3.1-mla", sizes)
    (init / "config.json").write_text(json.dumps({**published_mla_config(sizes), "fc_norm": True, "norm_output": True}))
    tensors = load_file(str(init / "model.safetensors"))
    tensors.update({f"fc_norm.{i}.weight": torch.full((sizes["hidden_size"],), FC_NORM_WEIGHT, dtype=torch.bfloat16)
                    for i in range(3)})
    save_file(tensors, str(init / "model.safetensors"))
    res = run_stage("04_train.py", cfg, "--set", f"train.init_from={init}", *EAGLE31)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "run" / "train" / "final"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCH] and (config["fc_norm"], config["norm_output"]) == (True, True)
    assert "norm_before_fc" not in config  # vLLM's MLA draft reads none
    after = load_file(str(out / "model.safetensors"))
    assert set(after) == set(tensors)
    moved = (after["fc_norm.1.weight"].float() - FC_NORM_WEIGHT).abs().max()
    assert 0 < moved < 0.2, moved
