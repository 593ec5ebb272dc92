"""04's reporting: the logging window (summed over ranks once per line), metrics.jsonl, TensorBoard, the progress
bar, the evals on the eval split and the best checkpoint (the best replayed acceptance length at 05's k).

A checkpoint carries what a resumed run needs to write the very lines an uninterrupted run writes: the partial
window of each rank (rank_state) and the best so far (docs/design.md#resume-rules).
"""

from __future__ import annotations

from typing import Callable, Optional

from tqdm import tqdm

from common.core.distributed import DistEnv, NamedSums, on_rank0
from common.core.io import JsonlAppender, atomic_write_json
from common.core.run_folder import Layout
from common.model.acceptance import describe as describe_acceptance
from common.train.offline_eval import evaluate
from common.train.tensorboard import TensorBoard


class Progress:
    def __init__(self, cfg, env: DistEnv, layout: Layout, ttt_steps: int, say: Callable[[str], None]):
        self.cfg, self.env, self.layout, self.K, self.say = cfg, env, layout, ttt_steps, say
        K = ttt_steps  # the layout of checkpointed log windows: keep the order
        self.window = NamedSums(loss=1, tokens=1, step_losses=K, step_correct=K, step_counts=K)
        self.window_steps, self.window_time = 0, 0.0
        self.last_train_loss = float("nan")
        self.last_eval: Optional[dict] = None
        self.best: Optional[dict] = None  # the checkpoint with the best replayed acceptance length so far
        # printed: the served k (05's) and all steps; eval_report.json has every k = 1..ttt_steps
        self.best_k = min(cfg.evaluate.num_speculative_tokens, ttt_steps)
        self.shown_ks = sorted({self.best_k, ttt_steps})
        self.metrics = self.tb = self.bar = None

    def open(self, step: int, total_steps: int) -> None:
        """metrics.jsonl, TensorBoard and the bar, from `step` on (rank 0 writes; the others keep the window)."""
        main = self.env.is_main
        self.metrics = JsonlAppender(self.layout.metrics, fsync_every=1) if main else None
        self.tb = TensorBoard(self.layout.tensorboard, main, purge_step=step + 1 if step else None)
        self.bar = tqdm(total=total_steps, initial=step, disable=not main, dynamic_ncols=True, desc="04_train")

    def close(self) -> None:
        """Close the bar, metrics.jsonl and TensorBoard; after a failure (e.g. a full disk) do it quietly, so
        that the error is the last line the user sees."""
        for closer in (getattr(self.bar, "close", None), getattr(self.metrics, "close", None), getattr(self.tb, "close", None)):
            try:
                if closer is not None:
                    closer()
            except Exception:
                pass

    # -- training lines --------------------------------------------------------------------

    def add_step(self, outputs, seconds: float) -> None:
        """One optimizer step's micro-batch outputs ((out, is_real, tokens), common.train.step) into the window."""
        for out, is_real, tokens in outputs:
            if is_real:
                self.window.add(loss=float(out.loss.detach()), tokens=tokens, step_losses=out.step_losses,
                                step_correct=out.step_correct, step_counts=out.step_counts)
        self.window_steps += 1
        self.window_time += seconds
        self.bar.update(1)

    def log(self, step: int, epoch: float, lr: float, grad_norm, anchor_loss, tokens_seen: int, elapsed: float) -> None:
        """One metrics line: means over the steps since the last line, summed over ranks."""
        w = self.window.all_reduced(self.env)
        n = max(1, self.window_steps)
        tok_s = float(w["tokens"]) / max(1e-9, self.window_time)  # training time only (no eval/checkpoint)
        acc = [float(c) / max(1.0, float(m)) for c, m in zip(w["step_correct"], w["step_counts"])]
        self.last_train_loss = float(w["loss"]) / n
        self.window.zero_()
        self.window_steps, self.window_time = 0, 0.0
        row = {
            "type": "train", "step": step, "epoch": round(epoch, 4), "loss": self.last_train_loss,
            "step_losses": [float(x) / n for x in w["step_losses"]], "step_acc": acc, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tok_s, "tokens": tokens_seen, "elapsed_s": elapsed,
        }
        if self.cfg.train.anchor_weight > 0:  # the L2-SP term at this step's weights (not in "loss": that stays the TTT loss)
            row["anchor_loss"] = anchor_loss
        if self.env.is_main:
            self.metrics.write(row)
            self.tb.scalars(step, {"train/loss": row["loss"], "train/lr": lr, "train/grad_norm": grad_norm,
                                   **({"train/anchor_loss": row["anchor_loss"]} if "anchor_loss" in row else {}),
                                   "train/tokens_per_s": tok_s, **{f"train/acc_{i}": a for i, a in enumerate(acc)}})
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{acc[0]:.3f}", tok_s=f"{tok_s:.0f}")

    # -- evals and the best checkpoint -----------------------------------------------------

    def evaluate(self, loss, index, reader, step: int) -> Optional[dict]:
        """The offline eval (common.train.offline_eval) through the training step's loss, logged at `step`."""
        report = evaluate(loss, index, reader, self.cfg, self.env)
        if report is None:
            return None
        report = {"type": "eval", "step": step, **report}
        self.last_eval = report
        if self.env.is_main:
            # the per-sample first-turn table grows with the eval split: eval_report.json and prediction.json keep it,
            # one line per eval in metrics.jsonl does not
            self.metrics.write({k: v for k, v in report.items() if k != "replay_first_turn"})
            atomic_write_json(self.layout.train_eval_report, report)
            self.tb.scalars(step, {"eval/loss": report["loss"], **{f"eval/acc_{i}": a for i, a in enumerate(report["step_acc"])},
                                   **{f"eval/tau_{k}": v for k, v in report["tau"].items()},
                                   **{f"eval/replay_al_{k}": r["acceptance_length"] for k, r in report["replay"].items()}})
            self.bar.write(f"eval @ step {step}: accuracy per TTT step {[round(a, 3) for a in report['step_acc']]}; "
                           f"{describe_acceptance(report, self.shown_ks)}")
        return report

    def update_best(self, report: Optional[dict], step: int, last_step: int) -> bool:
        """Whether this eval is a new best (strictly higher replayed acceptance length at best_k; the same answer
        on every rank: the report is all-reduced). The step is then checkpointed and kept."""
        if report is None:
            return False
        k = str(self.best_k)
        al = float(report["replay"][k]["acceptance_length"])
        if self.best is not None and al <= self.best["acceptance_length"]:
            return False
        self.best = {"step": step, "k": self.best_k, "acceptance_length": al, "metric": f"eval/replay_al_{k}",
                     "eval_loss": report["loss"], "step_acc": report["step_acc"]}
        if self.env.is_main and step != last_step:
            self.bar.write(f"eval @ step {step}: new best replayed acceptance length {al:.3f} at k={k}: checkpointed")
        return True

    def eval_at(self, step: int) -> Optional[dict]:
        """The eval of this very step (what predicts the weights of that step), or None when none ran at it."""
        return self.last_eval if self.last_eval is not None and self.last_eval.get("step") == step else None

    def describe_last_eval(self) -> str:
        return describe_acceptance(self.last_eval or {}, self.shown_ks)

    # -- checkpointed state ----------------------------------------------------------------

    def rank_state(self) -> dict:
        return {"log_window": self.window.flat.clone(), "window_steps": self.window_steps, "window_time": self.window_time}

    def resume(self, state: dict) -> None:
        """A checkpoint's window (this rank's), last loss, its step's eval and best."""
        self.last_train_loss = float(state.get("last_train_loss", float("nan")))
        self.last_eval = state.get("eval")  # a run resumed at its last step exports with this eval's prediction
        rank_state = state["rank_state"]
        saved_k = state["ttt_steps"]
        if saved_k != self.K:  # the weights do not depend on it: train on with the new number of TTT steps
            self.say(f"04_train: note: the checkpoint trained with train.ttt_steps={saved_k}, this run uses {self.K}; "
                     f"the loss from here on is over {self.K} steps")
        elif state.get("world_size") == self.env.world_size and "log_window" in rank_state:
            # continue the interrupted run's partial logging window: identical metrics lines
            self.window.load_flat(rank_state["log_window"])
            self.window_steps, self.window_time = int(rank_state["window_steps"]), float(rank_state["window_time"])
        self.best = self.resumed_best(state.get("best"))

    def resumed_best(self, best: Optional[dict]) -> Optional[dict]:
        """The checkpoint's record of the best checkpoint, if it is still usable: same k, and its checkpoint on disk
        (pruning keeps it; a damaged one is forgotten with a note)."""
        if not best:
            return None
        if int(best.get("k", -1)) != self.best_k:
            self.say(f"04_train: note: the best checkpoint so far (step {best['step']}) was chosen at k={best.get('k')}; "
                     f"evaluate.num_speculative_tokens now asks k={self.best_k}: the best is chosen again from the next eval")
            return None
        path = self.layout.checkpoint(int(best["step"]))
        # cheap here (04 checks its files against the manifest when it exports train/best)
        problem = on_rank0(lambda: None if (path / "model.safetensors").is_file() else "missing", self.env)
        if problem is not None:
            self.say(f"04_train: note: the best checkpoint so far, {path}, is {problem}; the best is chosen again "
                     f"from the next eval")
            return None
        return best

