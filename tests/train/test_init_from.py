"""train.init_from, train.init_vocab and train.anchor_weight (common/train/init_from.py): 04 starts from an
exported draft (its weights really loaded, resume and export as for a fresh draft), carries lm_head rows
over onto another vocab map, anchors the weights to the init's (L2-SP), and refuses a draft of another
target in one line before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import DRAFT_VOCAB, HIDDEN, VOCAB, clone_run, error_line, read_metrics, run_stage

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train(cfg_path: Path, *overrides: str) -> Path:
    """04 in this process on the config (with --set overrides); returns its run_dir."""
    from common.core.config import load_config
    from common.train.trainer import run_training

    cfg = load_config(cfg_path, list(overrides))
    assert run_training(cfg) == 0
    return Path(cfg.run_dir)


def weights(run_dir: Path, sub: str = "final") -> dict:
    return load_file(str(run_dir / "train" / sub / "model.safetensors"))


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory, hidden_run) -> Path:
    """The draft a 40-step 04 run exported (train/final): the init of the tests below."""
    root = tmp_path_factory.mktemp("init")
    run_dir = train(clone_run(hidden_run, root, max_steps=40, eval_every=0, checkpoint_every=40))
    return run_dir / "train" / "final"


def eval_loss_of_export(draft_dir: Path, cfg_path: Path) -> float:
    """The eval-split loss of an exported draft, by 04's own step and offline eval (fp32, CPU)."""
    from common.core.config import load_config
    from common.train.offline_eval import evaluate_export

    return evaluate_export(draft_dir, load_config(cfg_path))["loss"]


# ============================================================================ own vocab: loaded, trained on, resumed


def test_init_from_loads_the_draft_trains_on_resumes_and_exports(tmp_path, hidden_run, init_dir, capsys):
    from common.model.export import load_exported_draft

    # one step at a learning rate far below fp32's resolution: the weights stay the init's, so the eval after
    # it is the exported draft's eval (the weights really were loaded: a random draft's loss is far higher)
    cfg = clone_run(hidden_run, tmp_path / "b", max_steps=1, lr=1e-12, eval_every=1, init_from=str(init_dir))
    run_dir = train(cfg)
    out = capsys.readouterr().out
    assert (f"init_from {init_dir}: its own draft vocab kept ({DRAFT_VOCAB} tokens, its d2t; vocab/vocab_map.safetensors "
            f"is not used, {DRAFT_VOCAB} of its tokens are in it); all {DRAFT_VOCAB} lm_head rows carried over") in out
    step1 = [r for r in read_metrics(run_dir) if r["type"] == "eval"][0]
    want = eval_loss_of_export(init_dir, cfg)
    assert step1["loss"] == pytest.approx(want, rel=1e-6)
    scratch = train(clone_run(hidden_run, tmp_path / "scratch", max_steps=1, lr=1e-12, eval_every=1))
    scratch_loss = [r for r in read_metrics(scratch) if r["type"] == "eval"][0]["loss"]
    assert scratch_loss > 1.2 * want
    summary = json.loads((run_dir / "train" / "final" / "training_summary.json").read_text())
    assert summary["init_from"]["path"] == str(init_dir) and summary["init_from"]["vocab"] == "own"

    # training goes on (with the anchor, re-read from the init on resume); a resume takes the checkpoint, not the
    # init: the final equals an uninterrupted run's bit for bit
    cfg = clone_run(hidden_run, tmp_path / "c", max_steps=6, checkpoint_every=3, keep_checkpoints=3, eval_every=0,
                    init_from=str(init_dir), anchor_weight=1e-3)
    run_dir = train(cfg)
    final = (run_dir / "train" / "final" / "model.safetensors").read_bytes()
    shutil.rmtree(run_dir / "train" / "final")
    shutil.rmtree(run_dir / "train" / "checkpoints" / "step-6")
    train(cfg)
    assert "resuming from" in capsys.readouterr().out
    assert (run_dir / "train" / "final" / "model.safetensors").read_bytes() == final
    rows = [r for r in read_metrics(run_dir) if r["type"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[0]["anchor_loss"] == 0.0 and all(r["anchor_loss"] > 0 for r in rows[1:])
    trained, init = weights(run_dir), load_file(str(init_dir / "model.safetensors"))
    assert not torch.equal(trained["fc.weight"], init["fc.weight"])
    # the export: the init's architecture and vocab, loadable
    assert json.loads((run_dir / "train" / "final" / "config.json").read_text())["hidden_size"] == HIDDEN
    assert torch.equal(trained["d2t"], init["d2t"])
    load_exported_draft(run_dir / "train" / "final")


def test_overwrite_continues_from_the_runs_own_final(tmp_path, hidden_run, init_dir):
    """train.init_from: RUN/train/final with --overwrite ("continue from my last draft"): the init is read whole
    before --overwrite deletes train/, and the run trains from it exactly as from a copy kept elsewhere."""
    from common.core.config import load_config
    from common.train.trainer import run_training

    cfg = clone_run(hidden_run, tmp_path / "a", max_steps=3, eval_every=0, checkpoint_every=3)
    run_dir = tmp_path / "a" / "run"
    shutil.copytree(init_dir.parent, run_dir / "train")  # the 40-step run's train/: final, checkpoints, metrics
    own = run_dir / "train" / "final"
    assert run_training(load_config(cfg, [f"train.init_from={own}"]), overwrite=True) == 0
    elsewhere = train(clone_run(hidden_run, tmp_path / "b", max_steps=3, eval_every=0, checkpoint_every=3,
                                init_from=str(init_dir)))
    assert (own / "model.safetensors").read_bytes() == (elsewhere / "train" / "final" / "model.safetensors").read_bytes()
    assert not torch.equal(weights(run_dir)["fc.weight"], load_file(str(init_dir / "model.safetensors"))["fc.weight"])
    assert sorted(p.name for p in (run_dir / "train" / "checkpoints").iterdir()) == ["step-3"]  # the old run's are gone
    assert [r["step"] for r in read_metrics(run_dir) if r["type"] == "train"] == [1, 2, 3]
    summary = json.loads((own / "training_summary.json").read_text())
    assert summary["step"] == 3 and summary["init_from"]["fingerprint"] == json.loads(
        (elsewhere / "train" / "final" / "training_summary.json").read_text())["init_from"]["fingerprint"]


def test_the_speculators_format_in_several_files_and_a_draft_without_d2t(tmp_path, hidden_run, init_dir, capsys):
    """Published drafts come in the speculators format (layers.0., the target's embed_tokens included), sometimes in
    several safetensors, sometimes without d2t (vLLM then maps draft id i to target id i): each loads as vLLM reads
    it; an embed_tokens other than this target's is another target's draft."""
    from common.core.config import load_config
    from common.core.errors import ConfigError
    from common.model.export import export_speculators_draft, load_exported_draft
    from common.target.loading import load_target_tensors

    cfg = clone_run(hidden_run, tmp_path / "run", max_steps=1, lr=1e-12, eval_every=0)
    embed = load_target_tensors(load_config(cfg).target.model)["embed"].float()
    spec = export_speculators_draft(load_exported_draft(init_dir, embedding=embed), tmp_path / "spec", "tiny", 3)
    tensors = load_file(str(spec / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in tensors and "embed_tokens.weight" in tensors
    names = sorted(tensors)
    (spec / "model.safetensors").unlink()
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        save_file({n: tensors[n] for n in part}, str(spec / f"model-0000{i + 1}-of-00002.safetensors"))
    trained, init = weights(train(cfg, f"train.init_from={spec}")), load_file(str(init_dir / "model.safetensors"))
    assert trained.keys() == init.keys()
    for name, tensor in init.items():  # one step at lr 1e-12: the init's weights, exported again in bf16
        assert torch.equal(trained[name], tensor), name

    other = dict(tensors, **{"embed_tokens.weight": tensors["embed_tokens.weight"] * 2})
    save_file({n: other[n] for n in names}, str(spec / "model-00001-of-00002.safetensors"))
    (spec / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="its embed_tokens differ from target.model's embedding"):
        train(cfg, f"train.init_from={spec}")

    no_map = tmp_path / "no-d2t"
    shutil.copytree(init_dir, no_map)
    save_file({k: v for k, v in init.items() if k not in ("d2t", "t2d")}, str(no_map / "model.safetensors"))
    cfg = clone_run(hidden_run, tmp_path / "run-no-d2t", max_steps=1, lr=1e-12, eval_every=0, init_from=str(no_map))
    capsys.readouterr()
    trained = weights(train(cfg))
    assert f"no d2t: target ids 0..{DRAFT_VOCAB - 1}, as vLLM reads it" in capsys.readouterr().out
    assert not trained["d2t"].any() and torch.equal(trained["lm_head.weight"], init["lm_head.weight"])


# ============================================================================ remap onto another vocab map


def test_remap_carries_the_rows_of_the_shared_tokens(tmp_path, hidden_run, init_dir, capsys):
    """03's map (here: half the init's tokens, half others): remap keeps it and carries the init's lm_head rows of the
    tokens both hold; the others start as train.init_lm_head says (the target's rows). own keeps the init's map."""
    from common.core.config import load_config
    from common.target.loading import load_target_tensors

    init = load_file(str(init_dir / "model.safetensors"))
    init_ids = torch.arange(DRAFT_VOCAB) + init["d2t"]
    others = torch.tensor([i for i in range(VOCAB) if i not in set(init_ids.tolist())])
    ids = torch.cat([init_ids[::2], others[: DRAFT_VOCAB // 2]]).sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    runs, outs = {}, {}
    for mode in ("remap", "own"):
        cfg = clone_run(hidden_run, tmp_path / mode, max_steps=1, lr=1e-12, eval_every=0, init_from=str(init_dir),
                        init_vocab=mode, init_lm_head="target")
        save_file({"d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": t2d}, str(tmp_path / mode / "run" / "vocab" / "vocab_map.safetensors"))
        runs[mode] = weights(train(cfg))
        outs[mode] = capsys.readouterr().out
    remap, shared = runs["remap"], DRAFT_VOCAB // 2
    assert f"remapped onto 03's draft vocab ({DRAFT_VOCAB} tokens): {shared} lm_head rows carried over" in outs["remap"]
    assert torch.equal(torch.arange(DRAFT_VOCAB) + remap["d2t"], ids)
    carried = t2d[init_ids]  # the init's rows whose token is in 03's map
    row_of = {int(tid): i for i, tid in enumerate(ids)}
    ours = torch.tensor([row_of[int(tid)] for tid in init_ids[carried]])
    assert int(carried.sum()) == shared
    assert torch.equal(remap["lm_head.weight"][ours], init["lm_head.weight"][carried])  # bf16 both: exact
    fresh = torch.ones(DRAFT_VOCAB, dtype=torch.bool)
    fresh[ours] = False
    target_rows = load_target_tensors(load_config(cfg).target.model)["lm_head"]
    assert torch.equal(remap["lm_head.weight"][fresh], target_rows[ids[fresh]].to(torch.bfloat16))
    # own: the init's map and rows, whatever 03 chose
    assert torch.equal(runs["own"]["d2t"], init["d2t"]) and torch.equal(runs["own"]["lm_head.weight"], init["lm_head.weight"])
    assert f"{shared} of its tokens are in it" in outs["own"]


# ============================================================================ the anchor (L2-SP)


def test_the_anchor_gradient_is_added_once_per_step_whatever_the_micro_batches():
    """With only stand-in micro-batches (loss weight 0) the gradient is the anchor's alone: 2 lambda (w - w_init),
    the same for one micro-batch or three; the penalty is lambda * sum((w - w_init)^2)."""
    from common.train.step import StepLoss, StepSettings, TrainStep
    from tests.train.test_step import setup

    lam = 0.25
    for count in (1, 3):
        model, mb, lm_head = setup(layers=1)
        settings = StepSettings(ttt_steps=2, loss_decay=0.8, grad_clip=0.0, anchor_weight=lam)
        step = TrainStep(StepLoss(model, lm_head, settings), lambda m: torch.optim.SGD(m.trainable_parameters(), lr=0.0))
        init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        step.set_anchor()
        with torch.no_grad():
            for p in model.trainable_parameters():
                p.add_(torch.randn_like(p) * 0.1)
        result = step.run([(mb, False)] * count, count, denominator=None)
        want = 0.0
        for name, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, 2 * lam * (p.detach() - init[name]), rtol=0, atol=1e-7, msg=name)
                want += lam * float((p.detach() - init[name]).double().square().sum())
        assert result.applied and result.anchor_loss == pytest.approx(want, rel=1e-5)


def test_a_strong_anchor_keeps_the_weights_near_the_init_and_a_zero_one_changes_nothing(tmp_path, hidden_run, init_dir):
    init = load_file(str(init_dir / "model.safetensors"))

    def drift(w: dict) -> float:
        return sum(float((w[k].float() - init[k].float()).square().sum()) for k in init if k not in ("d2t", "t2d")) ** 0.5

    kw = dict(max_steps=10, eval_every=0, checkpoint_every=10, init_from=str(init_dir))
    free = train(clone_run(hidden_run, tmp_path / "free", **kw))
    zero = train(clone_run(hidden_run, tmp_path / "zero", anchor_weight=0.0, **kw))
    anchored = train(clone_run(hidden_run, tmp_path / "anchored", anchor_weight=10.0, **kw))
    assert (zero / "train" / "final" / "model.safetensors").read_bytes() == \
        (free / "train" / "final" / "model.safetensors").read_bytes()
    assert "anchor_loss" not in read_metrics(zero)[0]
    print(f"L2 drift from the init: free {drift(weights(free)):.4f}, anchored {drift(weights(anchored)):.4f}")
    assert drift(weights(anchored)) < 0.5 * drift(weights(free))


# ============================================================================ refusals


def bad_draft(path: Path, **changes) -> Path:
    """A random draft exported like 04's, of a target that differs from the tiny one in `changes`."""
    from common.model.draft import DraftModelConfig, Eagle3DraftModel
    from common.model.export import export_vllm_draft

    sizes = dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=HIDDEN, aux_layer_ids=[1, 2, 3])
    return export_vllm_draft(Eagle3DraftModel(DraftModelConfig(**{**sizes, **changes})), path)


@pytest.mark.slow  # ~30 s: five 04 processes
def test_a_draft_of_another_target_is_refused_in_one_line_before_anything_is_written(tmp_path, hidden_run):
    cfg = clone_run(hidden_run, tmp_path, max_steps=1, eval_every=0)
    assert run_stage("04_train.py", cfg).returncode == 0
    train_dir = tmp_path / "run" / "train"
    before = {p: p.read_bytes() for p in sorted(train_dir.rglob("*")) if p.is_file()}
    cases = {
        "target-hidden": ({"target_hidden_size": 32}, "it reads target hidden states of size 32, this target's are 64"),
        "vocab": ({"vocab_size": 512}, f"its vocab_size is 512, this target's vocab is {VOCAB}"),
        "aux": ({"aux_layer_ids": [0, 1, 3]}, "it reads aux layers [0, 1, 3], hidden/ holds layers [1, 2, 3]"),
    }
    for name, (changes, says) in cases.items():
        draft = bad_draft(tmp_path / name, **changes)
        res = run_stage("04_train.py", cfg, "--overwrite", "--set", f"train.init_from={draft}")
        error_line(res, f"train.init_from {draft} does not fit this run: {says}", "use a draft trained for this target")
        assert {p: p.read_bytes() for p in sorted(train_dir.rglob("*")) if p.is_file()} == before, name
    # a resume from another init is refused as any other change of inputs
    res = run_stage("04_train.py", cfg, "--set", f"train.init_from={bad_draft(tmp_path / 'same', num_hidden_layers=1)}")
    error_line(res, "train.init_from is new", "--overwrite")


def test_config_conflicts_are_one_line_errors(tmp_path, hidden_run, init_dir):
    """A draft.* key that disagrees with the init, an anchor without an init."""
    from common.core.config import load_config
    from common.core.errors import ConfigError
    from common.train.trainer import run_training

    cfg = clone_run(hidden_run, tmp_path, max_steps=1, init_from=str(init_dir))
    with pytest.raises(ConfigError, match=r"draft.num_hidden_layers=2 but the init has 1 \(leave draft.\* unset"):
        run_training(load_config(cfg, ["draft.num_hidden_layers=2"]))
    assert not (tmp_path / "run" / "train").exists()
    with pytest.raises(ConfigError, match="train.anchor_weight=0.1 pulls the weights towards train.init_from's, but "
                                          "train.init_from is null"):
        load_config(cfg, ["train.init_from=null", "train.anchor_weight=0.1"])
    with pytest.raises(ConfigError, match=f"train.init_from {tmp_path} is not a draft directory"):
        run_training(load_config(cfg, [f"train.init_from={tmp_path}"]))


def test_an_init_with_nan_weights_is_refused_before_overwrite_deletes(tmp_path, hidden_run, init_dir):
    """A diverged init (NaN in a weight) is one error line naming it and the tensor, before --overwrite deletes
    train/: not a "training diverged" of this run after it."""
    cfg = clone_run(hidden_run, tmp_path, max_steps=1, eval_every=0)
    train_dir = tmp_path / "run" / "train"
    shutil.copytree(init_dir.parent, train_dir)
    before = {p: p.read_bytes() for p in sorted(train_dir.rglob("*")) if p.is_file()}
    bad = shutil.copytree(init_dir, tmp_path / "diverged")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["fc.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), 0.0])
    save_file(tensors, str(bad / "model.safetensors"))
    res = run_stage("04_train.py", cfg, "--overwrite", "--set", f"train.init_from={bad}")
    error_line(res, f"train.init_from {bad}: its tensor fc.weight holds 2 NaN or inf values;", "set train.init_from: null")
    assert "diverged at step" not in res.stdout + res.stderr
    assert {p: p.read_bytes() for p in sorted(train_dir.rglob("*")) if p.is_file()} == before


def test_the_memory_plan_counts_the_anchor_copy_and_the_init_architecture(tmp_path, hidden_run):
    """The init's copy is 4 bytes per trainable parameter (FSDP: per shard); scripts/plan_memory.py plans the
    init's architecture, in the vocab of train.init_vocab."""
    import math

    from common.core.config import load_config
    from common.train.memory_plan import draft_config_from, plan_memory, target_sizes_from_config_json, trainable_params

    init = bad_draft(tmp_path / "init", num_hidden_layers=2, intermediate_size=96, draft_vocab_size=64)
    cfg = load_config(clone_run(hidden_run, tmp_path, init_from=str(init)))
    target = target_sizes_from_config_json(cfg.target.model)
    d = draft_config_from(cfg, target)
    assert (d.num_hidden_layers, d.intermediate_size, d.draft_vocab_size) == (2, 96, 64)
    assert draft_config_from(load_config(clone_run(hidden_run, tmp_path / "remap", init_from=str(init),
                                                   init_vocab="remap")), target).draft_vocab_size == DRAFT_VOCAB
    P = trainable_params(d)
    for world, parallel in ((1, "ddp"), (4, "fsdp")):
        plans = [plan_memory(d, cfg.train.__class__(**{**cfg.train.__dict__, "anchor_weight": w, "parallel": parallel}),
                             world_size=world, device_type="cuda") for w in (0.0, 1e-4)]
        assert plans[1].terms["anchor"] == 4 * math.ceil(P / world) and plans[0].terms["anchor"] == 0
        assert plans[1].peak - plans[0].peak == 4 * math.ceil(P / world)


@pytest.mark.slow  # ~45 s: one 04 process and two 2-process torchruns
def test_the_anchor_does_not_depend_on_ranks_or_micro_batches(tmp_path, hidden_run, init_dir):
    """One process with grad_accum 2 = 2-process DDP = 2-process FSDP (the init's copy sharded), anchored."""
    import subprocess

    from tests.helpers import stage_env, train_cmd
    from tests.train.test_train_ddp import SETTINGS, _assert_same_training, _torchrun

    kw = dict(SETTINGS, init_from=str(init_dir), anchor_weight=0.05)
    single = clone_run(hidden_run, tmp_path / "single", grad_accum=2, **kw)
    res = subprocess.run(train_cmd(single), env=stage_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "single" / "run") if r["type"] == "train"]
    for parallel in ("ddp", "fsdp"):
        res = _torchrun(clone_run(hidden_run, tmp_path / parallel, grad_accum=1, parallel=parallel, **kw), 2)
        assert res.returncode == 0, res.stderr[-3000:]
        _assert_same_training(tmp_path / "single" / "run", tmp_path / parallel / "run")
        theirs = [r for r in read_metrics(tmp_path / parallel / "run") if r["type"] == "train"]
        assert [r["anchor_loss"] for r in theirs] == pytest.approx([r["anchor_loss"] for r in rows], rel=1e-4, abs=1e-12)
    assert rows[-1]["anchor_loss"] > 0
