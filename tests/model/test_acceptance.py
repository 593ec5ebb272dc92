"""The offline prediction of vLLM's acceptance (common.model.acceptance): the replay of vLLM's greedy
rounds over hand-made correctness arrays, with answers worked out by hand, and the product formula."""

from __future__ import annotations

import numpy as np
import pytest

from common.model.acceptance import (ReplayTotals, describe, generated_segments, product_formula, product_per_position,
                               replay_sample)


def hits_from(rows: list[str]) -> np.ndarray:
    """'1'/'0' strings, one per TTT step, indexed by anchor t."""
    return np.array([[c == "1" for c in r] for r in rows], dtype=bool)


def test_product_formula_and_per_position():
    assert product_formula([0.8, 0.5, 0.25], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert product_formula([0.8, 0.5, 0.25, 0.9], 2) == pytest.approx(2.2)  # more steps than k: first k only
    assert product_per_position([0.8, 0.5, 0.25], 3) == pytest.approx([0.8, 0.4, 0.1])


def test_generated_segments():
    assert generated_segments([0, 0, 1, 1, 1, 0, 1, 1]) == [(2, 4), (6, 7)]
    assert generated_segments([1, 1]) == [(0, 1)]
    assert generated_segments([0, 0]) == []


def test_replay_walks_rounds_and_restarts_after_a_miss():
    # Prompt x0..x2, response x3..x11 (s = 3, e = 11). Rounds anchor at t = 2 first.
    generated = [0, 0, 0] + [1] * 9
    hits = hits_from([
        # t: 0123456789AB
        "000110010000",  # step 0
        "000100010000",  # step 1
        "000000010000",  # step 2
    ])
    # t=2: step0 miss -> accepted 0; next t=3.
    # t=3: step0 hit, step1 hit, step2 miss -> accepted 2; next t=6.
    # t=6: step0 miss -> 0; next t=7.
    # t=7: all three hit -> 3 (drafts x9, x10, x11 all <= e); next t=11: x_{12} does not exist, stop.
    c = replay_sample(hits, generated, k=3)
    assert c.rounds == 4
    assert c.accepted_per_pos == [2, 2, 1]
    assert c.acceptance_length == pytest.approx(1 + 5 / 4)
    assert c.per_position == pytest.approx([0.5, 0.5, 0.25])
    # k=1 uses step 0 only: t=2 miss ->3; t=3 hit ->5; t=5 miss ->6; t=6 miss ->7; t=7 hit ->9;
    # t=9 miss ->10; t=10: t+2=12 > e, stop. 6 rounds, 2 accepted.
    c1 = replay_sample(hits, generated, k=1)
    assert (c1.rounds, c1.accepted_per_pos) == (6, [2])


def test_replay_does_not_draft_past_the_end():
    # Response x1..x5 (s=1, e=5), every step right: t=0 drafts x2, x3, x4, all accepted -> next t=4,
    # where x5 is the last token (end of turn): no round after it.
    generated = [0, 1, 1, 1, 1, 1]
    c = replay_sample(np.ones((3, 6), dtype=bool), generated, k=3)
    assert (c.rounds, c.accepted_per_pos) == (1, [1, 1, 1])
    # t=0: step 0 right, step 1 wrong -> 1, next t=2: drafts x4 (right), x5 (right), x6 (past the end) -> 2;
    # next t=5: stop.
    c = replay_sample(hits_from(["111111", "011111", "011111"]), generated, k=3)
    assert (c.rounds, c.accepted_per_pos) == (2, [2, 1, 0])


def test_rounds_land_on_the_misses_so_the_product_formula_overestimates():
    """Step 0 right on 6 of the 9 anchors t=0..8 (product formula 1.67 at k=1), but a hit skips the next
    anchor and a miss does not: t=0 miss ->1; t=1 hit ->3; t=3 miss ->4; t=4 hit ->6; t=6 miss ->7;
    t=7 hit ->9, where x10 is the last token: 6 rounds, 3 accepted -> 1.5."""
    generated = [0] + [1] * 10
    hits = hits_from(["01101101100"])
    assert product_formula([6 / 9], 1) == pytest.approx(1.6667, abs=1e-4)
    c = replay_sample(hits, generated, k=1)
    assert (c.rounds, c.accepted_per_pos) == (6, [3])
    assert c.acceptance_length == pytest.approx(1.5)


def test_max_new_tokens_limits_the_rounds():
    generated = [0] + [1] * 9  # s=1, e=9
    hits = np.zeros((1, 10), dtype=bool)
    # no hits: a round at every anchor t=0..7 (t+2 <= 9); t+1 tokens are generated before the round at t
    assert replay_sample(hits, generated, k=1).rounds == 8
    assert replay_sample(hits, generated, k=1, max_new_tokens=4).rounds == 3  # t=0..2; at t=3 4 tokens are out


def test_two_segments_replay_independently_and_packed_rows_split_samples():
    sample_a = ([0, 1, 1, 1, 0, 0, 1, 1, 1], hits_from(["100001000", "100000000"]))
    # segment (1,3): t=0 hit (x2) then step1 at t=0 hit (x3) -> 2 -> t=3: t+2=5>3 stop. 1 round [1,1]
    # segment (6,8): t=5 hit (x7), step1 would draft x8: hit? row1[5]=0 -> 1 -> t=7: 9>8 stop. 1 round [1,0]
    c = replay_sample(sample_a[1], sample_a[0], k=2)
    assert (c.rounds, c.accepted_per_pos) == (2, [2, 1])
    sample_b = ([0, 0, 1, 1, 1, 1], hits_from(["000000", "000000"]))  # t=1, 2, 3: three rounds, nothing accepted
    totals = ReplayTotals(2)
    totals.add_packed_row(np.concatenate([sample_a[1], sample_b[1]], axis=1), sample_a[0] + sample_b[0], [9, 6])
    rep = totals.report()
    assert rep["2"]["rounds"] == 5 and rep["2"]["accepted_per_pos"] == [2, 1]
    assert rep["2"]["acceptance_length"] == pytest.approx(1.6)
    # k=1: (1,3): t=0 hit -> t=2, 4 > 3: stop; (6,8): t=5 hit -> t=7, 9 > 8: stop; sample b: 3 rounds
    assert rep["1"]["rounds"] == 5 and rep["1"]["accepted_per_pos"] == [2]
    # round trip through the all-reduce list
    again = ReplayTotals(2).load_list(totals.to_list())
    assert again.report() == rep
    assert describe({"replay": rep, "tau": {"2": 1.9}}, [2]) == \
        "predicted vLLM acceptance length (replay) at k=2: 1.60 (product formula 1.90)"
    # a report as 04 writes it: "replay" and "tau" at every k
    assert describe({"replay": rep, "tau": {"1": 1.5, "2": 1.9}}, [1, 2]) == \
        "predicted vLLM acceptance length (replay) at k=1: 1.40 (product formula 1.50), k=2: 1.60 (product formula 1.90)"
    assert describe({}, [2]) == "no eval split"


def test_hits_with_fewer_steps_than_k_is_an_error():
    with pytest.raises(ValueError, match="steps >= k=3"):
        replay_sample(np.zeros((2, 5), dtype=bool), [1] * 5, k=3)


def test_replay_on_token_ids_with_a_real_target_and_the_exact_chain_draft(tmp_path, one_torch_thread):
    """The hand-built pi-chain target (transformers) and its exact draft (tests/train/test_export.py), exported:
    on the target's greedy continuations every drafted token is right, so each round accepts k = 3 and
    moves 4 tokens. Prompt of P tokens, 24 generated (positions P..P+23): rounds anchor at
    P-1, P+3, ..., P+19 (the next, P+23, has no token left to draft): 6 rounds x 3 accepted."""
    import torch

    from common.evaluate.replay import replay_on_token_ids
    from common.core.config import config_from_dict
    from common.model.export import export_vllm_draft
    from tests.train.test_export import build_chain_draft, build_chain_target, chain_sequence, chain_setup

    S, pi = chain_setup()
    build_chain_target(tmp_path / "target", S, pi)
    export_vllm_draft(build_chain_draft(S, pi), tmp_path / "draft", dtype=torch.float32)
    cfg = config_from_dict({"run_dir": str(tmp_path / "run"), "extract": {"device": "cpu"},
                            "target": {"model": str(tmp_path / "target"), "aux_layer_ids": [1, 2, 3], "dtype": "float32"}})
    sequences = []
    for start, n in ((0, 4), (17, 9)):
        seq = chain_sequence(S, pi, start, n + 24)
        sequences.append((seq[:n], seq[n:]))
    result = replay_on_token_ids(cfg, tmp_path / "draft", sequences, k=3)
    assert result["rounds"] == 2 * 6 and result["accepted_per_pos"] == [12, 12, 12]
    assert result["acceptance_length"] == 4.0 and result["num_sequences"] == 2
