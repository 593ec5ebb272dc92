"""SpecForge 0.2.0's training recipe (the peer) on one of our runs' data, exported as a vLLM draft for `05 --compare`.

The quality side of bench/peer_bench.py: that script times one step of each implementation; this one trains the
peer's draft for as many steps as our 04 trained, on the same data, from the same initial weights, so that
`05_evaluate.py --compare RUN/train/final DIR` measures both drafts on the same prompts and the same server.

    PY=$(bash bench/peer_setup.sh)      # SpecForge 0.2.0 + this repo's common.* in one venv
    $PY bench/peer_quality.py --config configs/smollm2.yaml            # train/ export into RUN/peer/specforge
    python 05_evaluate.py --config configs/smollm2.yaml --compare RUN/train/final RUN/peer/specforge

What is the same as 04 (04's own code, called read-only):
  - the inputs and their checks: common.train.trainer.Trainer(cfg) opens hidden/ (02) and vocab/ (03) exactly as 04
    does (a run without them fails with one `error:` line);
  - the initial weights: Trainer.build_model, 04's own step-0 draft (torch.manual_seed(train.seed), the target's
    embedding, the vocab map, train.init_lm_head, train.init_from), copied name for name into SpecForge's
    LlamaForCausalLMEagle3 (bench/peer_bench.py build_sf_draft: the state dicts have the same names and shapes);
  - the data: 04's packed micro-batches (common.train.data.TrainData: train.batch_max_tokens, train.seed, the
    same order, epochs and train.grad_accum micro-batches per step), read from the same shards;
  - the sizes (our draft config), the TTT length (train.ttt_steps), the lr (train.lr) and the step count
    (train.max_steps, or --steps);
  - the export: common.model.export.export_vllm_draft (config.json + model.safetensors, the same tensor names, d2t,
    t2d and aux layer ids as train/final), checked with our loader (load_exported_draft) and 05's own draft
    check (common.evaluate.draft.checked_draft), and offline-evaluated with 04's eval (evaluate_export: replayed
    acceptance length on the eval split) beside train/final when it exists.

What is SpecForge's (its recipe, as its `specforge train` assembles it: training/assembly.py, config/schema.py):
  - the step: Eagle3TrainStrategy.forward_loss (offline: its TargetHead re-runs the target lm_head over the stored
    final hidden state) over OnlineEagle3Model over LlamaForCausalLMEagle3, loss = sum_i 0.8**i * ploss_i
    (ploss_decay 0.8, fixed in SpecForge), each ploss the soft cross-entropy summed over the trained positions
    and divided by all B*L positions of the padded batch; micro-batch losses / accumulation_steps, backward;
  - the optimizer: its BF16Optimizer as _ConfiguredOptimizerFactory builds it: fp32 master copies, global-norm
    clip at training.max_grad_norm (0.5), torch AdamW with its defaults (betas 0.9/0.999, eps 1e-8, weight decay 0),
    the schedule training.lr_scheduler (cosine) with linear warm-up over int(training.warmup_ratio (0.015) * total
    steps), total steps = the steps trained, cosine down to 0 (as is: without warm-up steps, i.e. below 67 steps,
    torch's chained CosineAnnealingLR under its warm-up wrapper starts a little above lr, 1.106x at 5 steps, 1.001x
    at 50, and repeats lr once);
  - precision: model.torch_dtype bfloat16 (draft parameters and the TargetHead in bf16, masters fp32); --precision
    fp32 is SpecForge's own torch_dtype float32 setting (like our CPU 04, which trains in fp32);
  - the batch: one SpecForge batch per our micro-batch, its samples right-padded to the longest (as its offline
    collator, specforge.data.utils.DataCollatorWithPadding: zeros in input_ids, attention_mask, loss_mask and the
    states); no position_ids (its offline samples have none: arange per row). Its sample normalizer zeroes the
    last loss_mask position, superseded by the fix below.

Changed, and why:
  - loss mask alignment (as bench/peer_bench.py documents and checks): SpecForge reads the loss mask at t+i where
    ours is the mask of the predicted token x_{t+2+i}; it is given loss_mask'[t] = loss_mask[t+2] (0 at the last two
    positions of each sample), so both train exactly the same positions.
  - attention backend: SpecForge's default flex_attention has no CPU backward; --backend auto = flex_attention on
    CUDA, sdpa (SpecForge's other exact backend) on CPU.
  - loss kernel: on CPU SpecForge's Triton LogSoftmaxLoss cannot run; its reference specforge.core.loss._compute_loss
    (the same value) is used there (peer_bench.use_specforge_loss_for).
  - no FSDP wrapper (one process; SpecForge wraps even one GPU in FSDP with bf16 params, the same numbers), no
    dataloader, checkpoints or trackers: one process trains, exports and exits (not resumable).
  - train.anchor_weight (L2-SP) has no SpecForge counterpart and is not applied (printed when set).

Printed every --log-every steps: the loss on SpecForge's scale (per B*L padded positions) and per counted position
(04's `loss` in metrics.jsonl: the same numerator over 04's denominator, the step-0 positions with a loss), the
per-TTT-step accuracy (its acces: the share of trained positions where the draft's top-1 maps to the target's),
lr, grad norm, tokens/s. Writes DIR/peer_quality.json (steps, tokens, seconds, losses, settings, export check,
offline evals). The draft directory DIR is replaced whole (atomically) on every run; --out must be a new
directory, or one this script wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import warnings
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from common.core.cli import OneLineArgumentParser  # noqa: E402
from common.core.errors import PipelineError, printable  # noqa: E402

warnings.filterwarnings("ignore", message="flash_attn is not found")  # SpecForge's "fa" backend only
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

RESULT_FILE = "peer_quality.json"
SF_PLOSS_DECAY = 0.8  # Eagle3TrainStrategy's ploss_decay: not a config key in SpecForge 0.2.0
# SpecForge 0.2.0 TrainingConfig defaults (config/schema.py) that its BF16Optimizer is built with
SF_DEFAULTS = {"warmup_ratio": 0.015, "lr_scheduler": "cosine", "max_grad_norm": 0.5}


class UserError(Exception):
    """A bad input: one `error:` line, exit 2 (like the stages)."""


# ------------------------------------------------------------------------------------------------
# Our side: 04's inputs, schedule and initial weights (read-only)
# ------------------------------------------------------------------------------------------------


def open_run(cfg, device: torch.device, config_path="RUN.yaml"):
    """04's Trainer over this run, built as 04 builds it (inputs checked, the packed schedule opened), on one
    process. Nothing is written under the run (04's target hash cache under stages/ aside)."""
    from common.core.distributed import DistEnv
    from common.core.run_folder import Layout
    from common.train.trainer import Trainer

    layout = Layout.of(cfg)
    if not layout.hidden_index.is_file():
        raise UserError(f"{layout.hidden_index} is missing: the run {layout.run_dir} has no extracted hidden states; "
                        f"run 02_extract_hidden.py --config {config_path} first")
    if not layout.vocab_map.is_file():
        raise UserError(f"{layout.vocab_map} is missing: the run {layout.run_dir} has no vocab map; run "
                        f"03_build_vocab_map.py --config {config_path} first")
    cfg.extract.stream = False  # 02 must have finished: never wait for it
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Trainer(cfg, DistEnv(device=device))


def initial_weights(trainer, target: dict) -> dict:
    """04's step-0 draft (Trainer.build_model: seed, target embedding, vocab map, init_lm_head, init_from) as a
    CPU fp32 state dict. The trainer then drops its draft, step, AdamW and teacher (the export builds its own draft)."""
    def say(*parts):  # 04's line about its own training step would mislead here; the rest (init_from) is kept
        line = " ".join(map(str, parts))
        if not line.startswith("04_train: step:"):
            print(line.replace("04_train:", "peer_quality: 04's draft:", 1), flush=True)

    trainer.say = say
    trainer.build_model(target)
    state = {k: v.detach().to("cpu", copy=True) for k, v in trainer.draft.state_dict().items()}
    # 04's step, compute copy, AdamW, master draft and teacher: not used here (the device memory goes to SpecForge)
    trainer.step_fn = trainer.model = trainer.optimizer = trainer.draft = trainer.lm_head = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return state


# what decides 04's first micro-batches and the loss it logs for step 1 (before its first update)
STEP_1_KEYS = {"train": ("seed", "batch_max_tokens", "grad_accum", "ttt_steps", "loss_decay", "loss_normalization",
                         "init_lm_head", "init_from", "init_vocab"), "draft": None, "vocab": None}


def first_step_of_04(layout, cfg) -> dict:
    """04's logged step 1 (train/metrics.jsonl) when train/final was trained with the settings that decide it
    (training_summary.json's config): from the same initial weights and the same first batch as SpecForge's step 1,
    so the losses per counted position agree to rounding when both ran in fp32. A reference, not a check."""
    from common.core.io import iter_jsonl
    from common.core.run_folder import TRAINING_SUMMARY

    try:
        ran = json.loads((layout.final / TRAINING_SUMMARY).read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return {"missing": f"no readable {layout.final / TRAINING_SUMMARY}"}
    now = json.loads(json.dumps(cfg.to_dict(), default=str))  # as training_summary.json holds it
    differ = []
    for section, keys in STEP_1_KEYS.items():
        if keys is None:
            differ += [section] if ran.get(section) != now.get(section) else []
        else:
            differ += [f"{section}.{k}" for k in keys if (ran.get(section) or {}).get(k) != now[section].get(k)]
    if differ:
        return {"missing": f"train/final was trained with other {', '.join(differ)}"}
    found = None
    if layout.metrics.is_file():
        for row in iter_jsonl(layout.metrics, tolerate_torn_tail=True, strict=False):
            if row.get("type") == "train" and row.get("step") == 1:
                found = {"loss": row.get("loss"), "step_acc": row.get("step_acc")}
    return found or {"missing": f"no step 1 in {layout.metrics}"}


# ------------------------------------------------------------------------------------------------
# SpecForge side
# ------------------------------------------------------------------------------------------------


def sf_batch_padded(mb, dtype: torch.dtype, device):
    """Our packed micro-batch as SpecForge's offline batch: one row per sample, right-padded to the longest (its
    DataCollatorWithPadding), loss mask shifted by two (module docstring). Returns (TrainBatch, positions it
    trains at step 0, B*L)."""
    from specforge.runtime.contracts import TrainBatch

    lens = list(mb.seq_lens)
    B, L = len(lens), max(lens)
    H3, H = mb.aux_hidden.shape[-1], mb.final_hidden.shape[-1]
    ids = torch.zeros(B, L, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    aux = torch.zeros(B, L, H3, dtype=dtype)
    final = torch.zeros(B, L, H, dtype=dtype)
    start = 0
    for b, n in enumerate(lens):
        rows = slice(start, start + n)
        ids[b, :n] = mb.input_ids[rows].cpu()
        attn[b, :n] = 1
        if n > 2:
            mask[b, : n - 2] = mb.loss_mask[rows][2:].cpu()  # loss_mask'[t] = loss_mask[t+2]
        aux[b, :n] = mb.aux_hidden[rows].cpu().to(dtype)
        final[b, :n] = mb.final_hidden[rows].cpu().to(dtype)
        start += n
    tensors = {"input_ids": ids.to(device), "attention_mask": attn.to(device), "loss_mask": mask.to(device),
               "hidden_state": aux.to(device), "target": final.to(device)}
    batch = TrainBatch(sample_ids=list(mb.sample_ids), strategy="eagle3", tensors=tensors,
                       metadata={"target_repr": "hidden_state"})
    return batch, int(mask.sum()), B * L


def build_specforge(draft_cfg, our_state: dict, lm_head: torch.Tensor, args, total_steps: int, device, dtype):
    """(draft, strategy, optimizer): SpecForge's draft holding our initial weights, OnlineEagle3Model in its
    Eagle3TrainStrategy with TargetHead(lm_head), and BF16Optimizer as `specforge train` configures it."""
    import peer_bench as pb
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.optimizer import BF16Optimizer
    from specforge.training.strategies.base import Eagle3TrainStrategy

    draft = pb.build_sf_draft(draft_cfg, args.backend, our_state, device, dtype)
    model = OnlineEagle3Model(draft_model=draft, length=args.ttt_steps, attention_backend=args.backend).to(device)
    head = pb.sf_target_head(lm_head.to(device=device, dtype=dtype))  # TargetHead.from_pretrained: bf16
    strategy = Eagle3TrainStrategy(model, target_head=head, ploss_decay=SF_PLOSS_DECAY)
    optimizer = BF16Optimizer(model, lr=args.lr, max_grad_norm=args.max_grad_norm, warmup_ratio=args.warmup_ratio,
                              lr_scheduler=args.lr_scheduler, total_steps=total_steps)
    return draft, strategy, optimizer


def trained_state(strategy, optimizer, our_state: dict) -> dict:
    """Our state dict with every trainable tensor replaced by SpecForge's fp32 master (CPU), checked against its
    bf16/fp32 parameters; the frozen embedding and the vocab map are ours, checked unchanged."""
    model = strategy.trainable_module()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if len(names) != len(optimizer.fp32_params):
        raise RuntimeError(f"{len(names)} trainable parameters but {len(optimizer.fp32_params)} fp32 masters")
    state = dict(our_state)
    params = dict(model.named_parameters())
    for name, master in zip(names, optimizer.fp32_params):
        ours = name.removeprefix("draft_model.")
        if ours not in state or tuple(state[ours].shape) != tuple(master.shape):
            raise RuntimeError(f"SpecForge parameter {name} has no counterpart of its shape in our draft")
        if not torch.equal(params[name].detach().cpu(), master.detach().cpu().to(params[name].dtype)):
            raise RuntimeError(f"SpecForge parameter {name} is not its fp32 master rounded")
        state[ours] = master.detach().to("cpu", torch.float32, copy=True)
    draft_state = model.draft_model.state_dict()
    for name in ("d2t", "t2d", "embed_tokens.weight"):
        if not torch.equal(draft_state[name].cpu(), our_state[name].to(draft_state[name].dtype)):
            raise RuntimeError(f"SpecForge changed {name} during training")
    return state


# ------------------------------------------------------------------------------------------------
# Training loop
# ------------------------------------------------------------------------------------------------


def train(trainer, strategy, optimizer, args, device, dtype, total_steps: int) -> dict:
    """total_steps optimizer steps of SpecForge's step on 04's micro-batches, in 04's order."""
    from common.train.data import DataPosition

    data, source = trainer.data, trainer.source
    K = args.ttt_steps
    decays = [SF_PLOSS_DECAY ** i for i in range(K)]
    model = strategy.trainable_module()
    model.train()
    pos = DataPosition()
    history, window = [], []
    tokens_seen, t_start = 0, time.perf_counter()
    for step in range(total_steps):
        batch = source.next_batch(pos, total_steps - step)  # 04's data for its step at pos
        if batch is None:
            raise UserError(f"{source.describe_position(pos)} of {trainer.layout.hidden} is not on disk (a run under "
                            f"a disk budget deletes the rounds 04 has trained); rerun 02_extract_hidden.py --overwrite "
                            f"with a larger extract.max_disk_gb, or use a run extracted in one go")
        tokens = batch.tokens
        counted = data.step_loss_positions(pos)  # 04's denominator: step-0 positions with a loss
        lr = optimizer.get_learning_rate()
        t0 = time.perf_counter()
        loss_sf, loss_sum, step_correct, step_denom = 0.0, 0.0, [0.0] * K, [0.0] * K
        for mb, is_real in batch.micro_batches:
            if not is_real:  # a stand-in for a rank that ran out (never with one process and grad_accum 1)
                continue
            batch_sf, trained, padded = sf_batch_padded(mb, dtype, device)
            out = strategy.forward_loss(batch_sf)
            (out.loss / batch.count).backward()  # TrainerCore: loss / accumulation_steps
            plosses = [float(p) for p in out.metrics["plosses"]]
            loss_sf += float(out.loss.detach()) / batch.count
            loss_sum += sum(d * p * padded for d, p in zip(decays, plosses))  # each ploss is a mean over B*L
            for i in range(K):
                step_correct[i] += float(out.metrics["acc_corrects"][i])
                step_denom[i] += float(out.metrics["acc_denoms"][i])
        grad_norm = float(optimizer.step())  # clip, fp32 AdamW, copy to the bf16 params, schedule
        if not math.isfinite(grad_norm) or not math.isfinite(loss_sf):
            raise PipelineError(f"SpecForge's training diverged at step {step + 1} (loss {loss_sf}, grad norm {grad_norm})")
        pos = batch.next_pos
        tokens_seen += tokens
        row = {"step": step + 1, "loss_specforge": loss_sf, "loss_per_counted": loss_sum / max(1, counted),
               "step_acc": [c / max(1e-6, d) for c, d in zip(step_correct, step_denom)], "lr": lr,
               "grad_norm": grad_norm, "tokens": tokens, "seconds": time.perf_counter() - t0}
        history.append(row)
        window.append(row)
        if (step + 1) % args.log_every == 0 or step + 1 == total_steps:
            n = len(window)
            acc = [sum(r["step_acc"][i] for r in window) / n for i in range(K)]
            secs = sum(r["seconds"] for r in window)
            print(f"peer_quality: step {step + 1}/{total_steps}  loss {sum(r['loss_specforge'] for r in window) / n:.4f} "
                  f"(SpecForge's scale), {sum(r['loss_per_counted'] for r in window) / n:.4f} per counted position; "
                  f"acc {[round(a, 3) for a in acc]}; lr {lr:.3g}; grad norm {grad_norm:.3g}; "
                  f"{sum(r['tokens'] for r in window) / max(1e-9, secs):,.0f} tok/s", flush=True)
            last_window = window
            window = []
    seconds = time.perf_counter() - t_start
    n = len(last_window)
    return {"steps": total_steps, "tokens": tokens_seen, "seconds": seconds, "history": history,
            "final_loss_specforge": sum(r["loss_specforge"] for r in last_window) / n,
            "final_loss_per_counted": sum(r["loss_per_counted"] for r in last_window) / n,
            "final_step_acc": [sum(r["step_acc"][i] for r in last_window) / n for i in range(K)],
            "final_window_steps": n}


# ------------------------------------------------------------------------------------------------
# Export and checks
# ------------------------------------------------------------------------------------------------


def check_out_dir(out: Path, layout) -> None:
    """--out is replaced whole: refuse a directory of the run's stages, or one this script did not write."""
    out_r = out.resolve()
    run = layout.run_dir.resolve()
    stage_dirs = [layout.data, layout.hidden, layout.vocab, layout.train, layout.run_dir / "eval", layout.run_dir / "stages"]
    if out_r == run or any(out_r == d.resolve() or d.resolve() in out_r.parents for d in stage_dirs):
        raise UserError(f"--out {out} is the run directory or inside a stage's outputs; pick a directory of its own "
                        f"(default: {layout.run_dir / 'peer' / 'specforge'})")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / RESULT_FILE).is_file())):
        raise UserError(f"--out {out} exists and is not an earlier peer_quality.py output (no {RESULT_FILE}); it would "
                        f"be replaced: remove it or pick another directory")


def export(trainer, state: dict, out: Path) -> dict:
    """The trained weights through our exporter (official EAGLE-3 format, bf16, the aux layer ids of hidden/)."""
    from common.model.export import export_vllm_draft

    model = trainer.family.build(trainer.draft_cfg)
    model.load_state_dict(state, strict=True)
    export_vllm_draft(model, out, extra_config={"eagle_aux_hidden_state_layer_ids": list(trainer.source.index.aux_layer_ids)})
    return {"dir": str(out)}


def verify_export(cfg, out: Path, state: dict, embed: torch.Tensor) -> dict:
    """The export read back by our loader (tensors = the fp32 masters rounded to bf16), 05's --draft/--compare
    check, and its config.json against train/final's."""
    from common.core.run_folder import Layout
    from common.evaluate.draft import checked_draft
    from common.model.export import CONFIG_NAME, load_exported_draft

    layout = Layout.of(cfg)
    loaded = load_exported_draft(out, dtype=torch.bfloat16, embedding=embed.float())
    for name, t in loaded.state_dict().items():
        if name.startswith("embed_tokens."):
            continue
        if not torch.equal(t, state[name].to(t.dtype)):
            raise RuntimeError(f"the export's {name} differs from the trained weights")
    checked = checked_draft(cfg, layout, str(out), foreign_draft=False)  # what 05 runs on --draft / --compare dirs
    result = {"loader": "common.model.export.load_exported_draft: ok", "sha256": checked.sha256,
              "checked_draft": "common.evaluate.draft.checked_draft: ok", "no_offline_prediction_because": checked.offline.missing}
    final_cfg = layout.final / CONFIG_NAME
    if final_cfg.is_file():
        ours, theirs = json.loads(final_cfg.read_text()), json.loads((out / CONFIG_NAME).read_text())
        result["config_json_equals_train_final"] = ours == theirs
        result["config_json_diff"] = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    return result


def offline_evals(cfg, out: Path) -> dict:
    """04's eval (replayed acceptance length on the eval split, CPU fp32) of the peer's draft and of train/final."""
    from common.core.run_folder import Layout
    from common.train.offline_eval import evaluate_export

    layout = Layout.of(cfg)
    result = {"peer": evaluate_export(out, cfg)}
    if (layout.final / "model.safetensors").is_file():
        result["ours_train_final"] = evaluate_export(layout.final, cfg)
    return result


def describe_eval(rep, k: int) -> str:
    if not rep:
        return "no eval split"
    replay = (rep.get("replay") or {}).get(str(k)) or {}
    return (f"replayed acceptance length {replay.get('acceptance_length', float('nan')):.3f} at k={k}, "
            f"accuracy per TTT step {[round(a, 3) for a in rep['step_acc']]}, loss {rep['loss']:.4f}")


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def parse_args():
    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="our run's YAML config (02 and 03 done)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value as the stages do (e.g. train.grad_accum=8 to take a multi-GPU run's "
                        "global batch in one process)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: as 04 trains: train.max_steps, or its epochs)")
    p.add_argument("--out", type=Path, help="the draft directory (default RUN/peer/specforge)")
    p.add_argument("--seed", type=int, help="train.seed for the initial weights and the data order (default: the config's)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="SpecForge's model.torch_dtype: bf16 (its default; fp32 masters) or fp32")
    p.add_argument("--backend", choices=["auto", "sdpa", "flex_attention"], default="auto",
                   help="SpecForge's attention backend; auto = flex_attention (its default) on CUDA, sdpa on CPU")
    p.add_argument("--warmup-ratio", type=float, default=SF_DEFAULTS["warmup_ratio"], help="SpecForge's training.warmup_ratio")
    p.add_argument("--lr-scheduler", choices=["cosine", "constant"], default=SF_DEFAULTS["lr_scheduler"],
                   help="SpecForge's training.lr_scheduler")
    p.add_argument("--max-grad-norm", type=float, default=SF_DEFAULTS["max_grad_norm"], help="SpecForge's training.max_grad_norm")
    p.add_argument("--lr", type=float, help="default: our train.lr")
    p.add_argument("--log-every", type=int, help="default: our train.log_every")
    p.add_argument("--no-eval", action="store_true", help="skip 04's offline eval of the peer draft and train/final")
    args = p.parse_args()
    for name in ("steps", "threads", "log_every"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.lr is not None and not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    return args


def run(args) -> int:
    from common.core.config import load_config
    from common.core.run_folder import Layout
    from common.target.loading import load_target_tensors

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = list(args.overrides) + ([f"train.seed={args.seed}"] if args.seed is not None else [])
    cfg = load_config(args.config, overrides)
    layout = Layout.of(cfg)
    out = args.out or layout.run_dir / "peer" / "specforge"
    check_out_dir(out, layout)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    trainer = open_run(cfg, device, args.config)  # the run's inputs, checked as 04 checks them
    import importlib.util
    if importlib.util.find_spec("specforge") is None:
        raise UserError("specforge is not importable: run this with the peer venv's python (bash bench/peer_setup.sh "
                        "prints it)")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    if args.backend == "auto":
        args.backend = "flex_attention" if device.type == "cuda" else "sdpa"
    if args.backend == "flex_attention" and device.type != "cuda":
        raise UserError("SpecForge's flex_attention backend has no backward on CPU: use --backend sdpa")
    t = cfg.train
    args.ttt_steps, args.lr = t.ttt_steps, args.lr or t.lr
    args.log_every = args.log_every or t.log_every

    import peer_bench as pb

    total_steps = args.steps or trainer.total_steps
    draft_cfg = trainer.draft_cfg
    try:
        pb.sf_config(draft_cfg)
    except SystemExit as e:  # its refusal of a draft it cannot build
        raise UserError(str(e)) from None
    target = load_target_tensors(cfg.target.model)
    our_state = initial_weights(trainer, target)
    loss_impl = pb.use_specforge_loss_for(device)
    torch.manual_seed(t.seed)  # nothing in SpecForge's step draws random numbers; for completeness
    draft, strategy, optimizer = build_specforge(draft_cfg, our_state, target["lm_head"], args, total_steps, device, dtype)
    n_params = sum(p.numel() for p in strategy.trainable_module().parameters() if p.requires_grad)

    settings = {
        "specforge": version("specforge"), "torch": torch.__version__, "transformers": version("transformers"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "config": str(args.config), "overrides": overrides, "run_dir": str(layout.run_dir),
        "draft_config": dataclasses.asdict(draft_cfg), "trainable_params": n_params,
        "ours": {"lr": t.lr, "batch_max_tokens": t.batch_max_tokens, "grad_accum": t.grad_accum, "seed": t.seed,
                 "ttt_steps": t.ttt_steps, "init_lm_head": t.init_lm_head, "init_from": t.init_from,
                 "max_steps": t.max_steps, "epochs": t.epochs, "steps_04_trains": trainer.total_steps},
        "specforge_recipe": {
            "step": "Eagle3TrainStrategy.forward_loss -> OnlineEagle3Model -> LlamaForCausalLMEagle3 (offline: TargetHead)",
            "ttt_length": args.ttt_steps, "ploss_decay": SF_PLOSS_DECAY, "attention_backend": args.backend,
            "loss": loss_impl, "loss_normalization": "per B*L positions of the padded batch, / accumulation_steps",
            "optimizer": "BF16Optimizer (fp32 masters, AdamW betas 0.9/0.999 eps 1e-8 weight decay 0)",
            "lr": args.lr, "lr_scheduler": args.lr_scheduler, "warmup_ratio": args.warmup_ratio,
            "warmup_steps": int(args.warmup_ratio * total_steps), "total_steps": total_steps,
            "max_grad_norm": args.max_grad_norm, "torch_dtype": args.precision,
            "batch": "one SpecForge batch per 04 micro-batch (right-padded rows, its collator)",
            "accumulation_steps": trainer.data.micro_per_step,
            "loss_mask": "loss_mask'[t] = loss_mask[t+2] (the positions 04 trains)"},
    }
    differs = {k: v for k, v in {"loss_decay (ours)": (t.loss_decay, SF_PLOSS_DECAY),
                                 "grad_clip (ours)": (t.grad_clip, args.max_grad_norm),
                                 "warmup_ratio (ours)": (t.warmup_ratio, args.warmup_ratio),
                                 "betas (ours)": (list(t.betas), [0.9, 0.999]),
                                 "weight_decay (ours)": (t.weight_decay, 0.0),
                                 "min_lr (ours)": (t.min_lr, 0.0)}.items() if v[0] != v[1]}
    settings["recipe_differences_ours_vs_specforge"] = differs
    if t.anchor_weight > 0:
        settings["not_applied"] = f"train.anchor_weight={t.anchor_weight} (no SpecForge counterpart)"
    print(f"peer_quality: SpecForge {settings['specforge']} on {settings['device']}, {args.backend} attention, "
          f"{args.precision}, loss {loss_impl}; draft {n_params / 1e6:.2f}M trainable params from 04's step-0 weights "
          f"(seed {t.seed}, init_lm_head {t.init_lm_head}); {total_steps} steps of {trainer.data.micro_per_step} "
          f"micro-batch(es) <= {t.batch_max_tokens} tokens (04's packing), TTT {args.ttt_steps}; lr {args.lr:g} "
          f"{args.lr_scheduler}, warm-up {settings['specforge_recipe']['warmup_steps']} steps, clip {args.max_grad_norm}",
          flush=True)
    if differs:
        print("peer_quality: recipe differences, ours vs SpecForge's: "
              + ", ".join(f"{k.removesuffix(' (ours)')} {a} vs {b}" for k, (a, b) in differs.items()), flush=True)
    if "not_applied" in settings:
        print(f"peer_quality: note: {settings['not_applied']}", flush=True)

    result = train(trainer, strategy, optimizer, args, device, dtype, total_steps)
    ours_first = first_step_of_04(layout, cfg)
    if "loss" in ours_first:
        first = result["history"][0]
        print(f"peer_quality: step 1, from the same weights on the same batch: loss per counted position "
              f"{first['loss_per_counted']:.6g}, 04's (train/metrics.jsonl) {ours_first['loss']:.6g} (equal to rounding "
              f"when both ran in fp32)", flush=True)
    state = trained_state(strategy, optimizer, our_state)
    del draft, strategy, optimizer
    export(trainer, state, out)
    check = verify_export(cfg, out, state, target["embed"])
    same = check.get("config_json_equals_train_final")
    print(f"peer_quality: exported to {out}: our loader and 05's draft check accept it"
          + ("" if same is None else f"; config.json {'identical to' if same else 'differs from'} train/final's"
             + ("" if same else f" ({check['config_json_diff']})")), flush=True)
    doc = {"steps": result["steps"], "tokens": result["tokens"], "seconds": result["seconds"],
           "tokens_per_s": result["tokens"] / max(1e-9, result["seconds"]),
           "final_loss": result["final_loss_specforge"], "final_loss_per_counted": result["final_loss_per_counted"],
           "final_step_acc": result["final_step_acc"], "final_window_steps": result["final_window_steps"],
           "settings": settings, "export": check, "step_1_of_04": ours_first, "history": result["history"]}
    if not args.no_eval:
        doc["offline_eval"] = evals = offline_evals(cfg, out)
        k = min(cfg.evaluate.num_speculative_tokens, args.ttt_steps)
        print(f"peer_quality: 04's offline eval, SpecForge's draft: {describe_eval(evals['peer'], k)}", flush=True)
        if "ours_train_final" in evals:
            print(f"peer_quality: 04's offline eval, train/final:      {describe_eval(evals['ours_train_final'], k)}",
                  flush=True)
    final = layout.final
    doc["compare_command"] = (f"python 05_evaluate.py --config {args.config} "
                              + "".join(f"--set {o} " for o in args.overrides) + f"--compare {final} {out}")
    (out / RESULT_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"peer_quality: done: {result['steps']} steps, {result['tokens']} tokens in {result['seconds']:.0f}s "
          f"({doc['tokens_per_s']:.0f} tok/s), final loss {doc['final_loss']:.4f} (SpecForge's scale), "
          f"{doc['final_loss_per_counted']:.4f} per counted position; draft in {out}; measure: {doc['compare_command']}",
          flush=True)
    return 0


def main() -> None:
    args = parse_args()
    try:
        sys.exit(run(args))
    except (UserError, PipelineError) as e:
        print(f"error: {printable(str(e))}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
