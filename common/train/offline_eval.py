"""Stage 04's offline evaluation: teacher-forced accuracy of each TTT step on the eval split, and
the acceptance length vLLM will measure, predicted by replaying its rounds (common.model.acceptance;
docs/design.md#ttt-alignment-and-loss)."""

from __future__ import annotations

from typing import Optional

import torch

from common.model.acceptance import ReplayTotals, product_formula
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
        replay.add_packed_row(out.step_hits.cpu().numpy(), mb.loss_mask.reshape(-1).cpu().numpy(), mb.seq_lens)
        den = out.denominator
        sums.add(weighted_loss=float(out.loss) * den, denominator=den,
                 weighted_step_losses=[x * den for x in out.step_losses], step_correct=out.step_correct,
                 step_counts=out.step_counts)
    model.train(was_training)
    totals = sums.all_reduced(env)
    replay.load_list(all_reduce_sum(torch.tensor(replay.to_list(), dtype=torch.float64), env).tolist())
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
    }


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
