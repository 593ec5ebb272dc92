"""Stage 04 (training): data packing, loss/accuracy, eval report, resume after SIGKILL, bad inputs.

The data set is real: a tiny random transformers Llama (4 layers, hidden 64) is saved as
safetensors, run over structured token sequences by the real stage-02 code
(common.extract.stage.run_extraction), and a vocab map is built from the target's own top-1 tokens.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.helpers import (AUX_IDS, DRAFT_VOCAB, HIDDEN, checkpoint_steps, clone_run, kill_while_working, read_metrics,
                           stage_env, start_in_own_group, train_cmd)


# ---------------------------------------------------------------------------------------------
# Unit tests: packing, schedule, tau
# ---------------------------------------------------------------------------------------------


def test_expected_acceptance_length_formula():
    from common.model.acceptance import product_formula as expected_acceptance_length

    acc = [0.8, 0.5, 0.25]
    # tau_k = 1 + acc0 + acc0*acc1 + acc0*acc1*acc2
    assert expected_acceptance_length(acc, 1) == pytest.approx(1.8)
    assert expected_acceptance_length(acc, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_acceptance_length(acc, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert expected_acceptance_length([1.0] * 7, 7) == pytest.approx(8.0)
    assert expected_acceptance_length([0.0, 0.9], 2) == pytest.approx(1.0)


def test_lr_schedule_warmup_then_cosine():
    from common.core.config import config_from_dict
    from common.train.optim import lr_at

    cfg = config_from_dict({"train": {"lr": 1e-3, "min_lr": 1e-4, "warmup_ratio": 0.1}})
    lrs = [lr_at(s, 100, cfg.train) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)  # 10 warmup steps
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[99] == pytest.approx(1e-4, rel=1e-2)


def test_packing_is_deterministic_budgeted_and_complete():
    from common.core.errors import DataError
    from common.train.data import pack_micro_batches

    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, size=500)
    a = pack_micro_batches(lengths, 512, seed=3, epoch=0, window=128)
    b = pack_micro_batches(lengths, 512, seed=3, epoch=0, window=128)
    c = pack_micro_batches(lengths, 512, seed=3, epoch=1, window=128)
    assert a == b and a != c
    flat = sorted(i for mb in a for i in mb)
    assert flat == list(range(500))  # every sample exactly once
    loads = [int(lengths[mb].sum()) for mb in a]
    assert max(loads) <= 512
    # best-fit-decreasing fills the budget well: within 5% of the lower bound on bin count
    assert len(a) <= 1.05 * np.ceil(lengths.sum() / 512) + 1
    with pytest.raises(DataError, match="batch_max_tokens"):
        pack_micro_batches(np.array([10, 600]), 512, 0, 0)


def epochs_of(index, n: int) -> list:
    """The rounds of an unbudgeted plan over this index: n epochs of every train sample, in index order."""
    from common.train.data import RoundSamples

    train = [index.samples[i] for i in index.split_indices("train")]
    return [RoundSamples(e, [s.sample_id for s in train], [s.length for s in train]) for e in range(n)]


def test_rank_schedule_matches_grad_accum(hidden_run):
    """1 process x grad_accum 2 and 2 processes x grad_accum 1 consume the same global batches."""
    from common.core.run_folder import Layout
    from common.hidden.shards import HiddenIndex
    from common.train.data import DataPosition, TrainData

    index = HiddenIndex.load(Layout.of(yaml.safe_load(hidden_run.read_text())["run_dir"]).hidden_index)
    single = TrainData(index, 256, seed=0, rounds=epochs_of(index, 2), world_size=1, rank=0, grad_accum=2)
    ranks = [TrainData(index, 256, seed=0, rounds=epochs_of(index, 2), world_size=2, rank=r, grad_accum=1) for r in (0, 1)]
    assert single.steps_in_round(0) == ranks[0].steps_in_round(0)
    pos1 = pos2 = DataPosition()
    for _ in range(single.steps_in_round(0) + 2):  # crosses into round (= epoch) 1
        mine, real, nxt1 = single.step_micro_batches(pos1)
        r0, real0, nxt2 = ranks[0].step_micro_batches(pos2)
        r1, real1, _ = ranks[1].step_micro_batches(pos2)
        assert mine == [r0[0], r1[0]] and real == [real0[0], real1[0]]
        assert nxt1 == nxt2
        assert single.step_loss_positions(pos1) == ranks[1].step_loss_positions(pos2)
        pos1, pos2 = nxt1, nxt2
    assert pos1.round == 1


def test_micro_batch_contents_match_shards(hidden_run):
    from safetensors.torch import load_file

    from common.core.run_folder import Layout
    from common.hidden.shards import HiddenIndex
    from common.train.data import MicroBatchReader

    run_dir = Path(yaml.safe_load(hidden_run.read_text())["run_dir"])
    index = HiddenIndex.load(Layout.of(run_dir).hidden_index)
    assert index.aux_layer_ids == AUX_IDS
    assert len(index.split_indices("train")) == 64 and len(index.split_indices("eval")) == 16
    reader = MicroBatchReader(index, dtype=torch.float32)
    picks = [0, 5, len(index.samples) - 1]
    mb = reader.read(picks)
    assert mb.aux_hidden.dtype == torch.float32 and mb.num_tokens == sum(mb.seq_lens)
    row = 0
    for i in picks:
        ref = index.samples[i]
        shard = load_file(str(index.shards[ref.shard].path))
        n = ref.length
        assert torch.equal(mb.input_ids[row:row + n], shard["input_ids"][ref.start:ref.end])
        assert torch.equal(mb.aux_hidden[row:row + n], shard["aux_hidden"][ref.start:ref.end].float())
        assert torch.equal(mb.position_ids[row:row + n], torch.arange(n))
        row += n
    # the train.jsonl tokens are what the shards hold
    first = json.loads((run_dir / "data" / "train.jsonl").read_text().splitlines()[0])
    ref0 = next(s for s in index.samples if s.sample_id == first["id"])
    assert reader.read([index.samples.index(ref0)]).input_ids.tolist() == first["input_ids"]


# ---------------------------------------------------------------------------------------------
# Training: loss falls, accuracy rises, eval report, export
# ---------------------------------------------------------------------------------------------


def test_training_learns_and_reports(hidden_run, tmp_path, one_torch_thread):
    from common.core.config import load_config
    from common.model.acceptance import product_formula as expected_acceptance_length
    from common.train.trainer import run_training

    cfg_path = clone_run(hidden_run, tmp_path, max_steps=60, eval_every=30, checkpoint_every=30)
    cfg = load_config(cfg_path)
    assert run_training(cfg) == 0
    run_dir = Path(cfg.run_dir)
    rows = read_metrics(run_dir)
    train_rows = [r for r in rows if r["type"] == "train"]
    evals = [r for r in rows if r["type"] == "eval"]
    assert [r["step"] for r in train_rows] == list(range(1, 61))
    first = np.mean([r["loss"] for r in train_rows[:5]])
    last = np.mean([r["loss"] for r in train_rows[-5:]])
    acc_first = np.mean([r["step_acc"][0] for r in train_rows[:5]])
    acc_last = np.mean([r["step_acc"][0] for r in train_rows[-5:]])
    print(f"loss {first:.3f} -> {last:.3f}; step-0 acc {acc_first:.3f} -> {acc_last:.3f}")
    assert last < 0.6 * first
    assert acc_first < 0.15 and acc_last > 0.5
    assert all(len(r["step_losses"]) == 3 and len(r["step_acc"]) == 3 for r in train_rows)
    assert train_rows[0]["lr"] < train_rows[10]["lr"]  # warmup
    # eval at step 30 and at the end; report consistent with the formula
    assert [e["step"] for e in evals] == [30, 60]
    report = json.loads((run_dir / "train" / "eval_report.json").read_text())
    # eval_report.json also keeps each eval sample's first-turn replay (05 sums it over the prompts it measures);
    # metrics.jsonl's lines leave that table out, one per eval
    assert len(report.pop("replay_first_turn")["sample_ids"]) == report["num_samples"]
    assert "replay_first_turn" not in evals[-1] and report == evals[-1]
    acc = report["step_acc"]
    assert report["tau"]["3"] == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
    assert report["tau"]["3"] == pytest.approx(expected_acceptance_length(acc, 3))
    assert acc[0] > 0.35 and report["tau"]["3"] > 1.5
    # the replay of vLLM's rounds: every k, vLLM's counter formulas, rates falling with the position
    replay = report["replay"]
    assert sorted(replay) == ["1", "2", "3"]
    for k, r in replay.items():
        assert len(r["per_position"]) == int(k) and r["rounds"] > 0
        assert r["acceptance_length"] == pytest.approx(1 + sum(r["accepted_per_pos"]) / r["rounds"])
        assert r["per_position"] == pytest.approx([a / r["rounds"] for a in r["accepted_per_pos"]])
        assert all(a >= b for a, b in zip(r["accepted_per_pos"], r["accepted_per_pos"][1:]))
    assert 1.0 < replay["1"]["acceptance_length"] < replay["3"]["acceptance_length"] < 4.0
    assert evals[-1]["loss"] < evals[0]["loss"] and evals[-1]["step_acc"][0] > evals[0]["step_acc"][0]
    # export + summary
    final = run_dir / "train" / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["architectures"] == ["LlamaForCausalLMEagle3"]
    summary = json.loads((final / "training_summary.json").read_text())
    assert summary["step"] == 60 and summary["eval"]["tau"] == report["tau"]
    from safetensors.torch import load_file

    weights = load_file(str(final / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    ckpt = load_file(str(run_dir / "train" / "checkpoints" / "step-60" / "model.safetensors"))
    assert torch.equal(weights["fc.weight"], ckpt["fc.weight"].to(torch.bfloat16))
    assert sorted(p.name for p in (run_dir / "train" / "checkpoints").iterdir()) == ["step-30", "step-60"]
    assert any((run_dir / "train" / "tb").iterdir())
    # a rerun finds the run complete
    assert run_training(cfg) == 0


# ---------------------------------------------------------------------------------------------
# Resume after SIGKILL: bit-for-bit equal to an uninterrupted run
# ---------------------------------------------------------------------------------------------


def newest_checkpoint(run_dir: Path) -> int:
    return max(checkpoint_steps(run_dir), default=0)


def test_resume_after_sigkill_is_exact(hidden_run, tmp_path):
    from safetensors.torch import load_file

    # checkpoints every 5 steps, a metrics line every 7: every checkpoint is mid logging window, so the resumed
    # run must also restore the window
    steps, every, log_every = 30, 5, 7
    kw = dict(max_steps=steps, checkpoint_every=every, eval_every=12, log_every=log_every, batch_max_tokens=160,
              num_workers=2)
    ref_cfg = clone_run(hidden_run, tmp_path / "ref", **kw)
    cut_cfg = clone_run(hidden_run, tmp_path / "cut", **kw)
    env = stage_env()

    ref = subprocess.run(train_cmd(ref_cfg), env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]

    # killed once a checkpoint drawn from all but the last two is written: the run still has steps to resume
    cut_run = tmp_path / "cut" / "run"
    assert kill_while_working(lambda: start_in_own_group(train_cmd(cut_cfg)), lambda _: newest_checkpoint(cut_run),
                              steps - 2 * every, random.Random(15)) == 1
    assert not (cut_run / "train" / "final").exists()
    killed_at = checkpoint_steps(cut_run)[-1]
    assert killed_at < steps
    assert killed_at % log_every, killed_at  # mid logging window

    resumed = subprocess.run(train_cmd(cut_cfg), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {cut_run / 'train' / 'checkpoints'}" in resumed.stdout

    for sub in ("train/final/model.safetensors", f"train/checkpoints/step-{steps}/model.safetensors"):
        a = load_file(str(tmp_path / "ref" / "run" / sub))
        b = load_file(str(cut_run / sub))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{sub}:{k} differs after resume"
    ref_rows, cut_rows = read_metrics(tmp_path / "ref" / "run"), read_metrics(cut_run)
    steps_logged = [(r["type"], r["step"]) for r in cut_rows]
    assert len(steps_logged) == len(set(steps_logged)), "duplicate metrics lines after resume"
    assert steps_logged == [(r["type"], r["step"]) for r in ref_rows]
    # the logged curve itself is identical (only tokens/s and elapsed time depend on the interruption)
    for key in ("loss", "step_losses", "step_acc", "grad_norm", "lr", "tokens", "tau"):
        assert [r.get(key) for r in cut_rows] == [r.get(key) for r in ref_rows], key
    for export in ("final", "best"):  # and so is each export's prediction (the eval at its step)
        ref_prediction = json.loads((tmp_path / "ref" / "run" / "train" / export / "prediction.json").read_text())
        assert json.loads((cut_run / "train" / export / "prediction.json").read_text()) == ref_prediction, export

    # a third run: already complete
    again = subprocess.run(train_cmd(cut_cfg), env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "nothing to do" in again.stdout


def _ledger(run_dir: Path) -> dict:
    """The newest checkpoint's ledger.json."""
    from common.core.run_folder import Layout

    _, newest = Layout.of(run_dir).checkpoint_dirs()[-1]
    return json.loads((newest / "ledger.json").read_text())


def test_ledger_every_sample_exactly_once_per_epoch_across_sigkills(hidden_run, tmp_path):
    """1 process x grad_accum 3: epochs end mid-step, where the rank's stand-in micro-batches get weight 0.
    Three SIGKILLs at random steps (and random moments inside them, checkpoints included), then a rerun:
    the ledger has every train sample exactly once in each of the 3 epochs, as the uninterrupted run's."""
    epochs = 3
    kw = dict(max_steps=None, epochs=epochs, grad_accum=3, checkpoint_every=2, keep_checkpoints=1, eval_every=0,
              log_every=5, batch_max_tokens=160)
    ref_cfg, cut_cfg = clone_run(hidden_run, tmp_path / "ref", **kw), clone_run(hidden_run, tmp_path / "cut", **kw)
    env = stage_env()
    ref = subprocess.run(train_cmd(ref_cfg), env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    ledger = _ledger(tmp_path / "ref" / "run")
    train_ids = [json.loads(line)["id"] for line in (tmp_path / "ref" / "run" / "data" / "train.jsonl").read_text().splitlines()]
    assert sorted(ledger["sample_ids"]) == sorted(train_ids) and len(ledger["epochs"]) == epochs
    assert all(c == [1] * len(train_ids) for c in ledger["epochs"])
    summary = json.loads((tmp_path / "ref" / "run" / "train" / "final" / "training_summary.json").read_text())
    total_steps = summary["total_steps"]
    assert summary["ledger"] == {"num_samples": len(train_ids), "epochs": epochs, "min_times": epochs,
                                 "max_times": epochs, "per_epoch_trained": [len(train_ids)] * epochs}
    assert f"every one of {len(train_ids)} train samples trained exactly {epochs} time(s)" in ref.stdout

    # Each kill waits for a checkpoint drawn from the steps still to train (but the last 4: the run must not end
    # before the kill), then a random 0-120 ms more (a step takes ~60 ms here, a checkpoint write included), so
    # it lands mid-step or mid-write.
    cut_run = tmp_path / "cut" / "run"

    def vouched_for(killed: list) -> None:
        if killed:
            assert not (cut_run / "train" / "final").exists()
            partial = _ledger(cut_run)  # what the kept checkpoint vouches for: no sample twice
            assert all(max(c) <= 1 for c in partial["epochs"])

    kills = kill_while_working(lambda: start_in_own_group(train_cmd(cut_cfg), env=env), lambda _: newest_checkpoint(cut_run),
                               total_steps - 4, random.Random(4), kills=3, jitter_s=0.12, after_each=vouched_for)
    assert kills == 3, f"only {kills} of the planned 3 kills landed before the run ended ({total_steps} steps)"
    done = subprocess.run(train_cmd(cut_cfg), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _ledger(cut_run) == ledger


def test_stand_in_micro_batches_at_an_epoch_end_have_weight_zero(hidden_run, tmp_path):
    """An epoch of exactly 2 micro-batches: grad_accum 3 gets a stand-in third one (a copy of the first).
    With weight 0 the one step of epoch 0 is exactly grad_accum 2's (had it counted, the first
    micro-batch would weigh double and the weights would differ)."""
    from safetensors.torch import load_file

    from common.core.run_folder import Layout
    from common.hidden.shards import HiddenIndex
    from common.train.data import TrainData

    index = HiddenIndex.load(Layout.of(yaml.safe_load(hidden_run.read_text())["run_dir"]).hidden_index)
    total = sum(index.samples[i].length for i in index.split_indices("train"))
    budget = next(b for b in range(total // 2, total, 64)
                  if len(TrainData(index, b, seed=0, rounds=epochs_of(index, 1)).round_micro_batches(0)) == 2)
    runs = {}
    for accum in (2, 3):
        cfg = clone_run(hidden_run, tmp_path / f"ga{accum}", max_steps=1, grad_accum=accum, batch_max_tokens=budget,
                        checkpoint_every=1, eval_every=0)
        res = subprocess.run(train_cmd(cfg), env=stage_env(), capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        ckpt = tmp_path / f"ga{accum}" / "run" / "train" / "checkpoints" / "step-1"
        runs[accum] = load_file(str(ckpt / "model.safetensors"))
        assert json.loads((ckpt / "state.json").read_text())["data_position"] == {"round": 1, "micro_batch": 0}
    for name, weight in runs[2].items():
        assert torch.equal(weight, runs[3][name]), name


def test_a_diverged_run_stops_keeps_its_last_good_checkpoint_and_exports_nothing(hidden_run, tmp_path):
    """lr 1e30 without clipping blows the weights up within a few steps: the run stops with one error line
    (exit 2) at the first non-finite gradient, keeps the checkpoints before it, writes no train/final and no
    NaN into metrics.jsonl."""
    cfg = clone_run(hidden_run, tmp_path / "a", max_steps=20, lr=1e30, grad_clip=0.0, warmup_ratio=0.0, checkpoint_every=1,
                    keep_checkpoints=50, eval_every=0, log_every=1, batch_max_tokens=160)
    res = subprocess.run(train_cmd(cfg), env=stage_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    line = [x for x in res.stderr.splitlines() if x.strip()][-1]
    assert line.startswith("error: training diverged at step ") and "nothing was exported" in line and "train.lr (now 1e+30)" in line
    bad_step = int(line.split("at step ")[1].split("/")[0])
    run_dir = tmp_path / "a" / "run"
    assert not (run_dir / "train" / "final").exists()
    steps = sorted(int(p.name.split("-")[1]) for p in (run_dir / "train" / "checkpoints").glob("step-*"))
    assert steps == list(range(1, bad_step))  # every step before the bad one, none after
    if steps:
        assert f"the last good checkpoint, {run_dir / 'train' / 'checkpoints' / f'step-{steps[-1]}'}, is kept" in line
    for row in (run_dir / "train" / "metrics.jsonl").read_text().splitlines():
        json.loads(row, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))  # strict JSON: no NaN


def test_a_ledger_that_disagrees_with_the_position_stops_the_resume(hidden_run, tmp_path):
    kw = dict(max_steps=6, checkpoint_every=3, keep_checkpoints=2, eval_every=0, batch_max_tokens=160)
    cfg = clone_run(hidden_run, tmp_path / "a", **kw)
    assert subprocess.run(train_cmd(cfg), env=stage_env(), capture_output=True, timeout=600).returncode == 0
    run_dir = tmp_path / "a" / "run"
    ckpt = run_dir / "train" / "checkpoints" / "step-6"
    doc = json.loads((ckpt / "ledger.json").read_text())
    doc["epochs"][0] = [1] * len(doc["epochs"][0])  # claims every sample was trained
    (ckpt / "ledger.json").write_text(json.dumps(doc))
    manifest = json.loads((ckpt / "manifest.json").read_text())  # re-vouched for, so only the content is wrong
    from common.core.io import file_sha256

    manifest["files"]["ledger.json"] = {"bytes": (ckpt / "ledger.json").stat().st_size, "sha256": file_sha256(ckpt / "ledger.json")}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    res = subprocess.run(train_cmd(cfg, "--set", "train.max_steps=8"), env=stage_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 2, res.stderr[-2000:]
    line = [x for x in res.stderr.splitlines() if x.strip()][-1]
    assert line.startswith("error: checkpoint ") and "records other trained samples than its data position" in line
    assert "rerun with --overwrite" in line


# ---------------------------------------------------------------------------------------------
# Bad inputs: one clear line, exit code 2
# ---------------------------------------------------------------------------------------------


def _run_expect_error(cfg_path: Path, *extra: str) -> str:
    res = subprocess.run(train_cmd(cfg_path, *extra), env=stage_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_bad_inputs_give_one_line_errors(hidden_run, tmp_path):
    cfg_path = clone_run(hidden_run, tmp_path)
    run_dir = tmp_path / "run"
    # aux layer ids differ from the extracted ones
    msg = _run_expect_error(cfg_path, "--set", "target.aux_layer_ids=[0,1,2]")
    assert "[1, 2, 3]" in msg and "[0, 1, 2]" in msg and "02_extract_hidden.py" in msg
    # draft vocab size differs from the vocab map
    msg = _run_expect_error(cfg_path, "--set", "vocab.draft_vocab_size=100")
    assert f"{DRAFT_VOCAB} draft tokens" in msg and "03_build_vocab_map.py" in msg
    # a sample longer than the micro-batch budget
    msg = _run_expect_error(cfg_path, "--set", "train.batch_max_tokens=32")
    assert "train.batch_max_tokens=32" in msg and "tokenize.max_seq_len" in msg
    # truncated shard
    shard = sorted((run_dir / "hidden").glob("shard-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    msg = _run_expect_error(cfg_path)
    assert shard.name in msg and "truncated" in msg and "02_extract_hidden.py" in msg
    # missing shard
    shard.unlink()
    msg = _run_expect_error(cfg_path)
    assert shard.name in msg and "missing" in msg and "02_extract_hidden.py" in msg
    assert not (run_dir / "train" / "checkpoints").exists()


def test_lm_head_starts_from_the_target_rows_of_the_draft_vocab(hidden_run, tmp_path, one_torch_thread):
    """train.init_lm_head=target: the draft's lm_head row i is the target's lm_head row of target id
    i + d2t[i] (after one step at a negligible learning rate); the default is a random init."""
    from safetensors.torch import load_file

    from common.core.config import load_config
    from common.target.loading import load_target_tensors
    from common.train.trainer import run_training

    heads = {}
    for init in ("target", "random"):
        cfg = load_config(clone_run(hidden_run, tmp_path / init, max_steps=1, lr=1e-12, eval_every=0,
                                    init_lm_head=init))
        assert run_training(cfg) == 0
        heads[init] = load_file(str(Path(cfg.run_dir) / "train" / "final" / "model.safetensors"))["lm_head.weight"].float()
    vmap = load_file(str(Path(cfg.run_dir) / "vocab" / "vocab_map.safetensors"))
    target_ids = torch.arange(vmap["d2t"].numel()) + vmap["d2t"]
    want = load_target_tensors(cfg.target.model)["lm_head"].float()[target_ids]
    torch.testing.assert_close(heads["target"], want, rtol=1e-2, atol=1e-3)  # the export is bfloat16
    assert not torch.allclose(heads["random"], want, rtol=1e-2, atol=1e-3)
