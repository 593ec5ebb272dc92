"""Stage 04: train the EAGLE-3 draft head on extracted hidden states.

Reads hidden/ (common.train.data), the vocab map (common.vocab.vocab_map) and the target's embedding
(frozen, inside the draft) and lm_head (the teacher: on the device, never trained or saved). Writes
under run_dir/train/: checkpoints/step-N/ (common.train.checkpoint), metrics.jsonl, tb/ (TensorBoard, if
installed), eval_report.json, final/ (the vLLM-loadable draft, common.train.export) and best/ (the
checkpoint with the best replayed acceptance length at evaluate.num_speculative_tokens, exported the
same way, with best.json). Before loading anything it prints its memory plan and refuses to start when
it cannot fit (common.train.memory_plan). Formats:
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
import hashlib
import json
import random
import shutil
import time
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from common.model.acceptance import describe as describe_acceptance
from common.train.checkpoint import clean_train_dir, load_latest, save_checkpoint, truncate_metrics
from common.core.distributed import (DistEnv, NamedSums, barrier, broadcast_object, close_distributed, init_distributed,
                                     on_rank0, wrap_parallel)
from common.train.offline_eval import evaluate
from common.model.draft import Eagle3DraftModel, build_draft_config
from common.model.draft_vocab import load_vocab_map
from common.core.errors import ConfigError, DataError, PipelineError
from common.train.export import export_best, export_final
from common.core.io import JsonlAppender, atomic_write_json, file_sha256, format_bytes, read_json
from common.target.loading import check_safetensors_readable, load_target_info, load_target_tensors, target_fingerprint
from common.train.optim import build_optimizer, lr_at
from common.core.run_folder import Layout, StageManifest, read_manifest
from common.train.tensorboard import TensorBoard
from common.train.data import DataPosition, Round, TrainData
from common.train.ledger import LEDGER_FILE, SampleLedger
from common.hidden.stream import StreamWait
from common.hidden.shards import (INDEX_SHARD_FIELDS, HiddenIndex, load_plan_rounds, read_consumed, read_entries, round_files, verify_shard_files,
                                  write_consumed)
from common.train.step import StepSettings, TrainStep, resolve_attention, resolve_compile
from common.train.init_from import InitDraft
from common.train.memory_plan import check_fits, gpu_capacity, plan_for_capacity


# ---------------------------------------------------------------------------------------
# Precision


def resolve_precision(cfg, device: torch.device) -> torch.dtype:
    """The compute dtype: train.precision "auto" = bf16 on GPU, fp32 on CPU (the master weights stay fp32;
    common.train.step)."""
    p = cfg.train.precision
    if p == "auto":
        p = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if p == "bf16" else torch.float32


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# The run


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

        # Inputs, validated before anything is written. Rounds mode (02 planned rounds under
        # extract.max_disk_gb): the index holds the round on disk; open_round() moves to the next.
        self.stream = cfg.extract.stream
        self.wait = StreamWait("04_train", "02_extract_hidden", [layout.hidden_index, layout.hidden_plan,
                               layout.manifest("02_extract_hidden")], cfg.extract.stream_wait_minutes, self.say)
        if self.stream:
            self.wait_for_extraction()
        self.plan = load_plan_rounds(layout.hidden_plan)
        if self.plan is not None:
            self.check_plan_is_02s()
        self.round_loaded: Optional[int] = None  # rounds mode: the round whose shards self.index holds
        self.index = HiddenIndex.load(layout.hidden_index, self.first_files_on_disk() if self.plan else None)
        self.info = load_target_info(cfg.target)
        if list(self.info.aux_layer_ids) != list(self.index.aux_layer_ids):
            raise ConfigError(
                f"the hidden states in {layout.hidden} were extracted at aux layers {self.index.aux_layer_ids} but the "
                f"config resolves target.aux_layer_ids to {self.info.aux_layer_ids}; rerun 02_extract_hidden.py --overwrite "
                f"(or fix target.aux_layer_ids)"
            )
        recorded = self.index.raw.get("target_weights")  # rank 0 hashes (cached by size and mtime), the others get it
        if recorded:
            check_safetensors_readable(cfg.target.model)  # a damaged file is named as such, not as "other weights"
        current = on_rank0(lambda: target_fingerprint(layout, cfg.target.model), env)
        # the target as 04's outputs depend on it: its content (the same weights at another path are the
        # same target), or the hub id when it is not a local folder
        self.target_id = current or cfg.target.model
        if recorded and recorded != current:
            raise DataError(
                f"the hidden states in {layout.hidden} were extracted from other target weights than those in "
                f"target.model {cfg.target.model} now (config.json or *.safetensors changed since 02 ran); training "
                f"on them would teach the draft a target that no longer exists: rerun 02_extract_hidden.py --overwrite, "
                f"or restore the weights")
        if self.index.target_hidden_size != self.info.hidden_size:
            raise DataError(
                f"hidden states have width {self.index.target_hidden_size} but target.model has hidden size "
                f"{self.info.hidden_size}; they come from another model: rerun 02_extract_hidden.py --overwrite"
            )
        self.d2t, self.t2d = load_vocab_map(layout.vocab_map, self.info.vocab_size, cfg.vocab.draft_vocab_size)
        self.inputs_at_start = on_rank0(self.inputs_identity, env)
        # train.init_from: the init's architecture and the vocab map of train.init_vocab (common.train.init_from)
        self.init = InitDraft.read(cfg, self.info, self.index.aux_layer_ids, self.d2t, self.t2d, layout, env) \
            if cfg.train.init_from else None
        if self.init is not None:
            self.d2t, self.t2d, self.draft_cfg = self.init.d2t, self.init.t2d, self.init.draft_cfg
        else:
            self.draft_cfg = build_draft_config(cfg, self.info, self.d2t.numel(), self.index.aux_layer_ids)

        self.dtype = resolve_precision(cfg, env.device)
        self.on_gpu = env.device.type == "cuda"
        t = self.t
        self.data = TrainData(self.index, t.batch_max_tokens, t.seed, world_size=env.world_size, rank=env.rank,
                              grad_accum=t.grad_accum, dtype=self.dtype, num_workers=t.num_workers, pin_memory=self.on_gpu,
                              rounds=self.plan_rounds())
        planned_steps = self.data.total_steps(t.epochs)
        self.total_steps = t.max_steps or planned_steps
        if self.plan is not None and self.total_steps > planned_steps:
            raise ConfigError(
                f"train.max_steps={t.max_steps} is more than the {planned_steps} steps of the {len(self.plan['rounds'])} "
                f"rounds 02 planned for train.epochs={t.epochs}; lower train.max_steps, or raise train.epochs and rerun "
                f"02_extract_hidden.py --overwrite (it plans the rounds again)")
        data_id = self.index.fingerprint() if self.plan is None else [
            self.index.aux_layer_ids, [(r["epoch"], r["shards"], r["num_tokens"]) for r in self.plan["rounds"]]]
        # What a checkpoint must agree with to be resumable (hyper-parameters like lr may change).
        self.fingerprint = fingerprint({
            "draft": dataclasses.asdict(self.draft_cfg), "data": data_id,
            "d2t": hashlib.sha256(self.d2t.numpy().tobytes()).hexdigest(),
            "batch_max_tokens": t.batch_max_tokens, "seed": t.seed,
            **({"init": self.init.identity} if self.init else {}),  # absent without one: older checkpoints still resume
        })
        self.K = t.ttt_steps
        self.memory_plan, self.replan = self.plan_memory()
        # printed: the served k (05's) and all steps; eval_report.json has every k = 1..ttt_steps
        self.shown_ks = sorted({min(cfg.evaluate.num_speculative_tokens, self.K), self.K})

    def check_plan_is_02s(self) -> None:
        """plan.json as 02 wrote it (02 records its sha256): an edited plan would train other rounds than 02
        extracts, or break the disk budget."""
        layout = self.layout
        recorded = ((read_manifest(layout, "02_extract_hidden") or {}).get("result") or {}).get("plan_sha256")
        if recorded and file_sha256(layout.hidden_plan) != recorded:
            raise DataError(f"{layout.hidden_plan} is not the plan 02 made (its sha256 differs from the one in "
                            f"{layout.manifest('02_extract_hidden')}): it was edited or replaced; restore it, or rerun "
                            f"02_extract_hidden.py with --overwrite to plan again")

    def plan_memory(self):
        """04's peak memory per GPU, estimated before anything is loaded (common.train.memory_plan), and
        the function that re-plans it with other settings (for the error's suggestions)."""
        lengths = [s.length for s in self.index.samples]
        if self.plan is not None:
            lengths += [n for s in self.plan["shards"] for n in s.get("lengths", [])]
        tc = self.info.text_config
        dtype = str(getattr(tc, "torch_dtype", None) or getattr(tc, "dtype", None) or "")  # the embedding's, before loading
        kw = dict(world_size=self.env.world_size, device_type=self.env.device.type, embed_bf16="bfloat16" in dtype,
                  max_sample_len=max(lengths, default=self.cfg.tokenize.max_seq_len))
        self.capacity = gpu_capacity(self.cfg, self.env.device)
        return plan_for_capacity(self.draft_cfg, self.t, self.capacity, **kw)

    # -- rounds under a disk budget (docs/design.md#rounds-under-a-disk-budget) ---------------

    def wait_for_extraction(self) -> None:
        """Streaming: 04 may start before 02 has planned or written anything. Every rank waits (on its own:
        what it waits for only ever appears) until plan.json and index.json are there and, in rounds mode,
        the eval shards (02 writes them first); without rounds, until the whole extraction is complete."""
        def ready() -> bool:
            if not (self.layout.hidden_plan.is_file() and self.layout.hidden_index.is_file()):
                return False
            plan = read_json(self.layout.hidden_plan)
            listed = read_entries(self.layout.hidden_index)
            if "rounds" not in plan:
                return bool(read_json(self.layout.hidden_index).get("complete"))
            return all(s["file"] in listed and (self.layout.hidden / s["file"]).is_file()
                       for s in plan["shards"] if s["split"] != "train")

        while not ready():
            self.wait.tick("02_extract_hidden to write hidden/plan.json and the first shards")
        self.wait.reset()

    def plan_rounds(self) -> Optional[list[Round]]:
        if self.plan is None:
            return None
        planned = self.plan["settings"].get("epochs")
        if planned != self.t.epochs:
            raise ConfigError(f"02 planned its rounds for train.epochs={planned} but the config says {self.t.epochs}; set "
                              f"train.epochs back, or rerun 02_extract_hidden.py --overwrite (it plans the rounds again)")
        by_file = {s["file"]: s for s in self.plan["shards"]}
        return [Round(r["epoch"], [sid for f in r["shards"] for sid in by_file[f]["sample_ids"]],
                      [n for f in r["shards"] for n in by_file[f]["lengths"]]) for r in self.plan["rounds"]]

    def round_on_disk(self, r: int, listed: Optional[dict] = None) -> bool:
        """Whether round r's shards (and the eval shards) are all indexed (in `listed`, default: read
        index.json) and on disk."""
        listed = read_entries(self.layout.hidden_index) if listed is None else listed
        return all(f in listed and (self.layout.hidden / f).is_file() for f in round_files(self.plan, r))

    def first_files_on_disk(self) -> list[str]:
        """The files of the first round not consumed that is on disk (else just the eval shards): what the
        trainer starts from before it knows its position."""
        consumed = read_consumed(self.layout.hidden_consumed)
        listed = read_entries(self.layout.hidden_index)  # once, not once per round
        for r in range(len(self.plan["rounds"])):
            if r not in consumed and self.round_on_disk(r, listed):
                self.round_loaded = r
                return round_files(self.plan, r)
        return [s["file"] for s in self.plan["shards"] if s["split"] != "train"]

    def reconcile_rounds(self) -> None:
        """After a resume: rounds before the position are trained (consumed and deleted, even if a kill came
        between the checkpoint and the deletion); rounds from it on are not (a checkpoint that fell back
        past a deleted round has 02 extract it again)."""
        if self.plan is None:
            return
        if self.env.is_main:
            consumed = read_consumed(self.layout.hidden_consumed)
            redo = sorted(r for r in consumed if r >= self.pos.epoch)
            if redo:
                self.say(f"04_train: rounds {[r + 1 for r in redo]} were deleted after a later checkpoint that is gone; "
                         f"02 extracts them again")
            self.consume_rounds(set(range(self.pos.epoch)), keep_out=set(redo))
        barrier(self.env)

    def consume_rounds(self, rounds: set[int], keep_out: set[int] = frozenset()) -> None:
        """Rank 0: record `rounds` as trained (consumed.json, which 02 reads), then delete their shards."""
        consumed = (read_consumed(self.layout.hidden_consumed) | rounds) - set(keep_out)
        write_consumed(self.layout.hidden_consumed, consumed)
        for r in rounds:
            for f in self.plan["rounds"][r]["shards"]:
                (self.layout.hidden / f).unlink(missing_ok=True)

    def open_round(self) -> bool:
        """Make the index hold the round at the position; False when 02 has not extracted it yet
        (streaming: wait for it)."""
        if self.plan is None:
            return True
        r = self.pos.epoch
        if not self.round_ready(r):
            return False
        if self.round_loaded != r:
            self.index = HiddenIndex.load(self.layout.hidden_index, round_files(self.plan, r))
            self.data.use_index(self.index)
            self.round_loaded = r
        verify_shard_files(self.index, self.layout, self.env, self.cfg.extract.verify)
        return True

    def round_ready(self, r: int) -> bool:
        """Whether round r is on disk. Rank 0 decides, so that every rank trains the round or every rank
        waits for it (a rank may have loaded it at the start, another not). Streaming: poll until it is
        there, one broadcast per poll, so no collective waits longer than a poll."""
        while True:
            status = None
            if self.env.is_main:
                try:
                    status = "ready" if self.round_loaded == r or self.round_on_disk(r) else "wait"
                    if status == "wait" and self.stream:
                        rounds = self.plan["rounds"]
                        self.wait.check(f"02_extract_hidden to extract round {r + 1} of {len(rounds)} (epoch "
                                        f"{rounds[r]['epoch'] + 1})")
                except PipelineError as e:
                    status = e
            status = broadcast_object(status, self.env)
            if isinstance(status, Exception):
                raise status
            if status == "ready":
                self.wait.reset()
                return True
            if not self.stream:
                return False
            time.sleep(self.wait.poll_s)

    def steps_to_round_end(self) -> int:
        """Steps the stream may run ahead: to the end of the round on disk (rounds mode), else to the end."""
        if self.plan is None:
            return self.total_steps - self.step
        return min(self.data.steps_left_in_round(self.pos), self.total_steps - self.step)

    def say(self, *args) -> None:
        if self.env.is_main:
            print(*args, flush=True)

    # -- setup ----------------------------------------------------------------------------

    def build_model(self) -> None:
        """Draft (seeded: every rank builds the same weights), teacher lm_head, parallel wrapper, AdamW."""
        t, env = self.t, self.env
        torch.manual_seed(t.seed)
        random.seed(t.seed + env.rank)
        np.random.seed(t.seed + env.rank)
        if not self.on_gpu:
            torch.use_deterministic_algorithms(True, warn_only=True)
        target = load_target_tensors(self.cfg.target.model)
        draft = Eagle3DraftModel(self.draft_cfg)
        draft.load_target_embedding(target["embed"].float())
        if self.on_gpu and self.dtype == torch.bfloat16 and target["embed"].dtype == torch.bfloat16:
            draft.embed_tokens.to(torch.bfloat16)  # frozen and bf16 in the target anyway: same values, half the memory
        draft.set_vocab_map(self.d2t, self.t2d)
        if t.init_lm_head == "target":  # start from the target's own head, restricted to the draft vocab
            with torch.no_grad():
                draft.lm_head.weight.copy_(target["lm_head"][draft.draft_vocab_target_ids()].float())
        if self.init is not None:  # its weights over these (a resume then loads its checkpoint over them)
            self.say(self.init.load_into(draft))
        draft.gradient_checkpointing = self.memory_plan.setting["gradient_checkpointing"]  # as planned (null: auto)
        draft.to(env.device)
        draft.attention_impl, attention_why = resolve_attention(t.attention_impl, draft.config, env.device)
        self.draft = draft  # the fp32 master weights: what the optimizer updates, checkpoints and exports hold
        # The teacher's lm_head: on the device, in the compute dtype; not trained, not saved.
        self.lm_head = target["lm_head"].to(env.device, dtype=self.dtype)
        del target
        self.n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
        compile_on, compile_why = resolve_compile(t.compile, env.device)
        settings = StepSettings(ttt_steps=self.K, loss_decay=t.loss_decay, grad_clip=t.grad_clip, dtype=self.dtype,
                                parallel=t.parallel, compile=compile_on, anchor_weight=t.anchor_weight)
        self.step_fn = TrainStep(draft, self.lm_head,
                                 lambda m: build_optimizer(m, t.lr, t.betas, t.weight_decay, foreach=self.on_gpu), settings,
                                 env, wrap=lambda m: wrap_parallel(m, env, t.parallel, self.dtype))
        self.model, self.optimizer = self.step_fn.model, self.step_fn.optimizer
        if t.anchor_weight > 0:  # L2-SP towards the init's weights, which the draft holds now (not saved: re-read on resume)
            self.step_fn.set_anchor()
        self.say(f"04_train: step: attention {draft.attention_impl} ({attention_why}), torch.compile "
                 f"{'on' if compile_on else 'off'} ({compile_why}), {self.step_fn.describe_precision()}")

    def init_state(self) -> None:
        """Fresh counters, or the latest complete checkpoint's."""
        self.step, self.pos = 0, DataPosition()
        self.tokens_seen, self.elapsed_before, self.last_train_loss = 0, 0.0, float("nan")
        K = self.K  # the layout of checkpointed log windows: keep the order
        self.window = NamedSums(loss=1, tokens=1, step_losses=K, step_correct=K, step_counts=K)
        self.window_steps, self.window_time = 0, 0.0
        self.last_eval = None
        self.best: Optional[dict] = None  # the checkpoint with the best replayed acceptance length so far
        self.ledger = self.data.new_ledger()
        latest = load_latest(self.layout, self.draft, self.optimizer, self.env)  # skips damaged ones
        self.step_fn.refresh()  # the compute copy (bf16) follows the loaded master weights
        if latest is not None:
            path, state = latest
            if state.get("fingerprint") != self.fingerprint:
                raise ConfigError(
                    f"checkpoint {path} was made with another draft architecture, data set or packing (draft.*, hidden/, "
                    f"vocab/, train.init_from, train.init_vocab, train.batch_max_tokens or train.seed changed); rerun with "
                    f"--overwrite to start over"
                )
            self.step, self.pos = int(state["step"]), DataPosition.from_dict(state["data_position"])
            if self.step > self.total_steps:
                raise ConfigError(
                    f"the latest checkpoint {path} is at step {self.step}, past the {self.total_steps} steps this config "
                    f"trains (train.max_steps={self.t.max_steps}); raise train.max_steps to at least {self.step} to go on "
                    f"from it, or rerun with --overwrite to train {self.total_steps} steps from scratch")
            self.ledger = self.resumed_ledger(path, state)
            self.tokens_seen, self.elapsed_before = int(state["tokens_seen"]), float(state["elapsed_s"])
            self.last_train_loss = float(state.get("last_train_loss", float("nan")))
            rank_state = state["rank_state"]
            saved_k = state.get("ttt_steps")
            if saved_k is None and "log_window" in rank_state:  # saved before checkpoints recorded it
                saved_k = (len(rank_state["log_window"]) - 2) // 3
            if saved_k not in (None, K):  # the weights do not depend on it: train on with the new number of TTT steps
                self.say(f"04_train: note: the checkpoint trained with train.ttt_steps={saved_k}, this run uses {K}; "
                         f"the loss from here on is over {K} steps")
            elif state.get("world_size") == self.env.world_size and "log_window" in rank_state:
                # continue the interrupted run's partial logging window: identical metrics lines
                self.window.load_flat(rank_state["log_window"])
                self.window_steps, self.window_time = int(rank_state["window_steps"]), float(rank_state["window_time"])
            self.best = self.resumed_best(state.get("best"))
            self.say(f"04_train: resuming from {path} (step {self.step}/{self.total_steps}, epoch {self.pos.epoch})")
            if state.get("global_micro_batches") != self.data.micro_per_step:
                self.say(f"04_train: note: the global batch changed from {state.get('global_micro_batches')} to "
                         f"{self.data.micro_per_step} micro-batches per step")
        if self.env.is_main:
            dropped = truncate_metrics(self.layout.metrics, self.step)
            if dropped:
                self.say(f"04_train: dropped {dropped} metrics lines after step {self.step} (they are recomputed)")
            report = self.layout.train_eval_report
            if report.is_file() and read_json(report).get("step") == self.step:
                self.last_eval = read_json(report)
        barrier(self.env)

    def resumed_ledger(self, path, state: dict) -> SampleLedger:
        """The checkpoint's ledger, checked against its data position (a checkpoint from before ledgers
        existed gets the ledger its position implies)."""
        implied = self.data.ledger_at(self.pos)
        saved = state.get("ledger")
        if saved is not None and saved != implied:
            raise DataError(
                f"checkpoint {path} records other trained samples than its data position (epoch {self.pos.epoch}, "
                f"micro-batch {self.pos.micro_batch}) implies; its ledger.json was edited or comes from another run: "
                f"remove {path} to resume from an earlier checkpoint, or rerun with --overwrite")
        return implied

    # -- the loop -------------------------------------------------------------------------

    def run(self, overwrite: bool) -> int:
        env, t = self.env, self.t
        if overwrite:  # every refusal comes before --overwrite deletes train/ (it may hold a finished draft)
            self.check_can_train()
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

        self.build_model()
        self.init_state()
        self.say(
            f"04_train: draft {self.n_params / 1e6:.2f}M trainable params (hidden {self.draft_cfg.hidden_size}, "
            f"V_d {self.draft_cfg.draft_vocab_size}), {len(self.data.samples)} train samples / {self.data.num_tokens} tokens, "
            f"{env.world_size} process(es) x grad_accum {t.grad_accum}, {self.total_steps} steps, "
            f"{str(self.dtype).replace('torch.', '')} on {env.device.type}, parallel={t.parallel if env.distributed else 'none'}"
        )
        self.metrics = JsonlAppender(self.layout.metrics, fsync_every=1) if env.is_main else None
        self.tb = TensorBoard(self.layout.tensorboard, env.is_main, purge_step=self.step + 1 if self.step else None)
        self.bar = tqdm(total=self.total_steps, initial=self.step, disable=not env.is_main, dynamic_ncols=True, desc="04_train")
        self.t_start = time.time()
        self.reconcile_rounds()
        self.batches = None
        self.model.train()
        try:
            while self.step < self.total_steps:
                if self.batches is None:  # the start, or (rounds mode) a new round
                    if not self.open_round():
                        return self.wait_for_round()
                    self.batches = self.data.stream(self.pos, self.steps_to_round_end())
                this_round = self.pos.epoch
                self.train_step()
                done = self.step == self.total_steps
                round_done = self.plan is not None and (self.pos.epoch != this_round or done)
                if self.step % t.log_every == 0 or done:
                    self.log()
                eval_due = (t.eval_every > 0 and self.step % t.eval_every == 0) or done
                if eval_due or self.step % t.checkpoint_every == 0 or self.pos.epoch != this_round or done:
                    self.check_inputs_unchanged()  # before anything is saved, chosen as best or exported
                new_best = False
                if eval_due:
                    report = self.evaluate()
                    self.last_eval = report or self.last_eval
                    new_best = self.update_best(report)
                # a new best is checkpointed at its step, whatever checkpoint_every says (docs/design.md#resume-rules)
                if self.step % t.checkpoint_every == 0 or done or round_done or new_best:
                    self.save()  # before a round's shards are deleted: a resume never needs them again
                if round_done:
                    if env.is_main:
                        self.consume_rounds({this_round})
                    barrier(env)
                    self.batches = None
            self.bar.close()
            self.finish()
            if env.is_main:
                self.manifest.complete({"steps": self.step})  # last: train/final is whole
        finally:
            self.close_logs()
        return 0

    def check_can_train(self) -> None:
        """The refusals that need no model: the memory plan (printed) against the GPU, the shards' files."""
        capacity = self.capacity
        self.say(f"04_train: memory plan: {self.memory_plan.describe()}"
                 + (f"; GPU capacity {format_bytes(capacity)}" if capacity is not None else ""))
        check_fits(self.memory_plan, capacity, self.replan)
        if self.plan is None:
            verify_shard_files(self.index, self.layout, self.env, self.cfg.extract.verify)

    def inputs_identity(self) -> dict[str, Optional[str]]:
        """04's inputs by content, as far as they may change under a running 04: index.json (rounds mode:
        plan.json and index.json's header, since 02 adds each round's shards to the rest) and the vocab
        map; None for a file that is gone. Small files, read whole: no cache to fool."""
        layout = self.layout

        def sha(data: Optional[bytes]) -> Optional[str]:
            return None if data is None else hashlib.sha256(data).hexdigest()

        def read(path) -> Optional[bytes]:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None

        ident = {layout.name(layout.vocab_map): sha(read(layout.vocab_map))}
        index = read(layout.hidden_index)
        if self.plan is None:
            ident[layout.name(layout.hidden_index)] = sha(index)
            return ident
        ident[layout.name(layout.hidden_plan)] = sha(read(layout.hidden_plan))
        try:
            header = {k: v for k, v in json.loads(index).items() if k not in INDEX_SHARD_FIELDS}
        except (TypeError, ValueError, AttributeError):
            header = None  # gone or unreadable: a change
        ident[f"{layout.name(layout.hidden_index)} (its header)"] = sha(json.dumps(header, sort_keys=True).encode())
        return ident

    def check_inputs_unchanged(self) -> None:
        """Stop without saving or exporting when hidden/ or vocab/ changed since this run started (another
        stage rewrote them): the steps since the last check trained on two generations of inputs."""
        now = on_rank0(self.inputs_identity, self.env)
        changed = [name for name, digest in self.inputs_at_start.items() if now.get(name) != digest]
        if not changed:
            return
        kept = self.layout.checkpoint_dirs()
        last = f"the last checkpoint, {kept[-1][1]}, was saved before the change" if kept else "no checkpoint was saved"
        raise DataError(
            f"{', '.join(changed)} changed while 04 was training (did 02 or 03 rewrite them?): stopped at step "
            f"{self.step}/{self.total_steps} without saving or exporting anything from the mixed inputs; {last}. Rerun "
            f"04 once they are final: it resumes when they are the same data, else asks for --overwrite")

    def wait_for_round(self) -> int:
        """Rounds mode: the next round is not on disk yet. Its checkpoint is saved; 02 extracts it next."""
        r, rounds = self.pos.epoch, self.plan["rounds"]
        self.say(f"04_train: {r} of {len(rounds)} rounds trained (step {self.step}/{self.total_steps}); round {r + 1} (epoch "
                 f"{rounds[r]['epoch'] + 1}) is not extracted yet: run 02_extract_hidden.py, then 04 again "
                 f"(run_pipeline.py alternates them)")
        if self.env.is_main:
            self.manifest.partial({"steps": self.step}, outcome="round_done")
        return 0

    def check_outputs(self, overwrite: bool) -> str:
        """"complete", "resume" or "fresh", from train/'s stage manifest (rank 0 decides, every rank
        gets the answer). Outputs made from another hidden/ or vocab/, or another draft, data order
        or packing, are an error that asks for --overwrite: never a stale train/final."""
        return on_rank0(lambda: self.decide_outputs(overwrite), self.env)

    def decide_outputs(self, overwrite: bool) -> str:
        """check_outputs on rank 0 (it alone writes under train/)."""
        if overwrite:
            clean_train_dir(self.layout)
            if self.plan is not None:  # training starts over: 02 extracts the rounds again from the first
                write_consumed(self.layout.hidden_consumed, [])
        layout = self.layout
        self.manifest = StageManifest(
            # rounds mode: the plan, since index.json grows with every round 02 extracts
            layout, "04_train", inputs={**layout.named(layout.hidden_index if self.plan is None else layout.hidden_plan,
                                                       layout.vocab_map),
                                        **({"train.init_from": self.init.fingerprint} if self.init else {})},
            settings={"target": self.target_id, "draft": dataclasses.asdict(self.draft_cfg),
                      "batch_max_tokens": self.t.batch_max_tokens, "seed": self.t.seed,
                      **({"init_vocab": self.init.mode} if self.init else {})},
            replaced={"target_model": "target"})  # recorded by path before
        decision = self.manifest.begin(overwrite, outputs=[layout.final],
                                       started=layout.final.exists() or layout.checkpoints.exists())
        done = int(self.manifest.result.get("steps", -1))
        if decision == "complete" and done < self.total_steps:
            self.manifest.partial(self.manifest.result)  # more steps asked for: train on from the last checkpoint
            decision = "resume"
        elif decision == "complete" and done > self.total_steps:
            raise ConfigError(
                f"{layout.final} holds a draft trained for {done} steps but this config trains {self.total_steps} "
                f"(train.max_steps={self.t.max_steps}); set train.max_steps back to {done} (or more, to train "
                f"on), or rerun with --overwrite to train a {self.total_steps}-step draft")
        return decision

    def close_logs(self) -> None:
        """Close the progress bar, metrics.jsonl and TensorBoard; after a failure (e.g. a full disk)
        do it quietly, so that the error is the last line the user sees."""
        for closer in (self.bar.close, getattr(self.metrics, "close", None), self.tb.close):
            try:
                if closer is not None:
                    closer()
            except Exception:
                pass

    def train_step(self) -> None:
        t, env = self.t, self.env
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.total_steps, self.t)
        mine, real, next_pos = self.data.step_micro_batches(self.pos)
        self.tokens_seen += self.data.step_tokens(self.pos)
        # Each micro-batch loss is a sum over its positions divided by the step-0 position count of
        # the whole global step, so the step's gradient is the token mean over the global batch
        # (same for any split into ranks x micro-batches). DDP/FSDP average over ranks: x world_size.
        denominator = max(1, self.data.step_loss_positions(self.pos) if t.loss_normalization == "counted"
                          else self.data.step_tokens(self.pos))

        def micro_batches():
            for j in range(len(mine)):
                mb = next(self.batches)
                assert mb.sample_ids == [self.index.samples[i].sample_id for i in mine[j]], "data stream out of step"
                yield mb.to(env.device, non_blocking=self.on_gpu), real[j]

        result = self.step_fn.run(micro_batches(), len(mine), denominator, lr)
        for out, is_real, tokens in result.outputs:
            if is_real:
                self.window.add(loss=float(out.loss.detach()), tokens=tokens, step_losses=out.step_losses,
                                step_correct=out.step_correct, step_counts=out.step_counts)
        self.grad_norm, self.anchor_loss = result.grad_norm, result.anchor_loss
        if not result.applied:  # a non-finite gradient, the same on every rank (the gradients are all-reduced)
            raise self.diverged(lr)
        self.data.record_step(self.ledger, self.pos)
        self.lr = lr
        self.step += 1
        self.pos = next_pos
        self.window_steps += 1
        self.window_time += time.perf_counter() - t0
        self.bar.update(1)

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

    def log(self) -> None:
        """One metrics line: means over the steps since the last line, summed over ranks."""
        w = self.window.all_reduced(self.env)
        n = max(1, self.window_steps)
        tok_s = float(w["tokens"]) / max(1e-9, self.window_time)  # training time only (no eval/checkpoint)
        acc = [float(c) / max(1.0, float(m)) for c, m in zip(w["step_correct"], w["step_counts"])]
        self.last_train_loss = float(w["loss"]) / n
        self.window.zero_()
        self.window_steps, self.window_time = 0, 0.0
        if self.plan is None:
            epoch = self.pos.epoch + (self.pos.micro_batch / len(self.data.epoch_micro_batches(self.pos.epoch)) if self.pos.micro_batch else 0.0)
        else:  # a position is a round: count the epochs in trained samples
            epoch = float(self.ledger.times_trained().sum()) / max(1, len(self.ledger.sample_ids))
        row = {
            "type": "train", "step": self.step, "epoch": round(epoch, 4), "loss": self.last_train_loss,
            "step_losses": [float(x) / n for x in w["step_losses"]], "step_acc": acc, "lr": self.lr, "grad_norm": self.grad_norm,
            "tokens_per_s": tok_s, "tokens": self.tokens_seen, "elapsed_s": self.elapsed(),
        }
        if self.t.anchor_weight > 0:  # the L2-SP term at this step's weights (not in "loss": that stays the TTT loss)
            row["anchor_loss"] = self.anchor_loss
        if self.env.is_main:
            self.metrics.write(row)
            self.tb.scalars(self.step, {"train/loss": row["loss"], "train/lr": self.lr, "train/grad_norm": self.grad_norm,
                                        **({"train/anchor_loss": row["anchor_loss"]} if "anchor_loss" in row else {}),
                                        "train/tokens_per_s": tok_s, **{f"train/acc_{i}": a for i, a in enumerate(acc)}})
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{acc[0]:.3f}", tok_s=f"{tok_s:.0f}")

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t_start

    def evaluate(self) -> Optional[dict]:
        report = evaluate(self.step_fn, self.index, self.data.reader, self.cfg, self.env)
        if report is None:
            return None
        report = {"type": "eval", "step": self.step, **report}
        if self.env.is_main:
            self.metrics.write(report)
            atomic_write_json(self.layout.train_eval_report, report)
            self.tb.scalars(self.step, {"eval/loss": report["loss"], **{f"eval/acc_{i}": a for i, a in enumerate(report["step_acc"])},
                                        **{f"eval/tau_{k}": v for k, v in report["tau"].items()},
                                        **{f"eval/replay_al_{k}": r["acceptance_length"] for k, r in report["replay"].items()}})
            self.bar.write(f"eval @ step {self.step}: accuracy per TTT step {[round(a, 3) for a in report['step_acc']]}; "
                           f"{describe_acceptance(report, self.shown_ks)}")
        return report

    @property
    def best_k(self) -> int:
        """The k whose replayed acceptance length picks the best checkpoint: 05's (evaluate.num_speculative_tokens)."""
        return min(self.cfg.evaluate.num_speculative_tokens, self.K)

    def update_best(self, report: Optional[dict]) -> bool:
        """Whether this eval is a new best (strictly higher replayed acceptance length at best_k; the same
        answer on every rank: the report is all-reduced). The step is then checkpointed and kept."""
        if report is None:
            return False
        k = str(self.best_k)
        al = float(report["replay"][k]["acceptance_length"])
        if self.best is not None and al <= self.best["acceptance_length"]:
            return False
        self.best = {"step": self.step, "k": self.best_k, "acceptance_length": al, "metric": f"eval/replay_al_{k}",
                     "eval_loss": report["loss"], "step_acc": report["step_acc"]}
        if self.env.is_main and self.step != self.total_steps:
            self.bar.write(f"eval @ step {self.step}: new best replayed acceptance length {al:.3f} at k={k}: checkpointed")
        return True

    def resumed_best(self, best: Optional[dict]) -> Optional[dict]:
        """The checkpoint's record of the best checkpoint, if it is still usable: same k, and its checkpoint
        on disk (pruning keeps it; a damaged one is forgotten with a note)."""
        if not best:
            return None
        if int(best.get("k", -1)) != self.best_k:
            self.say(f"04_train: note: the best checkpoint so far (step {best['step']}) was chosen at k={best.get('k')}; "
                     f"evaluate.num_speculative_tokens now asks k={self.best_k}: the best is chosen again from the next eval")
            return None
        path = self.layout.checkpoint(int(best["step"]))
        # cheap here (04 checks its files against the manifest when it exports train/best)
        problem = broadcast_object(None if (path / "model.safetensors").is_file() else "missing", self.env)
        if problem is not None:
            self.say(f"04_train: note: the best checkpoint so far, {path}, is {problem}; the best is chosen again "
                     f"from the next eval")
            return None
        return best

    def save(self) -> None:
        if self.env.is_main:
            self.metrics.sync()  # lines up to this step are on disk before the checkpoint that vouches for them
        state = {
            "step": self.step, "total_steps": self.total_steps, "data_position": self.pos.to_dict(),
            "fingerprint": self.fingerprint, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed(),
            "world_size": self.env.world_size, "grad_accum": self.t.grad_accum,
            "global_micro_batches": self.data.micro_per_step, "last_train_loss": self.last_train_loss,
            "ttt_steps": self.K, "best": self.best,
        }
        rank_state = {"log_window": self.window.flat.clone(), "window_steps": self.window_steps, "window_time": self.window_time}
        save_checkpoint(self.layout, self.step, self.draft, self.optimizer, state, self.env, self.t.keep_checkpoints, rank_state,
                        files={LEDGER_FILE: self.ledger.to_json()})

    def finish(self) -> None:
        elapsed = self.elapsed()
        summary = {
            "step": self.step, "total_steps": self.total_steps, "tokens": self.tokens_seen, "elapsed_s": elapsed,
            "tokens_per_s": self.tokens_seen / max(1e-9, elapsed), "final_train_loss": self.last_train_loss,
            "eval": self.last_eval, "world_size": self.env.world_size, "grad_accum": self.t.grad_accum,
            "parallel": self.t.parallel if self.env.distributed else "none", "trainable_params": self.n_params,
            "aux_layer_ids": self.index.aux_layer_ids, "draft_config": dataclasses.asdict(self.draft_cfg),
            "ledger": self.ledger.summary(), "best": self.best,
            "init_from": self.init and {"path": str(self.init.path), "vocab": self.init.mode, "fingerprint": self.init.fingerprint,
                                        "anchor_weight": self.t.anchor_weight},
            "config": self.cfg.to_dict(),
        }
        export_final(self.t.parallel, self.env, self.draft, self.draft_cfg, self.index, self.layout, summary)
        best_line = export_best(self.env, self.draft_cfg, self.index, self.layout, self.best, self.step)
        barrier(self.env)
        if self.env.is_main:
            self.say(f"04_train: {best_line}")
            tau_txt = describe_acceptance(self.last_eval or {}, self.shown_ks)
            self.say(f"04_train: {self.ledger.describe()}")
            self.say(f"04_train: done: {self.step} steps, {self.tokens_seen} tokens in {elapsed:.0f}s "
                     f"({self.tokens_seen / max(1e-9, elapsed):.0f} tok/s), final loss {self.last_train_loss:.4f}; {tau_txt}; "
                     f"draft in {self.layout.final}")
