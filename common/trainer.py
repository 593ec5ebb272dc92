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
import errno
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

from common.errors import ConfigError, DataError, PipelineError
from common.model_loading import load_target_tensors
from common.io import JsonlAppender, atomic_write_json, fsync_dir, iter_jsonl, read_json, write_jsonl_atomic
from common.train_data import DataPosition, HiddenIndex, TrainData, eval_micro_batches

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
    # 03 caps a draft vocab larger than the target's at the target vocab (with a warning).
    if d2t.numel() != min(draft_vocab_size, target_vocab):
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
        import warnings

        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # The decoder layers return k/v views; nothing modifies them in place (the 2-process FSDP
        # test checks the gradients against one process), so this per-call warning is noise.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

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
    with _writing(f"checkpoint {final}", tmp, ckpt_dir):
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


@contextlib.contextmanager
def _writing(what: str, tmp: Path, where: Path):
    """Turn a failed write (disk full, quota, permissions) into one clear error; remove the partial temp dir.
    safetensors and torch.save report a full disk without an errno, so we look at the free space too."""
    try:
        yield
    except (OSError, RuntimeError) as e:  # SafetensorError is an Exception subclass
        raise _write_error(what, e, tmp, where) from None
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        raise _write_error(what, e, tmp, where) from None


def _write_error(what: str, e: Exception, tmp: Path, where: Path) -> PipelineError:
    shutil.rmtree(tmp, ignore_errors=True)
    reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [type(e).__name__])[0][:200]
    try:
        if shutil.disk_usage(where).free < 64 * 2**20 and os.strerror(errno.ENOSPC) not in reason:
            reason = f"{os.strerror(errno.ENOSPC)} ({reason})"
    except OSError:
        pass
    return PipelineError(f"cannot write {what}: {reason}; free disk space (or fix permissions) and rerun: "
                         f"training resumes from the last complete checkpoint")


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


def _clean_train_dir(train_dir: Path) -> None:
    """--overwrite: remove everything this stage wrote."""
    for name in ("checkpoints", "tb", "final", ".tmp-final", "metrics.jsonl", "eval_report.json"):
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
        return int(json.loads(summary.read_text()).get("step", -1)) >= total_steps
    except ValueError:
        return False


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
    return {
        "loss": float(stats[0]) / den,
        "step_losses": [float(x) / den for x in stats[2 : 2 + K]],
        "step_acc": acc,
        "step_counts": [int(c) for c in counts],
        "tau": {str(k): expected_acceptance_length(acc, k) for k in range(1, K + 1)},
        "num_samples": len(index.split_indices("eval")),
    }


# ---------------------------------------------------------------------------------------
# The run


def run_training(cfg, overwrite: bool = False) -> int:
    env = init_distributed()
    try:
        return Trainer(cfg, env).run(overwrite)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise PipelineError(f"cannot write under {Path(cfg.run_dir) / 'train'}: {e.strerror}; free disk space and rerun: "
                                f"training resumes from the last complete checkpoint") from None
        raise
    finally:
        if env.distributed and dist.is_initialized():
            dist.destroy_process_group()


class Trainer:
    """One training run: inputs -> model -> (resume) -> steps with logging, eval, checkpoints -> export."""

    def __init__(self, cfg, env: DistEnv):
        from common.model_loading import load_target_info

        self.cfg, self.env, self.t = cfg, env, cfg.train
        self.train_dir = Path(cfg.run_dir) / "train"
        self.ckpt_dir = self.train_dir / "checkpoints"
        self.metrics_path = self.train_dir / "metrics.jsonl"

        # Inputs, validated before anything is written.
        run_dir = Path(cfg.run_dir)
        self.index = HiddenIndex.load(run_dir / "hidden")
        self.info = load_target_info(cfg)
        if list(self.info.aux_layer_ids) != list(self.index.aux_layer_ids):
            raise ConfigError(
                f"the hidden states in {run_dir / 'hidden'} were extracted at aux layers {self.index.aux_layer_ids} but the "
                f"config resolves target.aux_layer_ids to {self.info.aux_layer_ids}; rerun 02_extract_hidden.py --overwrite "
                f"(or fix target.aux_layer_ids)"
            )
        if self.index.target_hidden_size != self.info.hidden_size:
            raise DataError(
                f"hidden states have width {self.index.target_hidden_size} but target.model has hidden size "
                f"{self.info.hidden_size}; they come from another model: rerun 02_extract_hidden.py --overwrite"
            )
        self.d2t, self.t2d = load_vocab_map(run_dir, self.info.vocab_size, cfg.vocab.draft_vocab_size)
        self.draft_cfg = build_draft_config(cfg, self.info, self.d2t.numel(), self.index.aux_layer_ids)

        self.dtype = resolve_precision(cfg, env.device)
        self.on_gpu = env.device.type == "cuda"
        t = self.t
        self.data = TrainData(self.index, t.batch_max_tokens, t.seed, world_size=env.world_size, rank=env.rank,
                              grad_accum=t.grad_accum, dtype=self.dtype, num_workers=t.num_workers, pin_memory=self.on_gpu)
        self.total_steps = t.max_steps or self.data.total_steps(t.epochs)
        # What a checkpoint must agree with to be resumable (hyper-parameters like lr may change).
        self.fingerprint = fingerprint({
            "draft": dataclasses.asdict(self.draft_cfg), "data": self.index.fingerprint(),
            "d2t": hashlib.sha256(self.d2t.numpy().tobytes()).hexdigest(),
            "batch_max_tokens": t.batch_max_tokens, "seed": t.seed,
        })
        from common.draft_model import ATTENTION_IMPLS

        if t.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"train.attention_impl must be one of {sorted(ATTENTION_IMPLS)}, got '{t.attention_impl}'")
        self.K = t.ttt_steps
        self.shown_ks = sorted({min(3, self.K), self.K})  # printed; eval_report.json has every k = 1..ttt_steps
        if self.on_gpu and self.dtype == torch.bfloat16:
            self.autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
        elif self.dtype == torch.bfloat16:
            self.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
        else:
            self.autocast = contextlib.nullcontext

    def say(self, *args) -> None:
        if self.env.is_main:
            print(*args, flush=True)

    # -- setup ----------------------------------------------------------------------------

    def build_model(self) -> None:
        """Draft (seeded: every rank builds the same weights), teacher lm_head, parallel wrapper, AdamW."""
        from common.draft_model import Eagle3DraftModel

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
        draft.gradient_checkpointing = t.gradient_checkpointing
        draft.attention_impl = t.attention_impl
        draft.to(env.device)
        self.draft = draft
        # The teacher's lm_head: on the device, in the compute dtype; not trained, not saved.
        self.lm_head = target["lm_head"].to(env.device, dtype=self.dtype)
        del target
        self.model = wrap_parallel(draft, env, self.cfg, self.dtype)
        self.is_ddp = isinstance(self.model, nn.parallel.DistributedDataParallel)
        self.is_fsdp = env.distributed and t.parallel == "fsdp"

        trainable = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
        self.params = [p for _, p in trainable]
        self.n_params = sum(p.numel() for p in self.params)
        groups = [
            {"params": [p for _, p in trainable if p.ndim >= 2], "weight_decay": t.weight_decay},
            {"params": [p for _, p in trainable if p.ndim < 2], "weight_decay": 0.0},  # norms: no decay
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), foreach=self.on_gpu)

    def init_state(self) -> None:
        """Fresh counters, or the latest complete checkpoint's."""
        self.step, self.pos = 0, DataPosition()
        self.tokens_seen, self.elapsed_before, self.last_train_loss = 0, 0.0, float("nan")
        self.window = torch.zeros(2 + 3 * self.K, dtype=torch.float64)  # loss, tokens, step_loss*K, correct*K, counts*K
        self.window_steps, self.window_time = 0, 0.0
        self.last_eval = None
        ckpts = list_checkpoints(self.ckpt_dir)
        if ckpts:
            _, path = ckpts[-1]
            state = load_checkpoint(path, self.draft, self.optimizer, self.env)
            if state.get("fingerprint") != self.fingerprint:
                raise ConfigError(
                    f"checkpoint {path} was made with another draft architecture, data set or packing (draft.*, hidden/, "
                    f"vocab/, train.batch_max_tokens or train.seed changed); rerun with --overwrite to start over"
                )
            self.step, self.pos = int(state["step"]), DataPosition.from_dict(state["data_position"])
            self.tokens_seen, self.elapsed_before = int(state["tokens_seen"]), float(state["elapsed_s"])
            self.last_train_loss = float(state.get("last_train_loss", float("nan")))
            rank_state = state["rank_state"]
            if state.get("world_size") == self.env.world_size and "log_window" in rank_state:
                # continue the interrupted run's partial logging window: identical metrics lines
                self.window = rank_state["log_window"].clone()
                self.window_steps, self.window_time = int(rank_state["window_steps"]), float(rank_state["window_time"])
            self.say(f"04_train: resuming from {path} (step {self.step}/{self.total_steps}, epoch {self.pos.epoch})")
            if state.get("global_micro_batches") != self.data.micro_per_step:
                self.say(f"04_train: note: the global batch changed from {state.get('global_micro_batches')} to "
                         f"{self.data.micro_per_step} micro-batches per step")
        if self.env.is_main:
            dropped = truncate_metrics(self.metrics_path, self.step)
            if dropped:
                self.say(f"04_train: dropped {dropped} metrics lines after step {self.step} (they are recomputed)")
            report = self.train_dir / "eval_report.json"
            if report.is_file() and read_json(report).get("step") == self.step:
                self.last_eval = read_json(report)
        barrier(self.env)

    # -- the loop -------------------------------------------------------------------------

    def run(self, overwrite: bool) -> int:
        env, t = self.env, self.t
        if overwrite and env.is_main:
            _clean_train_dir(self.train_dir)
        barrier(env)
        if _final_complete(self.train_dir / "final", self.total_steps):
            self.say(f"04_train: {self.train_dir / 'final'} is complete ({self.total_steps} steps); nothing to do "
                     f"(use --overwrite to retrain)")
            return 0
        if env.is_main:
            self.train_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.ckpt_dir.glob(".tmp-step-*") if self.ckpt_dir.is_dir() else []:
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
        self.metrics = JsonlAppender(self.metrics_path, fsync_every=1) if env.is_main else None
        self.tb = TensorBoard(self.train_dir / "tb", env.is_main, purge_step=self.step + 1 if self.step else None)
        from tqdm import tqdm

        self.bar = tqdm(total=self.total_steps, initial=self.step, disable=not env.is_main, dynamic_ncols=True, desc="04_train")
        self.t_start = time.time()
        self.batches = self.data.stream(self.pos, self.total_steps - self.step)
        self.model.train()
        try:
            while self.step < self.total_steps:
                self.train_step()
                done = self.step == self.total_steps
                if self.step % t.log_every == 0 or done:
                    self.log()
                if (t.eval_every > 0 and self.step % t.eval_every == 0) or done:
                    self.last_eval = self.evaluate() or self.last_eval
                if self.step % t.checkpoint_every == 0 or done:
                    self.save()
            self.bar.close()
            self.finish()
        finally:
            self.close_logs()
        return 0

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
        t, env, K = self.t, self.env, self.K
        from common.ttt import ttt_loss

        t0 = time.perf_counter()
        lr = lr_at(self.step, self.total_steps, self.cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        mine, next_pos = self.data.step_micro_batches(self.pos)
        self.tokens_seen += self.data.step_tokens(self.pos)
        # Each micro-batch loss is a sum over its positions divided by the step-0 position count of
        # the whole global step, so the step's gradient is the token mean over the global batch
        # (same for any split into ranks x micro-batches). DDP/FSDP average over ranks: x world_size.
        denominator = max(1, self.data.step_loss_positions(self.pos))
        self.optimizer.zero_grad(set_to_none=True)
        for j in range(len(mine)):
            mb = next(self.batches)
            assert mb.sample_ids == [self.index.samples[i].sample_id for i in mine[j]], "data stream out of step"
            mb = mb.to(env.device, non_blocking=self.on_gpu)
            last = j == len(mine) - 1
            sync = self.model.no_sync() if (self.is_ddp and not last) else contextlib.nullcontext()
            if self.is_fsdp:
                self.model.set_requires_gradient_sync(last)
            with sync:
                with self.autocast():
                    out = ttt_loss(self.model, mb.aux_hidden, mb.input_ids, mb.final_hidden, mb.loss_mask, mb.position_ids,
                                   mb.seq_lens, self.lm_head, K, t.loss_decay, denominator=denominator)
                (out.loss * env.world_size).backward()
            w = self.window
            w[0] += float(out.loss.detach())
            w[1] += mb.num_tokens
            w[2 : 2 + K] += torch.tensor(out.step_losses, dtype=torch.float64)
            w[2 + K : 2 + 2 * K] += torch.tensor(out.step_correct, dtype=torch.float64)
            w[2 + 2 * K :] += torch.tensor(out.step_counts, dtype=torch.float64)
        norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip if t.grad_clip > 0 else float("inf"))
        self.grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.lr = lr
        self.step += 1
        self.pos = next_pos
        self.window_steps += 1
        self.window_time += time.perf_counter() - t0
        self.bar.update(1)

    def log(self) -> None:
        """One metrics line: means over the steps since the last line, summed over ranks."""
        K = self.K
        w = all_reduce_sum(self.window.clone(), self.env)
        n = max(1, self.window_steps)
        tok_s = float(w[1]) / max(1e-9, self.window_time)  # training time only (no eval/checkpoint)
        counts = w[2 + 2 * K :]
        acc = [float(c) / max(1.0, float(m)) for c, m in zip(w[2 + K : 2 + 2 * K], counts)]
        self.last_train_loss = float(w[0]) / n
        self.window.zero_()
        self.window_steps, self.window_time = 0, 0.0
        epoch = self.pos.epoch + (self.pos.micro_batch / len(self.data.epoch_micro_batches(self.pos.epoch)) if self.pos.micro_batch else 0.0)
        row = {
            "type": "train", "step": self.step, "epoch": round(epoch, 4), "loss": self.last_train_loss,
            "step_losses": [float(x) / n for x in w[2 : 2 + K]], "step_acc": acc, "lr": self.lr, "grad_norm": self.grad_norm,
            "tokens_per_s": tok_s, "tokens": self.tokens_seen, "elapsed_s": self.elapsed(),
        }
        if self.env.is_main:
            self.metrics.write(row)
            self.tb.scalars(self.step, {"train/loss": row["loss"], "train/lr": self.lr, "train/grad_norm": self.grad_norm,
                                        "train/tokens_per_s": tok_s, **{f"train/acc_{i}": a for i, a in enumerate(acc)}})
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{acc[0]:.3f}", tok_s=f"{tok_s:.0f}")

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t_start

    def evaluate(self) -> Optional[dict]:
        report = evaluate(self.model, self.lm_head, self.index, self.data.reader, self.cfg, self.env, self.autocast)
        if report is None:
            return None
        report = {"type": "eval", "step": self.step, **report}
        if self.env.is_main:
            self.metrics.write(report)
            atomic_write_json(self.train_dir / "eval_report.json", report)
            self.tb.scalars(self.step, {"eval/loss": report["loss"], **{f"eval/acc_{i}": a for i, a in enumerate(report["step_acc"])},
                                        **{f"eval/tau_{k}": v for k, v in report["tau"].items()}})
            taus = ", ".join(f"k={k}: {report['tau'][str(k)]:.2f}" for k in self.shown_ks)
            self.bar.write(f"eval @ step {self.step}: accuracy per TTT step {[round(a, 3) for a in report['step_acc']]}; "
                           f"expected acceptance length at {taus}")
        return report

    def save(self) -> None:
        if self.env.is_main:
            self.metrics.sync()  # lines up to this step are on disk before the checkpoint that vouches for them
        state = {
            "step": self.step, "total_steps": self.total_steps, "data_position": self.pos.to_dict(),
            "fingerprint": self.fingerprint, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed(),
            "world_size": self.env.world_size, "grad_accum": self.t.grad_accum,
            "global_micro_batches": self.data.micro_per_step, "last_train_loss": self.last_train_loss,
        }
        rank_state = {"log_window": self.window.clone(), "window_steps": self.window_steps, "window_time": self.window_time}
        save_checkpoint(self.ckpt_dir, self.step, self.draft, self.optimizer, state, self.env, self.t.keep_checkpoints, rank_state)

    def finish(self) -> None:
        elapsed = self.elapsed()
        summary = {
            "step": self.step, "total_steps": self.total_steps, "tokens": self.tokens_seen, "elapsed_s": elapsed,
            "tokens_per_s": self.tokens_seen / max(1e-9, elapsed), "final_train_loss": self.last_train_loss,
            "eval": self.last_eval, "world_size": self.env.world_size, "grad_accum": self.t.grad_accum,
            "parallel": self.t.parallel if self.env.distributed else "none", "trainable_params": self.n_params,
            "aux_layer_ids": self.index.aux_layer_ids, "draft_config": dataclasses.asdict(self.draft_cfg),
            "config": self.cfg.to_dict(),
        }
        export_final(self.cfg, self.env, self.draft, self.draft_cfg, self.index, self.train_dir, summary)
        if self.env.is_main:
            taus = (self.last_eval or {}).get("tau", {})
            tau_txt = "; ".join(f"expected acceptance length at k={k}: {taus[str(k)]:.2f}" for k in self.shown_ks) if taus \
                else "no eval split"
            self.say(f"04_train: done: {self.step} steps, {self.tokens_seen} tokens in {elapsed:.0f}s "
                     f"({self.tokens_seen / max(1e-9, elapsed):.0f} tok/s), final loss {self.last_train_loss:.4f}; {tau_txt}; "
                     f"draft in {self.train_dir / 'final'}")


def export_final(cfg, env: DistEnv, draft, draft_cfg, index: HiddenIndex, train_dir: Path, summary: dict) -> None:
    """train/final/: the vLLM-loadable draft + training_summary.json, written by rank 0, atomically."""
    full = full_model_state(draft) if (env.distributed and cfg.train.parallel == "fsdp") else None  # collective
    tmp, final = train_dir / ".tmp-final", train_dir / "final"
    with _writing(f"the final draft {final}", tmp, train_dir):
        _export_on_main(env, draft, draft_cfg, index, summary, full, tmp, final)
    barrier(env)


def _export_on_main(env, draft, draft_cfg, index, summary, full, tmp: Path, final: Path) -> None:
    from common.export import export_vllm_draft

    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        to_export = draft
        if full is not None:  # FSDP: an unsharded copy on CPU
            from common.draft_model import Eagle3DraftModel

            to_export = Eagle3DraftModel(draft_cfg)
            to_export.load_state_dict(full, strict=False)
        export_vllm_draft(to_export, tmp, extra_config={"eagle_aux_hidden_state_layer_ids": list(index.aux_layer_ids)})
        atomic_write_json(tmp / "training_summary.json", summary)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
