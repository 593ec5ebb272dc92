"""Stage 04: train the EAGLE-3 draft head on extracted hidden states (TTT, see eagle3-spec.md §4).

Reads hidden/index.json + shards (common.train_data), vocab/vocab_map.safetensors and the
target's embedding (frozen, inside the draft) and lm_head (teacher only: kept on the device,
never trained or saved). Writes under run_dir/train/:

    checkpoints/step-N/   model.safetensors (trainable weights, fp32), optimizer.pt (AdamW +
                          schedule state, plain tensors: torch.load(weights_only=True)),
                          rng-rank{r}.pt, state.json (step, data position, fingerprint).
                          Written to .tmp-step-N and renamed: a step-N directory is complete.
    metrics.jsonl         one {"type": "train"} line per log_every steps, {"type": "eval"} lines
    tb/                   TensorBoard events (if tensorboard is installed)
    eval_report.json      the latest eval: per-step accuracy and expected acceptance length
    final/                the vLLM-loadable draft (common.export) + training_summary.json

Runs:
    python 04_train.py --config configs/run.yaml                      # 1 process (CPU or 1 GPU)
    torchrun --nproc_per_node 8 04_train.py --config configs/run.yaml   # 8 GPUs, one node
    # several nodes (run on every node; HOST = node 0; needs a shared filesystem for run_dir):
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        --rdzv_id eagle3 04_train.py --config configs/run.yaml

Parallelism. train.parallel = "ddp" (default): every rank holds the whole draft; gradients are
averaged. "fsdp": FSDP2 (torch.distributed.fsdp.fully_shard) shards the trainable draft
weights, their gradients and the AdamW state across ranks (each decoder layer is its own unit,
the rest - fc, norm, draft lm_head - the root unit); the frozen target embedding stays a
replicated plain tensor on every rank (ignored_params), and so does the teacher lm_head.
Checkpoints are gathered into full (unsharded) state dicts, so a run can resume with another
world size or the other parallel mode.

Batches. Micro-batches are packed rows of at most train.batch_max_tokens tokens; one optimizer
step uses world_size * grad_accum of them (see common.train_data for the order). Each
micro-batch loss is a mean over its positions; we average over the step's micro-batches, so
one process with grad_accum=2 computes the same update as two processes with grad_accum=1.
total steps = train.max_steps, or sum over epochs of ceil(micro-batches / (world * grad_accum)).

Resume. The latest complete checkpoint is picked up automatically; a resumed run continues
exactly (on CPU the final weights equal an uninterrupted run's bit for bit). --overwrite
starts over. A run whose train/final is complete for the configured number of steps exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from common.errors import ConfigError, DataError
from common.io import JsonlAppender, atomic_write_json, fsync_dir, iter_jsonl, read_json, write_jsonl_atomic
from common.train_data import DataPosition, HiddenIndex, MicroBatch, TrainData, eval_micro_batches

RERUN_03 = "rerun 03_build_vocab_map.py --overwrite"


# ---------------------------------------------------------------------------------------
# Distributed setup


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed() -> DistEnv:
    """Rank/world from the torchrun environment; gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return DistEnv(rank, world, local_rank, device)


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        backend_device = env.device if env.device.type == "cuda" else torch.device("cpu")
        t2 = t.to(backend_device)
        dist.all_reduce(t2)
        return t2.to(t.device)
    return t


# ---------------------------------------------------------------------------------------
# Inputs: vocab map, target tensors, draft config


def load_vocab_map(run_dir: Path, target_vocab: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    path = run_dir / "vocab" / "vocab_map.safetensors"
    if not path.is_file():
        raise DataError(f"no draft vocab map at {path}; run 03_build_vocab_map.py first")
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise DataError(f"vocab map {path} is unreadable ({e}); {RERUN_03}") from None
    if "d2t" not in tensors or "t2d" not in tensors:
        raise DataError(f"vocab map {path} lacks 'd2t' or 't2d'; {RERUN_03}")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    if t2d.numel() != target_vocab:
        raise DataError(f"vocab map {path} is for a target vocab of {t2d.numel()} tokens but the target has {target_vocab}; {RERUN_03}")
    if d2t.numel() != draft_vocab_size:
        raise DataError(
            f"vocab map {path} has {d2t.numel()} draft tokens but vocab.draft_vocab_size={draft_vocab_size}; "
            f"{RERUN_03} (or set vocab.draft_vocab_size={d2t.numel()})"
        )
    targets = torch.arange(d2t.numel()) + d2t
    if int(t2d.sum()) != d2t.numel() or targets.min() < 0 or targets.max() >= target_vocab or not bool(t2d[targets].all()):
        raise DataError(f"vocab map {path} is inconsistent (d2t does not map onto the ids marked in t2d); {RERUN_03}")
    return d2t, t2d


def _text_attr(tc, name: str, default=None):
    value = getattr(tc, name, None)
    if value is None and name == "rope_theta":  # transformers >= 5 keeps it in rope_parameters
        rp = getattr(tc, "rope_parameters", None) or {}
        value = rp.get("rope_theta") if isinstance(rp, dict) else None
    return default if value is None else value


def build_draft_config(cfg, info, draft_vocab_size: int, aux_layer_ids: list[int]):
    """DraftModelConfig from cfg.draft; nulls take the target's sizes."""
    from common.draft_model import DraftModelConfig

    d, tc = cfg.draft, info.text_config
    hidden = d.hidden_size or info.hidden_size
    if hidden != info.hidden_size:
        raise ConfigError(
            f"draft.hidden_size={hidden} differs from the target's hidden size {info.hidden_size}; the draft reads the "
            f"target's token embedding, so set draft.hidden_size to {info.hidden_size} or null"
        )
    heads = d.num_attention_heads or int(_text_attr(tc, "num_attention_heads"))
    if d.num_key_value_heads:
        kv = d.num_key_value_heads
    else:
        target_kv = int(_text_attr(tc, "num_key_value_heads", heads))
        kv = target_kv if heads % target_kv == 0 else heads
    head_dim = d.head_dim or hidden // heads
    if heads % kv != 0:
        raise ConfigError(f"draft.num_attention_heads={heads} must be a multiple of draft.num_key_value_heads={kv}")
    max_pos = d.max_position_embeddings or max(int(_text_attr(tc, "max_position_embeddings", 0)), cfg.tokenize.max_seq_len)
    if max_pos < cfg.tokenize.max_seq_len:
        raise ConfigError(
            f"draft.max_position_embeddings={max_pos} is below tokenize.max_seq_len={cfg.tokenize.max_seq_len}; "
            f"set it to at least {cfg.tokenize.max_seq_len} (or null for the target's)"
        )
    return DraftModelConfig(
        hidden_size=hidden,
        intermediate_size=d.intermediate_size or int(_text_attr(tc, "intermediate_size", 4 * hidden)),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_hidden_layers=d.num_hidden_layers,
        rms_norm_eps=float(d.rms_norm_eps or _text_attr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=float(d.rope_theta or _text_attr(tc, "rope_theta", 10000.0)),
        max_position_embeddings=int(max_pos),
        vocab_size=info.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=info.hidden_size,
        aux_layer_ids=list(aux_layer_ids),
        norm_before_residual=d.norm_before_residual,
        hidden_act=str(_text_attr(tc, "hidden_act", "silu")),
    )


def resolve_precision(cfg, device: torch.device) -> torch.dtype:
    p = cfg.train.precision
    if p == "auto":
        p = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if p == "bf16" else torch.float32


def lr_at(step: int, total: int, cfg) -> float:
    """Linear warmup over warmup_ratio * total steps, then cosine from lr down to min_lr."""
    t = cfg.train
    warmup = int(math.ceil(t.warmup_ratio * total))
    if step < warmup:
        return t.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def expected_acceptance_length(step_acc: list[float], k: int) -> float:
    """tau_k = 1 + sum_{j=1..k} prod_{i<j} acc_i: drafted token j is accepted only if tokens
    1..j-1 were, and we read acc_i (teacher-forced accuracy at TTT step i) as that conditional
    rate. The 1 is the token the target itself produces every step."""
    tau, run = 1.0, 1.0
    for acc in step_acc[:k]:
        run *= acc
        tau += run
    return tau


# ---------------------------------------------------------------------------------------
# Parallel wrapping (ttt_loss runs the draft through `model(...)`, so DDP/FSDP hooks see it)


def wrap_parallel(draft: nn.Module, env: DistEnv, cfg, dtype: torch.dtype) -> nn.Module:
    if not env.distributed:
        return draft
    if cfg.train.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        frozen = {p for p in draft.parameters() if not p.requires_grad}  # the target embedding: replicated
        for layer in draft.decoder_layers:
            # each layer runs once per TTT step in a forward: keep it gathered until the backward
            fully_shard(layer, mp_policy=mp, reshard_after_forward=False)
        fully_shard(draft, mp_policy=mp, ignored_params=frozen)
        return draft
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(draft, device_ids=[env.device.index] if env.device.type == "cuda" else None, broadcast_buffers=False)


# ---------------------------------------------------------------------------------------
# Checkpoints


CKPT_RE = re.compile(r"^step-(\d+)$")


def frozen_names(draft: nn.Module) -> set[str]:
    """The frozen target embedding (and any other frozen weight): never checkpointed."""
    return {n for n, p in draft.named_parameters() if not p.requires_grad}


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        m = CKPT_RE.match(p.name)
        if m and (p / "state.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _sd_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def full_model_state(draft: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded trainable state (collective under FSDP); CPU tensors; frozen embedding left out."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    frozen = frozen_names(draft)
    sd = get_model_state_dict(draft, options=_sd_options(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().contiguous() for k, v in sd.items() if k not in frozen}


def full_optimizer_state(draft: nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(draft, optimizer, options=_sd_options(full_state_dict=True, cpu_offload=True))


def rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_dir: Path, step: int, draft, optimizer, state: dict, env: DistEnv, keep: int,
                    rank_state: Optional[dict] = None) -> Optional[Path]:
    """Every rank calls this (FSDP gathers are collective). Atomic: temp dir, then rename.
    rank_state: this rank's extra state (plain tensors/numbers), stored next to its RNG state."""
    from safetensors.torch import save_file

    model_sd = full_model_state(draft)
    optim_sd = full_optimizer_state(draft, optimizer)
    final = ckpt_dir / f"step-{step}"
    tmp = ckpt_dir / f".tmp-step-{step}"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    torch.save({"rng": rng_state(), **(rank_state or {})}, tmp / f"rank{env.rank}.pt")
    barrier(env)
    if env.is_main:
        save_file(model_sd, str(tmp / "model.safetensors"))
        torch.save({"optimizer": optim_sd, "schedule": {"step": step, "kind": "linear_warmup_cosine"}}, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(ckpt_dir)
        for _, old in list_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(env)
    return final


def load_checkpoint(path: Path, draft, optimizer, env: DistEnv) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model_sd = load_file(str(path / "model.safetensors"))
    expected = set(draft.state_dict()) - frozen_names(draft)
    if set(model_sd) != expected:
        missing, extra = sorted(expected - set(model_sd)), sorted(set(model_sd) - expected)
        raise DataError(f"checkpoint {path} does not match the draft model (missing {missing[:3]}, unexpected {extra[:3]}); rerun with --overwrite")
    set_model_state_dict(draft, model_sd, options=_sd_options(full_state_dict=True, strict=False))
    blob = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    set_optimizer_state_dict(draft, optimizer, blob["optimizer"], options=_sd_options(full_state_dict=True))
    state = json.loads((path / "state.json").read_text())
    rank_file = path / f"rank{env.rank}.pt"
    state["rank_state"] = {}
    if rank_file.is_file():  # absent when resuming with more ranks than the checkpoint had
        rank_state = torch.load(rank_file, weights_only=True)
        set_rng_state(rank_state.pop("rng"))
        state["rank_state"] = rank_state
    return state


def truncate_metrics(path: Path, last_step: int) -> int:
    """Drop metrics lines after the resumed checkpoint's step (they will be produced again)."""
    if not path.exists():
        return 0
    rows = list(iter_jsonl(path, tolerate_torn_tail=True, strict=False))
    keep = [r for r in rows if int(r.get("step", 0)) <= last_step]
    if len(keep) != len(rows) or path.read_bytes()[-1:] not in (b"\n", b""):
        write_jsonl_atomic(path, keep)
    return len(rows) - len(keep)


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# Logging


class TensorBoard:
    def __init__(self, log_dir: Path, enabled: bool, purge_step: Optional[int]):
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("note: tensorboard is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
            return
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------------------------------
# Eval


@torch.no_grad()
def evaluate(model: nn.Module, lm_head: torch.Tensor, index: HiddenIndex, reader, cfg, env: DistEnv, autocast) -> Optional[dict]:
    """Teacher-forced per-TTT-step accuracy on the eval split, and the implied acceptance length."""
    from common.ttt import ttt_loss

    mine, per_rank, stand_in = eval_micro_batches(index, cfg.train.batch_max_tokens, env.world_size, env.rank)
    if per_rank == 0:
        return None
    K = cfg.train.ttt_steps
    stats = torch.zeros(2 + 3 * K, dtype=torch.float64)  # loss*denominator, denominator, step_loss*den, correct, counts
    was_training = model.training
    model.eval()
    for mb_samples in mine:
        # FSDP needs every rank in every forward: a rank short of eval batches reruns one and ignores it.
        if mb_samples is None and not (env.distributed and cfg.train.parallel == "fsdp"):
            continue
        mb = reader.read(mb_samples if mb_samples is not None else stand_in).to(env.device)
        with autocast():
            out = ttt_loss(model, mb.aux_hidden, mb.input_ids, mb.final_hidden, mb.loss_mask, mb.position_ids,
                           mb.seq_lens, lm_head, K, cfg.train.loss_decay)
        if mb_samples is None:
            continue
        den = out.denominator
        stats[0] += float(out.loss) * den
        stats[1] += den
        stats[2 : 2 + K] += torch.tensor(out.step_losses, dtype=torch.float64) * den
        stats[2 + K : 2 + 2 * K] += torch.tensor(out.step_correct, dtype=torch.float64)
        stats[2 + 2 * K :] += torch.tensor(out.step_counts, dtype=torch.float64)
    model.train(was_training)
    stats = all_reduce_sum(stats, env)
    den = max(1.0, float(stats[1]))
    counts = stats[2 + 2 * K :]
    acc = [float(c) / max(1.0, float(m)) for c, m in zip(stats[2 + K : 2 + 2 * K], counts)]
    ks = sorted({min(3, K), K})
    return {
        "loss": float(stats[0]) / den,
        "step_losses": [float(x) / den for x in stats[2 : 2 + K]],
        "step_acc": acc,
        "step_counts": [int(c) for c in counts],
        "tau": {str(k): expected_acceptance_length(acc, k) for k in ks},
        "num_samples": len(index.split_indices("eval")),
    }


# ---------------------------------------------------------------------------------------
# The run


def _clean_train_dir(train_dir: Path) -> None:
    for name in ("checkpoints", "tb", "final", ".final-tmp", "metrics.jsonl", "eval_report.json"):
        p = train_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _final_complete(final_dir: Path, total_steps: int) -> bool:
    summary = final_dir / "training_summary.json"
    if not summary.is_file():
        return False
    try:
        s = json.loads(summary.read_text())
    except ValueError:
        return False
    return int(s.get("step", -1)) >= total_steps


def run_training(cfg, overwrite: bool = False) -> int:
    env = init_distributed()
    try:
        return _run(cfg, env, overwrite)
    finally:
        if env.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _run(cfg, env: DistEnv, overwrite: bool) -> int:
    from common.model_loading import load_target_info, load_target_tensors

    t = cfg.train
    run_dir = Path(cfg.run_dir)
    train_dir = run_dir / "train"
    ckpt_dir = train_dir / "checkpoints"
    say = (lambda *a: print(*a, flush=True)) if env.is_main else (lambda *a: None)

    # Inputs, validated before anything is written.
    index = HiddenIndex.load(run_dir / "hidden")
    info = load_target_info(cfg)
    if list(info.aux_layer_ids) != list(index.aux_layer_ids):
        raise ConfigError(
            f"the hidden states in {run_dir / 'hidden'} were extracted at aux layers {index.aux_layer_ids} but the config "
            f"resolves target.aux_layer_ids to {info.aux_layer_ids}; rerun 02_extract_hidden.py --overwrite (or fix target.aux_layer_ids)"
        )
    if index.target_hidden_size != info.hidden_size:
        raise DataError(
            f"hidden states have width {index.target_hidden_size} but target.model has hidden size {info.hidden_size}; "
            f"they come from another model: rerun 02_extract_hidden.py --overwrite"
        )
    d2t, t2d = load_vocab_map(run_dir, info.vocab_size, cfg.vocab.draft_vocab_size)
    draft_cfg = build_draft_config(cfg, info, d2t.numel(), index.aux_layer_ids)

    dtype = resolve_precision(cfg, env.device)
    on_gpu = env.device.type == "cuda"
    data = TrainData(index, t.batch_max_tokens, t.seed, world_size=env.world_size, rank=env.rank, grad_accum=t.grad_accum,
                     dtype=dtype, num_workers=t.num_workers, pin_memory=on_gpu)
    total_steps = t.max_steps or data.total_steps(t.epochs)
    model_fp = fingerprint({"draft": dataclasses.asdict(draft_cfg), "data": index.fingerprint(), "d2t": d2t.tolist()[:64],
                            "batch_max_tokens": t.batch_max_tokens, "seed": t.seed})

    if overwrite and env.is_main:
        _clean_train_dir(train_dir)
    barrier(env)
    if _final_complete(train_dir / "final", total_steps):
        say(f"04_train: {train_dir / 'final'} is complete ({total_steps} steps); nothing to do (use --overwrite to retrain)")
        return 0
    if env.is_main:
        train_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(".tmp-step-*") if ckpt_dir.is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)
    barrier(env)

    # Model, seeded: every rank builds the same initial weights.
    from common.draft_model import Eagle3DraftModel

    torch.manual_seed(t.seed)
    random.seed(t.seed + env.rank)
    np.random.seed(t.seed + env.rank)
    if not on_gpu:
        torch.use_deterministic_algorithms(True, warn_only=True)
    target = load_target_tensors(cfg.target.model)
    draft = Eagle3DraftModel(draft_cfg)
    draft.load_target_embedding(target["embed"].float())
    draft.set_vocab_map(d2t, t2d)
    draft.gradient_checkpointing = t.gradient_checkpointing
    draft.to(env.device)
    # The teacher's lm_head: on the device, in the compute dtype; not trained, not saved.
    lm_head = target["lm_head"].to(env.device, dtype=dtype)
    del target
    model = wrap_parallel(draft, env, cfg, dtype)

    trainable = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trainable if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for n, p in trainable if p.ndim < 2], "weight_decay": 0.0},  # norms (and biases)
    ]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), foreach=on_gpu)
    n_params = sum(p.numel() for _, p in trainable)

    # Resume.
    step, pos, tokens_seen, elapsed_before, last_train_loss = 0, DataPosition(), 0, 0.0, float("nan")
    resumed_window: dict = {}
    ckpts = list_checkpoints(ckpt_dir)
    if ckpts:
        ck_step, ck_path = ckpts[-1]
        state = load_checkpoint(ck_path, draft, optimizer, env)
        if state.get("fingerprint") != model_fp:
            raise ConfigError(
                f"checkpoint {ck_path} was made with another draft architecture, data set or packing "
                f"(draft.*, hidden/, vocab/, train.batch_max_tokens or train.seed changed); rerun with --overwrite to start over"
            )
        step, pos = int(state["step"]), DataPosition.from_dict(state["data_position"])
        tokens_seen, elapsed_before = int(state.get("tokens_seen", 0)), float(state.get("elapsed_s", 0.0))
        last_train_loss = float(state.get("last_train_loss", float("nan")))
        resumed_window = state["rank_state"] if state.get("world_size") == env.world_size else {}
        say(f"04_train: resuming from {ck_path} (step {step}/{total_steps}, epoch {pos.epoch})")
        if state.get("global_micro_batches") != data.micro_per_step:
            say(f"04_train: note: global batch changed from {state.get('global_micro_batches')} to {data.micro_per_step} micro-batches per step")
    metrics_path = train_dir / "metrics.jsonl"
    if env.is_main:
        dropped = truncate_metrics(metrics_path, step)
        if dropped:
            say(f"04_train: dropped {dropped} metrics lines after step {step} (they are recomputed)")
    barrier(env)

    say(
        f"04_train: draft {n_params / 1e6:.2f}M trainable params (hidden {draft_cfg.hidden_size}, V_d {draft_cfg.draft_vocab_size}), "
        f"{len(data.samples)} train samples / {data.num_tokens} tokens, {env.world_size} process(es) x grad_accum {t.grad_accum}, "
        f"{total_steps} steps, {str(dtype).replace('torch.', '')} on {env.device.type}, parallel={t.parallel if env.distributed else 'none'}"
    )

    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if (on_gpu and dtype == torch.bfloat16) else (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == torch.bfloat16 else contextlib.nullcontext)
    metrics = JsonlAppender(metrics_path, fsync_every=1) if env.is_main else None
    tb = TensorBoard(train_dir / "tb", env.is_main, purge_step=step + 1 if step else None)
    from tqdm import tqdm

    bar = tqdm(total=total_steps, initial=step, disable=not env.is_main, dynamic_ncols=True, desc="04_train")
    K = t.ttt_steps
    window = torch.zeros(2 + 3 * K, dtype=torch.float64)  # loss, tokens, step_loss*K, correct*K, counts*K (global sums)
    window_steps = 0
    if "log_window" in resumed_window and resumed_window["log_window"].shape == window.shape:
        # continue the partial logging window of the interrupted run: identical metrics lines
        window, window_steps = resumed_window["log_window"].clone(), int(resumed_window["window_steps"])
    t_start = time.time()
    t_window = time.time()
    last_eval, grad_norm = None, float("nan")
    is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    is_fsdp = env.distributed and t.parallel == "fsdp"
    params = [p for _, p in trainable]

    def do_eval(at_step: int):
        report = evaluate(model, lm_head, index, data.reader, cfg, env, autocast)
        if report is None:
            return None
        report = {"type": "eval", "step": at_step, **report}
        if env.is_main:
            metrics.write(report)
            atomic_write_json(train_dir / "eval_report.json", report)
            tb.scalars(at_step, {"eval/loss": report["loss"], **{f"eval/acc_{i}": a for i, a in enumerate(report["step_acc"])},
                                 **{f"eval/tau_{k}": v for k, v in report["tau"].items()}})
            taus = ", ".join(f"k={k}: {v:.2f}" for k, v in report["tau"].items())
            bar.write(f"eval @ step {at_step}: acc per step {[round(a, 3) for a in report['step_acc']]}; expected acceptance length {taus}")
        return report

    def do_checkpoint():
        if env.is_main:
            metrics.sync()
        state = {
            "step": step, "total_steps": total_steps, "data_position": pos.to_dict(), "fingerprint": model_fp,
            "tokens_seen": tokens_seen, "elapsed_s": elapsed_before + time.time() - t_start,
            "world_size": env.world_size, "grad_accum": t.grad_accum, "global_micro_batches": data.micro_per_step,
            "last_train_loss": last_train_loss,
        }
        save_checkpoint(ckpt_dir, step, draft, optimizer, state, env, t.keep_checkpoints,
                        rank_state={"log_window": window.clone(), "window_steps": window_steps})

    from common.ttt import ttt_loss

    model.train()
    while step < total_steps:
        lr = lr_at(step, total_steps, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        mine, next_pos = data.step_micro_batches(pos)
        tokens_seen += data.step_tokens(pos)
        # Every micro-batch loss is a sum over its positions divided by the step-0 position count of
        # the whole global step, so the step's gradient is the token mean over the global batch.
        # DDP/FSDP average gradients over ranks, hence the factor world_size.
        denominator = max(1, data.step_loss_positions(pos))
        optimizer.zero_grad(set_to_none=True)
        for j, mb in enumerate(data.read_step(mine)):
            mb = mb.to(env.device, non_blocking=on_gpu)
            last = j == len(mine) - 1
            sync_ctx = model.no_sync() if (is_ddp and not last) else contextlib.nullcontext()
            if is_fsdp:
                model.set_requires_gradient_sync(last)
            with sync_ctx:
                with autocast():
                    out = ttt_loss(model, mb.aux_hidden, mb.input_ids, mb.final_hidden, mb.loss_mask, mb.position_ids,
                                   mb.seq_lens, lm_head, K, t.loss_decay, denominator=denominator)
                (out.loss * env.world_size).backward()
            window[0] += float(out.loss.detach())
            window[1] += mb.num_tokens
            window[2 : 2 + K] += torch.tensor(out.step_losses, dtype=torch.float64)
            window[2 + K : 2 + 2 * K] += torch.tensor(out.step_correct, dtype=torch.float64)
            window[2 + 2 * K :] += torch.tensor(out.step_counts, dtype=torch.float64)
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else float("inf"))
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        optimizer.step()
        step += 1
        window_steps += 1
        pos = next_pos
        bar.update(1)

        if step % t.log_every == 0 or step == total_steps:
            w = all_reduce_sum(window.clone(), env)
            window.zero_()
            now = time.time()
            n = max(1, window_steps)
            window_steps = 0
            tok_s = float(w[1]) / max(1e-9, now - t_window)
            t_window = now
            counts = w[2 + 2 * K :]
            acc = [float(c) / max(1.0, float(m)) for c, m in zip(w[2 + K : 2 + 2 * K], counts)]
            last_train_loss = float(w[0]) / n
            row = {
                "type": "train", "step": step, "epoch": round(pos.epoch + pos.micro_batch / max(1, len(data.epoch_micro_batches(pos.epoch))), 4),
                "loss": last_train_loss, "step_losses": [float(x) / n for x in w[2 : 2 + K]], "step_acc": acc,
                "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tok_s, "tokens": tokens_seen,
                "elapsed_s": elapsed_before + now - t_start,
            }
            if env.is_main:
                metrics.write(row)
                tb.scalars(step, {"train/loss": row["loss"], "train/lr": lr, "train/grad_norm": grad_norm, "train/tokens_per_s": tok_s,
                                  **{f"train/acc_{i}": a for i, a in enumerate(acc)}})
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{acc[0]:.3f}", tok_s=f"{tok_s:.0f}")
        if t.eval_every > 0 and step % t.eval_every == 0 and step < total_steps:
            last_eval = do_eval(step) or last_eval
        if step % t.checkpoint_every == 0 or step == total_steps:
            do_checkpoint()
    bar.close()

    last_eval = do_eval(step) or last_eval
    elapsed = elapsed_before + time.time() - t_start
    export_final(cfg, env, draft, draft_cfg, index, train_dir, {
        "step": step, "total_steps": total_steps, "tokens": tokens_seen, "elapsed_s": elapsed,
        "tokens_per_s": tokens_seen / max(1e-9, elapsed), "final_train_loss": last_train_loss, "eval": last_eval,
        "world_size": env.world_size, "grad_accum": t.grad_accum, "parallel": t.parallel if env.distributed else "none",
        "trainable_params": n_params, "aux_layer_ids": index.aux_layer_ids, "draft_config": dataclasses.asdict(draft_cfg),
        "config": cfg.to_dict(),
    })
    if env.is_main:
        metrics.close()
        tb.close()
        k3 = (last_eval or {}).get("tau", {})
        tau_txt = "; ".join(f"expected acceptance length at k={k}: {v:.2f}" for k, v in k3.items()) or "no eval split"
        say(f"04_train: done: {step} steps, {tokens_seen} tokens in {elapsed:.0f}s ({tokens_seen / max(1e-9, elapsed):.0f} tok/s), "
            f"final loss {last_train_loss:.4f}; {tau_txt}; draft in {train_dir / 'final'}")
    return 0


def export_final(cfg, env: DistEnv, draft, draft_cfg, index: HiddenIndex, train_dir: Path, summary: dict) -> None:
    """train/final/: the vLLM-loadable draft + training_summary.json, written by rank 0, atomically."""
    from common.export import export_vllm_draft

    full = full_model_state(draft) if (env.distributed and cfg.train.parallel == "fsdp") else None
    if env.is_main:
        tmp, final = train_dir / ".final-tmp", train_dir / "final"
        shutil.rmtree(tmp, ignore_errors=True)
        to_export = draft
        if full is not None:  # FSDP: rebuild an unsharded copy on CPU
            from common.draft_model import Eagle3DraftModel

            to_export = Eagle3DraftModel(draft_cfg)
            to_export.load_state_dict(full, strict=False)
        export_vllm_draft(to_export, tmp, extra_config={"eagle_aux_hidden_state_layer_ids": list(index.aux_layer_ids)})
        atomic_write_json(tmp / "training_summary.json", summary)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(train_dir)
    barrier(env)
