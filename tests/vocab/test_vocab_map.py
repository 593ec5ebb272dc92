"""Stage 03: the draft vocabulary map (d2t / t2d) built from loss-masked training tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.core.config import config_from_dict
from common.core.errors import DataError
from common.model.draft_vocab import build_mappings, load_vocab_map
from common.vocab.vocab_map import run_vocab_map, select_draft_vocab
from tests.helpers import REPO

PYTHON = sys.executable


def write_target_config(path: Path, vocab_size: int) -> Path:
    """Only config.json: stage 03 reads the target's vocab size, never its weights."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(path)
    return path


def write_split(path: Path, rows: list[tuple[str, list[int], list[int]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for sid, ids, mask in rows:
            f.write(json.dumps({"id": sid, "input_ids": ids, "loss_mask": mask}) + "\n")


def make_cfg(tmp_path: Path, vocab_size: int, draft_vocab_size: int, train_rows, eval_rows=()):
    model = write_target_config(tmp_path / "target", vocab_size)
    run = tmp_path / "run"
    write_split(run / "data" / "train.jsonl", train_rows)
    write_split(run / "data" / "eval.jsonl", list(eval_rows))
    return config_from_dict({"run_dir": str(run), "target": {"model": str(model), "aux_layer_ids": [1, 2, 3]},
                             "vocab": {"draft_vocab_size": draft_vocab_size}})


# Hand-computed example, target vocab 20, draft vocab 4. Masked counts:
#   7 x4, 3 x3, 12 x3, 5 x2, 9 x1 -> top-4 = 7, 3, 12 (count 3, tie broken by lower id: 3 < 12), 5.
# Token 15 appears 10 times but only at unmasked positions; token 1 only in eval.
TRAIN = [
    ("a", [7, 7, 3, 15, 15, 15, 12], [1, 1, 1, 0, 0, 0, 1]),
    ("b", [15, 15, 15, 15, 7, 3, 3, 12, 12], [0, 0, 0, 0, 1, 1, 1, 1, 1]),
    ("c", [15, 15, 15, 7, 5, 5, 9], [0, 0, 0, 1, 1, 1, 1]),
]
EVAL = [("e", [1] * 50, [1] * 50)]


def test_hand_computed_example(tmp_path):
    cfg = make_cfg(tmp_path, 20, 4, TRAIN, EVAL)
    report = run_vocab_map(cfg)
    d2t, t2d = load_vocab_map(Path(cfg.run_dir) / "vocab" / "vocab_map.safetensors")
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.shape == (20,) and d2t.shape == (4,)
    # 15 (10 unmasked occurrences) and 1 (eval only) are not selected; 9 (count 1) loses to 5 (count 2).
    assert (torch.arange(4) + d2t).tolist() == [3, 5, 7, 12]
    assert d2t.tolist() == [3, 4, 5, 9]
    assert torch.nonzero(t2d).squeeze(1).tolist() == [3, 5, 7, 12]
    assert not t2d[15] and not t2d[1]  # only-unmasked and eval-only tokens are never selected
    assert report["draft_vocab_size"] == 4 and report["target_vocab_size"] == 20
    assert report["distinct_tokens_seen"] == 5  # 3, 5, 7, 9, 12
    assert report["num_loss_tokens"] == 13
    assert report["coverage"] == pytest.approx(12 / 13)  # all masked tokens but the single 9
    assert report["padded"] == 0
    assert json.loads((Path(cfg.run_dir) / "vocab" / "report.json").read_text()) == report


def test_ties_broken_by_lower_id_and_padding_with_lowest_unused(tmp_path):
    # Masked counts: 8 x2, 6 x1, 4 x1, 2 x1 -> V_d=3: 8, then ties 2 < 4 < 6 -> {2, 4, 8}.
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[8, 8, 6, 4, 2]] += torch.tensor([1, 1, 1, 1, 1])
    counts[8] = 2
    assert select_draft_vocab(counts.numpy(), 3).tolist() == [2, 4, 8]
    # Only 2 distinct tokens seen, V_d = 5: pad with the lowest unused ids 0, 1, 2.
    cfg = make_cfg(tmp_path, 10, 5, [("a", [7, 9, 9, 3], [1, 1, 1, 0])])
    report = run_vocab_map(cfg)
    d2t, t2d = load_vocab_map(Path(cfg.run_dir) / "vocab" / "vocab_map.safetensors")
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 7, 9]
    assert report["padded"] == 3 and report["distinct_tokens_seen"] == 2 and report["coverage"] == 1.0


def test_invariants_on_random_data(tmp_path):
    g = torch.Generator().manual_seed(0)
    vocab, v_d = 300, 64
    rows = []
    for i in range(40):
        n = int(torch.randint(5, 80, (1,), generator=g))
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        mask = torch.randint(0, 2, (n,), generator=g).tolist()
        rows.append((f"s{i}", ids, mask))
    cfg = make_cfg(tmp_path, vocab, v_d, rows)
    run_vocab_map(cfg)
    d2t, t2d = load_vocab_map(Path(cfg.run_dir) / "vocab" / "vocab_map.safetensors")
    target_ids = torch.arange(v_d) + d2t
    assert torch.all(target_ids[1:] > target_ids[:-1])  # sorted, strictly
    assert int(t2d.sum()) == v_d
    assert torch.all(t2d[target_ids])
    assert torch.equal(torch.nonzero(t2d).squeeze(1), target_ids)
    # Every selected id is at least as frequent as every unselected one (masked counts).
    counts = torch.zeros(vocab, dtype=torch.int64)
    for _, ids, mask in rows:
        for t, m in zip(ids, mask):
            counts[t] += m
    assert counts[t2d].min() >= counts[~t2d].max()


def test_build_mappings_round_trip():
    used = torch.tensor([0, 4, 5, 19])
    d2t, t2d = build_mappings(used.numpy(), 20)
    assert (torch.arange(4) + d2t).tolist() == used.tolist()
    assert t2d.sum() == 4 and t2d[used].all()


def test_draft_vocab_larger_than_target_is_capped(tmp_path, caplog):
    cfg = make_cfg(tmp_path, 16, 1000, TRAIN[:1] + [("z", [0, 1], [1, 1])])
    with caplog.at_level("WARNING"):
        report = run_vocab_map(cfg)
    assert "exceeds the target vocab" in caplog.text
    d2t, t2d = load_vocab_map(Path(cfg.run_dir) / "vocab" / "vocab_map.safetensors")
    assert report["draft_vocab_size"] == 16 and report["requested_draft_vocab_size"] == 1000
    assert d2t.tolist() == [0] * 16 and bool(t2d.all())
    assert report["padded"] == 16 - 5  # seen: 0, 1, 3, 7, 12


def test_complete_changed_and_overwrite(tmp_path, capsys):
    cfg = make_cfg(tmp_path, 20, 4, TRAIN, EVAL)
    run_vocab_map(cfg)
    out = Path(cfg.run_dir) / "vocab" / "vocab_map.safetensors"
    before = out.read_bytes()
    capsys.readouterr()
    run_vocab_map(cfg)
    assert "already complete" in capsys.readouterr().out
    # Train data changed: a clear error that suggests --overwrite; --overwrite rebuilds.
    write_split(Path(cfg.run_dir) / "data" / "train.jsonl", TRAIN + [("d", [19, 19, 19, 19, 19], [1] * 5)])
    with pytest.raises(DataError, match="--overwrite"):
        run_vocab_map(cfg)
    report = run_vocab_map(cfg, overwrite=True)
    d2t, _ = load_vocab_map(out)
    assert (torch.arange(4) + d2t).tolist() == [3, 7, 12, 19]
    assert report["coverage"] == pytest.approx(15 / 18)
    assert out.read_bytes() != before


def test_bad_inputs(tmp_path):
    cfg = make_cfg(tmp_path, 20, 4, [("ok", [1, 2], [1, 1]), ("bad-tok", [3, 25], [1, 1])])
    with pytest.raises(DataError, match="sample 'bad-tok' has token id 25"):
        run_vocab_map(cfg)
    (Path(cfg.run_dir) / "data" / "train.jsonl").unlink()
    with pytest.raises(DataError, match="run 01b_generate_synthetic.py first"):
        run_vocab_map(cfg)


def test_cli(tmp_path):
    model = write_target_config(tmp_path / "target", 20)
    run = tmp_path / "run"
    write_split(run / "data" / "train.jsonl", TRAIN)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(f"run_dir: {run}\ntarget:\n  model: {model}\n  aux_layer_ids: [1, 2, 3]\n")
    cmd = [PYTHON, str(REPO / "03_build_vocab_map.py"), "--config", str(cfg_path), "--set", "vocab.draft_vocab_size=4"]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert first.returncode == 0, first.stderr
    assert "coverage 0.9231" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert second.returncode == 0 and "already complete" in second.stdout
    (run / "data" / "train.jsonl").unlink()
    third = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert third.returncode == 2 and third.stderr.strip().count("\n") == 0 and "run 01b" in third.stderr


def test_a_refused_overwrite_keeps_the_previous_map(tmp_path):
    """03 --overwrite on data it cannot use refuses before it deletes vocab/: the previous map stays."""
    cfg = make_cfg(tmp_path, 20, 4, TRAIN, EVAL)
    run_vocab_map(cfg)
    vocab = Path(cfg.run_dir) / "vocab"
    before = {p.name: p.read_bytes() for p in vocab.iterdir()}
    write_split(Path(cfg.run_dir) / "data" / "train.jsonl", [("a", [1, 2, 3], [0, 0, 0])])  # no loss-masked token
    with pytest.raises(DataError, match="has no loss-masked tokens"):
        run_vocab_map(cfg, overwrite=True)
    assert {p.name: p.read_bytes() for p in vocab.iterdir()} == before
