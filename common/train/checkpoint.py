"""Stage 04's full-state checkpoints: save, list, verify, load, and fall back past a broken one.

    train/checkpoints/step-N/
        model.safetensors   trainable weights (fp32, unsharded; the frozen target embedding is left out)
        optimizer.pt        AdamW + schedule state, plain tensors (torch.load(weights_only=True))
        rank{r}.pt          each rank's RNG state and partial logging window
        state.json          step, data position, fingerprint, counters, the best checkpoint so far ("best"),
                            the eval of this step ("eval", null when none ran at it: train/best's prediction)
        ledger.json         which train sample was trained in which epoch (common.train.ledger)
        manifest.json       bytes and sha256 of every file above, written last

A checkpoint is written under .tmp-step-N and renamed, so a step-N directory is complete when it
was written. Disks still fail afterwards (a truncated copy, a bad block): `load_latest` checks the
newest checkpoint's files against its manifest and, when one is damaged, warns, removes it and
falls back to the previous intact checkpoint (train.keep_checkpoints are kept for this). Pruning
keeps, beyond the newest train.keep_checkpoints, the best checkpoint (highest replayed acceptance
length) that each kept one records in state.json["best"].
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from common.core.distributed import DistEnv, barrier, on_rank0
from common.core.errors import DataError, PipelineError
from common.core.run_folder import Layout
from common.core.io import file_sha256, fsync_dir, iter_jsonl, write_jsonl_atomic
from common.train.ledger import LEDGER_FILE, SampleLedger

MANIFEST = "manifest.json"
REQUIRED = ("model.safetensors", "optimizer.pt", "state.json", LEDGER_FILE, MANIFEST)


def frozen_names(draft: nn.Module) -> set[str]:
    """The frozen target embedding (and any other frozen weight): never checkpointed."""
    return {n for n, p in draft.named_parameters() if not p.requires_grad}


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


# ---------------------------------------------------------------------------------------
# Saving


def save_checkpoint(layout: Layout, step: int, draft, optimizer, state: dict, env: DistEnv, keep: int,
                    rank_state: Optional[dict] = None, files: Optional[dict[str, str]] = None) -> Optional[Path]:
    """Every rank calls this (FSDP gathers are collective). Atomic: temp dir, then rename.
    rank_state: this rank's extra state (plain tensors/numbers), stored next to its RNG state;
    files: more text files of the checkpoint ({name: text}, from rank 0: the sample ledger)."""
    from safetensors.torch import save_file

    model_sd = full_model_state(draft)
    optim_sd = full_optimizer_state(draft, optimizer)
    final, tmp, ckpt_dir = layout.checkpoint(step), layout.checkpoint_tmp(step), layout.checkpoints
    with writing(f"checkpoint {final}", tmp, ckpt_dir):
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
            for name, text in (files or {}).items():
                (tmp / name).write_text(text, encoding="utf-8")
            write_manifest(tmp)
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(ckpt_dir)
            prune_checkpoints(layout, keep)
        barrier(env)
    return final


def best_step_of(path: Path) -> Optional[int]:
    """The step of the best checkpoint (best replayed acceptance length) that checkpoint `path` records, if any."""
    try:
        best = json.loads((path / "state.json").read_text()).get("best")
        return int(best["step"]) if best else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prune_checkpoints(layout: Layout, keep: int) -> None:
    """Keep the newest `keep` checkpoints and the best checkpoint each of them records (a resume from any
    of them finds its best one); remove the rest (docs/design.md#resume-rules)."""
    dirs = layout.checkpoint_dirs()
    kept = dirs[-keep:]
    protected = {step for step, _ in kept} | {b for _, path in kept if (b := best_step_of(path)) is not None}
    for step, old in dirs:
        if step not in protected:
            shutil.rmtree(old, ignore_errors=True)


def write_manifest(directory: Path) -> None:
    """manifest.json: bytes and sha256 of every file of the checkpoint (read back from the page cache)."""
    files = {f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
             for f in sorted(directory.iterdir()) if f.is_file() and f.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=2) + "\n")


@contextlib.contextmanager
def writing(what: str, tmp: Path, where: Path):
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


# ---------------------------------------------------------------------------------------
# Verifying and loading


def checkpoint_problem(path: Path) -> Optional[str]:
    """What is wrong with a checkpoint's files, or None if they are whole: every file its manifest lists has the
    size and sha256 recorded when it was written."""
    missing = [name for name in REQUIRED if not (path / name).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"damaged ({MANIFEST} is unreadable)"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"missing {name}"
        if f.stat().st_size != want["bytes"]:
            return f"damaged ({name} has {f.stat().st_size} bytes, {want['bytes']} were written)"
        if file_sha256(f) != want["sha256"]:
            return f"damaged ({name} does not match the sha256 recorded when it was written)"
    return None


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
    state["ledger"] = SampleLedger.from_file(path / LEDGER_FILE)
    rank_file = path / f"rank{env.rank}.pt"
    state["rank_state"] = {}
    if rank_file.is_file():  # absent when resuming with more ranks than the checkpoint had
        rank_state = torch.load(rank_file, weights_only=True)
        set_rng_state(rank_state.pop("rng"))
        state["rank_state"] = rank_state
    return state


def load_latest(layout: Layout, draft, optimizer, env: DistEnv) -> Optional[tuple[Path, dict]]:
    """Load the newest intact checkpoint into draft and optimizer; (its path, its state), or None.

    A damaged or unreadable newer checkpoint is reported on stderr and removed (training redoes
    its steps from the previous one, exactly). Rank 0 checks the files; every rank loads the same one.
    """
    for _, path in reversed(layout.checkpoint_dirs()):
        problem = on_rank0(lambda: checkpoint_problem(path), env)
        if problem is None:
            try:
                return path, load_checkpoint(path, draft, optimizer, env)
            except DataError:
                raise  # a checkpoint of another model: a setting changed, not a damaged file
            except Exception as e:  # noqa: BLE001 - torch/safetensors raise many types on bad bytes
                problem = f"unreadable ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"
        if env.is_main:
            print(f"04_train: warning: checkpoint {path} is {problem}; removing it and resuming from the previous "
                  f"checkpoint", file=sys.stderr, flush=True)
            shutil.rmtree(path, ignore_errors=True)
        barrier(env)
    return None


# ---------------------------------------------------------------------------------------
# The rest of train/ that a resume or --overwrite touches


def truncate_metrics(path: Path, last_step: int) -> int:
    """Drop metrics lines after the resumed checkpoint's step (they will be produced again)."""
    if not path.exists():
        return 0
    rows = list(iter_jsonl(path, tolerate_torn_tail=True, strict=False))
    keep = [r for r in rows if int(r.get("step", 0)) <= last_step]
    if len(keep) != len(rows) or path.read_bytes()[-1:] not in (b"\n", b""):
        write_jsonl_atomic(path, keep)
    return len(rows) - len(keep)


def clean_train_dir(layout: Layout) -> None:
    """--overwrite: remove everything stage 04 wrote."""
    for p in layout.train_outputs():
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
