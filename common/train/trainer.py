"""Stage 04: train the EAGLE-3 draft head on extracted hidden states.

Reads hidden/ (common.train.data), the vocab map (common.vocab.vocab_map) and the target's embedding
(frozen, inside the draft) and lm_head (the teacher: on the device, never trained or saved). Writes
under run_dir/train/: checkpoints/step-N/ (common.train.checkpoint), metrics.jsonl, tb/ (TensorBoard, if
installed), eval_report.json, final/ (the vLLM-loadable draft, common.train.export) and best/ (the
checkpoint with the best replayed acceptance length at evaluate.num_speculative_tokens, exported the
same way, with best.json); each export with prediction.json, the eval at its step (what 05 compares with
vLLM). Before loading anything it prints its memory plan and refuses to start when it cannot fit
(common.train.memory_plan). Formats:
docs/design.md#artifact-formats; the loss: docs/design.md#ttt-alignment-and-loss.

Runs:
    python 04_train.py --config configs/run.yaml                      # 1 process (CPU or 1 GPU)
    torchrun --nproc_per_node 8 04_train.py --config configs/run.yaml   # 8 GPUs, one node
    # several nodes (run on every node; HOST = node 0; needs a shared filesystem for run_dir):
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        --rdzv_id eagle3 04_train.py --config configs/run.yaml

Parallelism. train.parallel = "ddp" (default) or "fsdp" (FSDP2; common.core.distributed.wrap_parallel).
Checkpoints hold full (unsharded) state dicts, so a run can resume with another world size or the
other parallel mode.

Batches. Micro-batches are packed rows of at most train.batch_max_tokens tokens; one optimizer
step uses world_size * grad_accum of them (see common.train.data for the order). Each
micro-batch loss is divided by the position count of the whole global step, so one process
with grad_accum=2 computes the same update as two processes with grad_accum=1.
total steps = train.max_steps, or sum over epochs of ceil(micro-batches / (world * grad_accum)).

Resume. The latest complete checkpoint is picked up automatically; a resumed run continues
exactly (on CPU the final weights equal an uninterrupted run's bit for bit). --overwrite
starts over. A run whose train/final is complete for the configured number of steps exits 0
(docs/design.md#resume-rules).
"""

from __future__ import annotations

import dataclasses
import errno
import random
import shutil
import time

import numpy as np
import torch

from common.core.distributed import DistEnv, barrier, close_distributed, init_distributed, on_rank0
from common.core.errors import ConfigError, DataError, PipelineError
from common.core.io import format_bytes, read_json
from common.core.run_folder import Layout
from common.model.draft import choose_attention
from common.model.draft_vocab import load_vocab_map
from common.target.loading import load_target_info, load_target_tensors
from common.train.checkpoint import load_latest, save_checkpoint, truncate_metrics
from common.train.data import DataPosition
from common.train.export import export_best, export_final, prediction_record
from common.train.init_from import InitDraft, draft_family_for
from common.train.ledger import LEDGER_FILE
from common.train.memory_plan import check_fits, gpu_capacity, plan_for_capacity
from common.train.optim import lr_at
from common.train.preflight import check_target, decide_outputs, resolve_precision, run_fingerprint, train_manifest
from common.train.progress import Progress
from common.train.source import TrainSource
from common.train.step import StepSettings, build_step, resolve_compile


def run_training(cfg, overwrite: bool = False) -> int:
    env = init_distributed()
    try:
        code = Trainer(cfg, env).run(overwrite)
        # every rank leaves together: a gloo rank whose peer has already torn down its connections can
        # abort at exit ("terminate called without an active exception", seen once in 2-rank rounds runs)
        barrier(env)
        return code
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise PipelineError(f"cannot write under {Layout.of(cfg).train}: {e.strerror}; free disk space and rerun: "
                                f"training resumes from the last complete checkpoint") from None
        raise
    finally:
        close_distributed(env)


class Trainer:
    """One training run: inputs -> model -> (resume) -> steps with logging, eval, checkpoints -> export."""

    def __init__(self, cfg, env: DistEnv):
        self.cfg, self.env, self.t = cfg, env, cfg.train
        self.layout = layout = Layout.of(cfg)
        # draft.architecture, checked before any input is read (streaming may wait for 02); with train.init_from the
        # init's architecture decides, once it is read
        self.family = None if cfg.train.init_from else draft_family_for(cfg)
        # Inputs, checked before anything is written: the hidden states (and under a disk budget 02's rounds,
        # streaming: waiting for 02), the target they came from, the vocab map, train.init_from.
        self.source = source = TrainSource(cfg, env, self.say)
        self.info = load_target_info(cfg.target)
        self.target_id = check_target(cfg, source.index, self.info, layout, env)
        self.d2t, self.t2d = load_vocab_map(layout.vocab_map, self.info.vocab_size, cfg.vocab.draft_vocab_size)
        source.remember_inputs()
        # train.init_from: the init's architecture and the vocab map of train.init_vocab (common.train.init_from)
        self.init = InitDraft.read(cfg, self.info, source.index.aux_layer_ids, self.d2t, self.t2d, layout, env) \
            if cfg.train.init_from else None
        self.family = self.family or draft_family_for(cfg, self.init)  # what is built, trained and exported
        if self.init is not None:
            self.d2t, self.t2d, self.draft_cfg = self.init.d2t, self.init.t2d, self.init.draft_cfg
        else:
            self.draft_cfg = self.family.build_config(cfg, self.info, self.d2t.numel(), source.index.aux_layer_ids)

        self.dtype = resolve_precision(cfg, env.device)
        self.on_gpu = env.device.type == "cuda"
        source.open(self.dtype, pin_memory=self.on_gpu)
        self.data = source.data
        self.total_steps = source.total_steps()
        self.fingerprint = run_fingerprint(self.draft_cfg, source.identity(), self.d2t, self.t, self.init)
        self.K = self.t.ttt_steps
        self.memory_plan, self.replan = self.plan_memory()
        self.progress = Progress(cfg, env, layout, self.K, self.say)

    def plan_memory(self):
        """04's peak memory per GPU, estimated before anything is loaded (common.train.memory_plan), and the
        function that re-plans it with other settings (for the error's suggestions)."""
        tc = self.info.text_config
        dtype = str(getattr(tc, "torch_dtype", None) or getattr(tc, "dtype", None) or "")  # the embedding's, before loading
        kw = dict(world_size=self.env.world_size, device_type=self.env.device.type, embed_bf16="bfloat16" in dtype,
                  max_sample_len=max(self.source.sample_lengths(), default=self.cfg.tokenize.max_seq_len))
        self.capacity = gpu_capacity(self.cfg, self.env.device)
        return plan_for_capacity(self.draft_cfg, self.t, self.capacity, **kw)

    def say(self, *args) -> None:
        if self.env.is_main:
            print(*args, flush=True)

    # -- setup ----------------------------------------------------------------------------

    def check_can_train(self) -> None:
        """The refusals that need no model: the memory plan (printed) against the GPU, the shards' files."""
        capacity = self.capacity
        self.say(f"04_train: memory plan: {self.memory_plan.describe()}"
                 + (f"; GPU capacity {format_bytes(capacity)}" if capacity is not None else ""))
        check_fits(self.memory_plan, capacity, self.replan)
        self.source.verify_loaded()

    def check_outputs(self, overwrite: bool) -> str:
        """"complete", "resume" or "fresh" (common.train.preflight.decide_outputs; rank 0 decides, and alone
        holds train/'s manifest: it alone writes under train/)."""
        def decide() -> str:
            self.manifest = train_manifest(self.layout, self.source.plan.budgeted, self.target_id, self.draft_cfg,
                                           self.t, self.init)
            return decide_outputs(self.manifest, overwrite, self.total_steps, self.t.max_steps, self.source.restart_rounds)

        return on_rank0(decide, self.env)

    def build_model(self, target: dict) -> None:
        """Draft (seeded: every rank builds the same weights), teacher lm_head (of `target`), and the training step
        over them (common.train.step.build_step: the loss, the parallel wrapper, AdamW)."""
        t, env = self.t, self.env
        torch.manual_seed(t.seed)
        random.seed(t.seed + env.rank)
        np.random.seed(t.seed + env.rank)
        if not self.on_gpu:
            torch.use_deterministic_algorithms(True, warn_only=True)
        d = self.draft_cfg
        attention, attention_why = choose_attention(t.attention_impl, d.num_attention_heads, d.num_key_value_heads, d.head_dim, env.device,
                                                   d.value_head_dim)
        draft = self.family.build(d, attention=attention,
                                  gradient_checkpointing=self.memory_plan.setting["gradient_checkpointing"])  # as planned (null: auto)
        draft.load_target_embedding(target["embed"].float())
        if self.on_gpu and self.dtype == torch.bfloat16 and target["embed"].dtype == torch.bfloat16:
            draft.embedding.to(torch.bfloat16)  # frozen and bf16 in the target anyway: same values, half the memory
        draft.set_vocab_map(self.d2t, self.t2d)
        if t.init_lm_head == "target":  # start from the target's own head, restricted to the draft vocab
            with torch.no_grad():
                draft.head_weight.copy_(target["lm_head"][draft.draft_vocab_target_ids()].float())
        if self.init is not None:  # its weights over these (a resume then loads its checkpoint over them)
            self.say(self.init.load_into(draft))
        draft.to(env.device)
        self.draft = draft  # the fp32 master weights: what the optimizer updates, checkpoints and exports hold
        # The teacher's lm_head: on the device, in the compute dtype; not trained, not saved.
        self.lm_head = target["lm_head"].to(env.device, dtype=self.dtype)
        del target
        self.n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
        compile_on, compile_why = resolve_compile(t.compile, env.device)
        self.step_fn = build_step(draft, self.lm_head, StepSettings.from_train(t, self.dtype, compile_on), env,
                                  self.family.fsdp_unit_classes)
        self.model, self.optimizer = self.step_fn.model, self.step_fn.optimizer
        if t.anchor_weight > 0:  # L2-SP towards the init's weights, which the draft holds now (not saved: re-read on resume)
            self.step_fn.set_anchor()
        self.say(f"04_train: step: attention {draft.attention_impl} ({attention_why}), torch.compile "
                 f"{'on' if compile_on else 'off'} ({compile_why}), {self.step_fn.loss.describe_precision()}")

    def init_state(self) -> None:
        """Fresh counters, or the latest complete checkpoint's."""
        self.step, self.pos = 0, DataPosition()
        self.tokens_seen, self.elapsed_before = 0, 0.0
        self.grad_norm = self.anchor_loss = self.lr = None
        latest = load_latest(self.layout, self.draft, self.optimizer, self.env)  # skips damaged ones
        self.step_fn.loss.refresh()  # the compute copy (bf16) follows the loaded master weights
        if latest is None:
            self.source.start(self.pos)
        else:
            self.resume(*latest)
        if self.env.is_main:
            dropped = truncate_metrics(self.layout.metrics, self.step)
            if dropped:
                self.say(f"04_train: dropped {dropped} metrics lines after step {self.step} (they are recomputed)")
            report = self.layout.train_eval_report
            if report.is_file() and read_json(report).get("step") == self.step:
                self.progress.last_eval = read_json(report)
        barrier(self.env)

    def resume(self, path, state: dict) -> None:
        """The checkpoint's step, data position, ledger and logging state, checked against this run."""
        if state.get("fingerprint") != self.fingerprint:
            raise ConfigError(
                f"checkpoint {path} was made with another draft architecture, data set or packing (draft.*, hidden/, "
                f"vocab/, train.init_from, train.init_vocab, train.batch_max_tokens or train.seed changed); rerun with "
                f"--overwrite to start over")
        self.step, self.pos = int(state["step"]), DataPosition.from_dict(state["data_position"])
        if self.step > self.total_steps:
            raise ConfigError(
                f"the latest checkpoint {path} is at step {self.step}, past the {self.total_steps} steps this config "
                f"trains (train.max_steps={self.t.max_steps}); raise train.max_steps to at least {self.step} to go on "
                f"from it, or rerun with --overwrite to train {self.total_steps} steps from scratch")
        self.source.start(self.pos, state.get("ledger"), path)
        self.tokens_seen, self.elapsed_before = int(state["tokens_seen"]), float(state["elapsed_s"])
        self.progress.resume(state)
        self.say(f"04_train: resuming from {path} (step {self.step}/{self.total_steps}, "
                 f"{self.source.describe_position(self.pos)})")
        if state.get("global_micro_batches") != self.data.micro_per_step:
            self.say(f"04_train: note: the global batch changed from {state.get('global_micro_batches')} to "
                     f"{self.data.micro_per_step} micro-batches per step")

    # -- the loop -------------------------------------------------------------------------

    def run(self, overwrite: bool) -> int:
        env, t = self.env, self.t
        target = None
        if overwrite:  # every refusal comes before --overwrite deletes train/ (it may hold a finished draft)
            self.check_can_train()
            target = load_target_tensors(self.cfg.target.model)  # the target's tensors load, too
        status = self.check_outputs(overwrite)
        if status == "complete":
            self.say(f"04_train: already complete ({self.total_steps} steps, draft in {self.layout.final}); nothing to do "
                     f"(use --overwrite to retrain)")
            if env.is_main:
                self.manifest.record("already_complete")
            return 0
        if not overwrite:
            self.check_can_train()
        if env.is_main:
            self.layout.train.mkdir(parents=True, exist_ok=True)
            for stale in self.layout.checkpoint_tmps():
                shutil.rmtree(stale, ignore_errors=True)
        barrier(env)

        self.build_model(target if target is not None else load_target_tensors(self.cfg.target.model))
        del target  # build_model kept what it needs (the teacher lm_head on the device)
        self.init_state()
        self.say(
            f"04_train: draft {self.n_params / 1e6:.2f}M trainable params (hidden {self.draft_cfg.hidden_size}, "
            f"V_d {self.draft_cfg.draft_vocab_size}), {len(self.data.samples)} train samples / {self.data.num_tokens} tokens, "
            f"{env.world_size} process(es) x grad_accum {t.grad_accum}, {self.total_steps} steps, "
            f"{str(self.dtype).replace('torch.', '')} on {env.device.type}, parallel={t.parallel if env.distributed else 'none'}"
        )
        self.progress.open(self.step, self.total_steps)
        self.t_start = time.time()
        self.source.reconcile(self.pos)
        self.model.train()
        try:
            while self.step < self.total_steps:
                batch = self.source.next_batch(self.pos, self.total_steps - self.step)
                if batch is None:  # under a disk budget: 02 extracts the next round first
                    return self.stop_for_next_round()
                self.train_step(batch)
                done = self.step == self.total_steps
                if self.step % t.log_every == 0 or done:
                    self.progress.log(self.step, self.data.epochs_done(self.pos), self.lr, self.grad_norm, self.anchor_loss,
                                      self.tokens_seen, self.elapsed())
                eval_due = (t.eval_every > 0 and self.step % t.eval_every == 0) or done
                save_due = self.step % t.checkpoint_every == 0 or done or batch.frees_round
                if eval_due or save_due or batch.ends_round:
                    self.check_inputs_unchanged()  # before anything is saved, chosen as best or exported
                new_best = False
                if eval_due:
                    report = self.progress.evaluate(self.step_fn.loss, self.source.index, self.data.reader, self.step)
                    new_best = self.progress.update_best(report, self.step, self.total_steps)
                # a new best is checkpointed at its step, whatever checkpoint_every says (docs/design.md#resume-rules)
                if save_due or new_best:
                    self.save()  # before a round's shards are deleted: a resume never needs them again
                if batch.frees_round:
                    self.source.round_trained(batch.pos.round)
            self.progress.bar.close()
            self.finish()
            if env.is_main:
                self.manifest.complete({"steps": self.step})  # last: train/final is whole
        finally:
            self.progress.close()
        return 0

    def train_step(self, batch) -> None:
        """One optimizer step on `batch` (common.train.source.StepBatch)."""
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.total_steps, self.t)
        self.tokens_seen += batch.tokens
        micro_batches = ((mb.to(self.env.device, non_blocking=self.on_gpu), real) for mb, real in batch.micro_batches)
        result = self.step_fn.run(micro_batches, batch.count, batch.denominator, lr)
        self.grad_norm, self.anchor_loss = result.grad_norm, result.anchor_loss
        if not result.applied:  # a non-finite gradient, the same on every rank (the gradients are all-reduced)
            raise self.diverged(lr)
        self.source.record_step(batch.pos)
        self.lr = lr
        self.step += 1
        self.pos = batch.next_pos
        self.progress.add_step(result.outputs, time.perf_counter() - t0)

    def diverged(self, lr: float) -> PipelineError:
        """The error for a non-finite gradient: nothing of this step is applied, saved or exported."""
        t = self.t
        kept = self.layout.checkpoint_dirs()
        where = (f"the last good checkpoint, {kept[-1][1]}, is kept: rerun 04 to resume from it" if kept
                 else "no checkpoint was written yet: rerun 04 to start over")
        return PipelineError(
            f"training diverged at step {self.step + 1}/{self.total_steps}: the gradient norm is {self.grad_norm} "
            f"(lr {lr:.3g}); nothing was exported and train/final is untouched; lower train.lr (now {t.lr:g}) or set "
            f"train.grad_clip (now {t.grad_clip:g}), then {where} (or use --overwrite)")

    def check_inputs_unchanged(self) -> None:
        """Stop without saving or exporting when hidden/ or vocab/ changed since this run started (another
        stage rewrote them): the steps since the last check trained on two generations of inputs."""
        changed = self.source.changed_inputs()
        if not changed:
            return
        kept = self.layout.checkpoint_dirs()
        last = f"the last checkpoint, {kept[-1][1]}, was saved before the change" if kept else "no checkpoint was saved"
        raise DataError(
            f"{', '.join(changed)} changed while 04 was training (did 02 or 03 rewrite them?): stopped at step "
            f"{self.step}/{self.total_steps} without saving or exporting anything from the mixed inputs; {last}. Rerun "
            f"04 once they are final: it resumes when they are the same data, else asks for --overwrite")

    def stop_for_next_round(self) -> int:
        """Under a disk budget: the next round is not on disk yet. Its checkpoint is saved; 02 extracts it next."""
        self.say(self.source.not_extracted_line(self.pos, self.step, self.total_steps))
        if self.env.is_main:
            self.manifest.partial({"steps": self.step}, outcome="round_done")
        return 0

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t_start

    def save(self) -> None:
        p = self.progress
        if self.env.is_main:
            p.metrics.sync()  # lines up to this step are on disk before the checkpoint that vouches for them
        state = {
            "step": self.step, "total_steps": self.total_steps, "data_position": self.pos.to_dict(),
            "fingerprint": self.fingerprint, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed(),
            "world_size": self.env.world_size, "grad_accum": self.t.grad_accum,
            "global_micro_batches": self.data.micro_per_step, "last_train_loss": p.last_train_loss,
            "ttt_steps": self.K, "best": p.best,
            "eval": p.eval_at(self.step),  # the prediction of these weights, should they be exported as train/best
        }
        save_checkpoint(self.layout, self.step, self.draft, self.optimizer, state, self.env, self.t.keep_checkpoints,
                        p.rank_state(), files={LEDGER_FILE: self.source.ledger.to_json()})

    def finish(self) -> None:
        p, ledger, index = self.progress, self.source.ledger, self.source.index
        elapsed = self.elapsed()
        summary = {
            "step": self.step, "total_steps": self.total_steps, "tokens": self.tokens_seen, "elapsed_s": elapsed,
            "tokens_per_s": self.tokens_seen / max(1e-9, elapsed), "final_train_loss": p.last_train_loss,
            "eval": p.last_eval, "world_size": self.env.world_size, "grad_accum": self.t.grad_accum,
            "parallel": self.t.parallel if self.env.distributed else "none", "trainable_params": self.n_params,
            "aux_layer_ids": index.aux_layer_ids, "draft_config": dataclasses.asdict(self.draft_cfg),
            "ledger": ledger.summary(), "best": p.best,
            "init_from": self.init and {"path": str(self.init.path), "vocab": self.init.mode, "fingerprint": self.init.fingerprint,
                                        "anchor_weight": self.t.anchor_weight},
            "config": self.cfg.to_dict(),
        }
        prediction = prediction_record(self.step, p.best_k, p.eval_at(self.step), self.why_no_final_eval())
        export_final(self.t.parallel, self.env, self.draft, self.draft_cfg, index, self.layout, summary, prediction)
        best_line = export_best(self.env, self.draft_cfg, index, self.layout, p.best, self.step)
        barrier(self.env)
        if self.env.is_main:
            self.say(f"04_train: {best_line}")
            self.say(f"04_train: {ledger.describe()}")
            self.say(f"04_train: done: {self.step} steps, {self.tokens_seen} tokens in {elapsed:.0f}s "
                     f"({self.tokens_seen / max(1e-9, elapsed):.0f} tok/s), final loss {p.last_train_loss:.4f}; "
                     f"{p.describe_last_eval()}; draft in {self.layout.final}")

    def why_no_final_eval(self) -> str:
        """Why train/final's prediction.json holds no eval: 04 evaluates at the last step whatever train.eval_every
        says (and a checkpoint records its step's eval), so only a run without an eval split has none."""
        return ("this run has no eval split (hidden/index.json lists no eval samples); set data.eval_fraction > 0 "
                "and rerun from 01_prepare_data.py for a prediction")
