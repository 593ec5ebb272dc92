"""Stage 04's offline evaluation: teacher-forced accuracy of each TTT step on the eval split, and
the acceptance length vLLM will measure, predicted by replaying its rounds (common.model.acceptance;
docs/design.md#ttt-alignment-and-loss).

05 measures the first user turn of its held-out prompts, answered once; 04's replay covers every eval sample and
every assistant turn. So the eval also keeps, per eval sample, the replay of its first assistant turn alone
("replay_first_turn"): 05 sums it over exactly the prompts it measured (common.evaluate.draft.prediction_on_prompts),
and reports that prediction beside the eval split's. The first turn's rounds are a share of the rounds the replay
walks anyway (each generated segment is replayed on its own), so this costs no extra replay."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from common.model.acceptance import ReplayTotals, generated_segments, product_formula, replay_sample
from common.core.distributed import DistEnv, NamedSums, all_reduce_sum
from common.hidden.shards import HiddenIndex
from common.train.data import eval_micro_batches
from common.train.step import StepLoss, StepSettings


@torch.no_grad()
def evaluate(loss: StepLoss, index: HiddenIndex, reader, cfg, env: DistEnv) -> Optional[dict]:
    """Teacher-forced per-TTT-step accuracy on the eval split, and the implied acceptance length, computed by
    04's loss (common.train.step.StepLoss: the same model, precision and loss as training; 04 passes its
    step's, evaluate_export one of its own)."""
    mine, per_rank, stand_in = eval_micro_batches(index, cfg.train.batch_max_tokens, env.world_size, env.rank)
    if per_rank == 0:
        return None
    K = cfg.train.ttt_steps
    # losses weighted by their denominators, so the report is a mean over positions, not batches
    sums = NamedSums(weighted_loss=1, denominator=1, weighted_step_losses=K, step_correct=K, step_counts=K)
    # vLLM's rounds replayed over each sample, limited to the tokens 05 lets vLLM generate
    replay = ReplayTotals(K, max_new_tokens=cfg.evaluate.max_tokens)
    first_turns = FirstTurnReplay(K, index.split_indices("eval"), cfg.evaluate.max_tokens)
    model = loss.model
    was_training = model.training
    model.eval()
    for mb_samples in mine:
        # FSDP needs every rank in every forward: a rank short of eval batches reruns one and ignores it.
        if mb_samples is None and not (env.distributed and cfg.train.parallel == "fsdp"):
            continue
        mb = reader.read(mb_samples if mb_samples is not None else stand_in).to(env.device)
        out = loss(mb, per_position=True)
        if mb_samples is None:
            continue
        first_turns.add_packed_row(replay, mb_samples, out.step_hits.cpu().numpy(), mb.loss_mask.reshape(-1).cpu().numpy(),
                                   mb.seq_lens)
        den = out.denominator
        sums.add(weighted_loss=float(out.loss) * den, denominator=den,
                 weighted_step_losses=[x * den for x in out.step_losses], step_correct=out.step_correct,
                 step_counts=out.step_counts)
    model.train(was_training)
    totals = sums.all_reduced(env)
    replay.load_list(all_reduce_sum(torch.tensor(replay.to_list(), dtype=torch.float64), env).tolist())
    first_turns.table = all_reduce_sum(torch.from_numpy(first_turns.table), env).numpy()  # each sample on one rank
    den = max(1.0, float(totals["denominator"]))
    counts = totals["step_counts"]
    acc = [float(c) / max(1.0, float(m)) for c, m in zip(totals["step_correct"], counts)]
    return {
        "loss": float(totals["weighted_loss"]) / den,
        "step_losses": [float(x) / den for x in totals["weighted_step_losses"]],
        "step_acc": acc,
        "step_counts": [int(c) for c in counts],
        "tau": {str(k): product_formula(acc, k) for k in range(1, K + 1)},  # biased upward; kept for comparison
        "replay": replay.report(),  # the prediction of vLLM's acceptance (common.model.acceptance)
        "num_samples": len(index.split_indices("eval")),
        # per eval sample, its first assistant turn's replay: what 05 sums over the prompts it measured
        "replay_first_turn": first_turns.report([index.samples[i].sample_id for i in index.split_indices("eval")]),
    }


def first_turn_mask(generated: np.ndarray) -> np.ndarray:
    """The loss mask of a sample's first generated segment alone (its first assistant turn: later turns follow a user
    turn, which is not generated)."""
    first = np.zeros_like(generated)
    segments = generated_segments(generated)
    if segments:
        s, e = segments[0]
        first[s:e + 1] = generated[s:e + 1]
    return first


class FirstTurnReplay:
    """Per eval sample (rows in the eval split's order), for k = 1..steps: [rounds, accepted at positions 0..k-1] of
    its first assistant turn. Filled while the eval split's replay (ReplayTotals) is summed: the replay walks each
    generated segment on its own (common.model.acceptance.replay_sample), so a sample's rounds are its first turn's
    plus the later turns', and both are added to the totals."""

    def __init__(self, steps: int, eval_samples: Sequence[int], max_new_tokens: Optional[int]):
        self.steps, self.max_new_tokens = steps, max_new_tokens
        self.row_of = {s: r for r, s in enumerate(eval_samples)}
        self.table = np.zeros((len(eval_samples), sum(1 + k for k in range(1, steps + 1))), dtype=np.float64)

    def add_packed_row(self, totals: ReplayTotals, samples: Sequence[int], hits: np.ndarray, loss_mask: np.ndarray,
                       seq_lens: Sequence[int]) -> None:
        """A packed row of samples back to back (hits [steps, T], loss_mask [T]) into `totals` and this table."""
        hits, loss_mask, a = np.asarray(hits, dtype=bool), np.asarray(loss_mask, dtype=bool), 0
        for sample, n in zip(samples, seq_lens):
            h, generated = hits[:, a:a + int(n)], loss_mask[a:a + int(n)]
            first = first_turn_mask(generated)
            row = []
            for k, total in totals.counts.items():
                first_counts = replay_sample(h, first, k, self.max_new_tokens)
                total.add(first_counts).add(replay_sample(h, generated & ~first, k, self.max_new_tokens))
                row += [first_counts.rounds, *first_counts.accepted_per_pos]
            self.table[self.row_of[sample]] = row
            a += int(n)

    def report(self, sample_ids: list[str]) -> dict:
        """{"sample_ids": [...], "counts": {"k": [[rounds, accepted per position...] per sample]}}."""
        counts, col = {}, 0
        for k in range(1, self.steps + 1):
            counts[str(k)] = [[int(round(v)) for v in row[col:col + 1 + k]] for row in self.table]
            col += 1 + k
        return {"sample_ids": list(sample_ids), "counts": counts}


def evaluate_export(draft_dir, cfg) -> Optional[dict]:
    """evaluate() for an exported draft (any run's train/final, or a published one) on cfg's eval split, in one
    CPU process and fp32: the prediction 04 would log for those weights."""
    from common.core.run_folder import Layout
    from common.model.export import load_exported_draft
    from common.target.loading import load_target_tensors
    from common.train.data import MicroBatchReader

    t = cfg.train
    target = load_target_tensors(cfg.target.model)
    draft = load_exported_draft(draft_dir, embedding=target["embed"].float())
    loss = StepLoss(draft, target["lm_head"].float(), StepSettings.from_train(t))  # fp32, not compiled, no optimizer
    index = HiddenIndex.load(Layout.of(cfg).hidden_index)
    return evaluate(loss, index, MicroBatchReader(index, dtype=torch.float32), cfg, DistEnv())
