"""The torchrun environment of stages 02 and 04: rank, world size, device, and the few collectives
they use. A single process (no WORLD_SIZE) gets no process group at all, and every helper here is
then a no-op, so the stages never branch on "am I distributed" around a collective.

    env = init_distributed()            # 04: nccl on GPU, gloo on CPU
    env = init_distributed("gloo", timeout=timedelta(days=7))   # 02: coordination only
    try:
        due = on_rank0(lambda: survey(...), env)   # rank 0 decides (reads, hashes), every rank gets it
        ...
        barrier(env)
    finally:
        close_distributed(env)

Also here: `wrap_parallel` (04's DDP / FSDP2 wrapping of the draft) and `NamedSums` (named
counters that cross ranks in one all_reduce and checkpoint as one tensor).
"""

from __future__ import annotations

import itertools
import os
import pickle
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # cuda:LOCAL_RANK when CUDA is available

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(backend: str = "auto", timeout: Optional[timedelta] = None) -> DistEnv:
    """Read RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun), pick this process's device and, with
    more than one process, join the process group. backend "auto": nccl on GPU, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        dist.init_process_group(backend=backend, **kwargs)
    return DistEnv(rank, world, local_rank, device)


def close_distributed(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


_ON_RANK0_CALLS = itertools.count()  # every rank calls on_rank0 in the same order: the n-th call's key
ON_RANK0_POLL_S = 0.2


def on_rank0(fn, env: DistEnv):
    """fn() on rank 0 alone (a decision, or reading and hashing big files once), its result on every rank; its
    PipelineError raised on every rank, so each prints the one error line; any other exception on rank 0 is a
    one-line PipelineError on the other ranks (rank 0 shows its traceback).

    The outcome travels through the process group's key-value store, which the other ranks poll, not through a
    collective: fn may take longer than the process group's timeout (a cold hash of Kimi-K2.5's ~595 GB of
    weights) without tripping it. A rank 0 that dies takes the job down with it (torchrun stops the others)."""
    from common.core.errors import PipelineError

    if not env.distributed:
        return fn()
    store = dist.distributed_c10d._get_default_store()
    key = f"eagle3/on_rank0/{next(_ON_RANK0_CALLS)}"
    if env.is_main:
        try:
            result = fn()
        except PipelineError as e:
            store.set(key, pickle.dumps(("error", e)))
            raise
        except BaseException as e:
            store.set(key, pickle.dumps(("crash", f"{type(e).__name__}: {e}")))
            raise
        store.set(key, pickle.dumps(("result", result)))
        return result
    while not store.check([key]):
        time.sleep(ON_RANK0_POLL_S)
    kind, value = pickle.loads(store.get(key))
    if kind == "error":
        raise value
    if kind == "crash":
        raise PipelineError(f"rank 0 failed ({value}); its traceback is in its output above")
    return value


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """The elementwise sum of `t` over ranks, on t's device (nccl reduces on the GPU, gloo on CPU)."""
    if not env.distributed:
        return t
    backend_device = env.device if dist.get_backend() == "nccl" else torch.device("cpu")
    reduced = t.to(backend_device, copy=True)  # never reduce the caller's tensor in place
    dist.all_reduce(reduced)
    return reduced.to(t.device)


def wrap_parallel(draft: nn.Module, env: DistEnv, parallel: str, dtype: torch.dtype,
                  unit_classes: tuple[type, ...] = ()) -> nn.Module:
    """04's draft, ready for data-parallel training: "ddp" replicates it and averages gradients;
    "fsdp" (FSDP2) shards the trainable weights, gradients and optimizer state as one unit (the whole
    draft), plus a unit per submodule of `unit_classes` (the draft family's fsdp_unit_classes; the Llama
    EAGLE-3 family has none); the frozen target embedding stays replicated.
    ttt_loss calls the wrapped module (`model(...)`), so the DDP/FSDP hooks see every forward."""
    if not env.distributed:
        return draft
    if parallel == "fsdp":
        # The decoder layers return k/v views; nothing modifies them in place (the 2-process FSDP
        # test checks the gradients against one process), so this per-call warning is noise.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        frozen = {p for p in draft.parameters() if not p.requires_grad}  # the target embedding: replicated
        # One unit, not one per decoder layer: a layer runs once per TTT step, and a unit of its own re-gathers
        # its weights in the backward of every step and reduce-scatters them again (7 all-gathers per micro-batch
        # at the Kimi config, ~30 GB per optimizer step over PCIe). As one unit, the draft is gathered once before
        # the steps and stays gathered through their backward (a 1-layer draft has nothing to overlap with).
        for module in [m for m in draft.modules() if m is not draft and isinstance(m, unit_classes)]:
            fully_shard(module, mp_policy=mp, ignored_params=frozen & set(module.parameters()) or None,
                        reshard_after_forward=False)
        fully_shard(draft, mp_policy=mp, ignored_params=frozen, reshard_after_forward=False)
        return draft
    ddp = DDP(draft, device_ids=[env.device.index] if env.device.type == "cuda" else None, broadcast_buffers=False)
    if any(p.dtype != torch.float32 for p in draft.parameters() if p.requires_grad):
        ddp.register_comm_hook(None, fp32_allreduce_hook)  # bf16 compute copy: average its gradients in fp32
    return ddp


def fp32_allreduce_hook(process_group, bucket):
    """DDP comm hook: a bucket of bf16 gradients summed over the ranks in fp32 and rounded once (a bf16 ring
    all-reduce rounds at every hop), averaged as DDP's own reduction."""
    buffer = bucket.buffer()
    wide = buffer.float().div_(dist.get_world_size(process_group))
    future = dist.all_reduce(wide, group=process_group, async_op=True).get_future()
    return future.then(lambda f: buffer.copy_(f.value()[0]))


class NamedSums:
    """Float64 sums kept under names (each a vector of a fixed size) and reduced over ranks as one
    tensor: one collective per report, and one flat tensor (`flat`) to checkpoint.

        window = NamedSums(loss=1, tokens=1, step_correct=K)
        window.add(loss=0.7, tokens=512, step_correct=[12, 9, 7])
        totals = window.all_reduced(env)   # {"loss": tensor([..]), "tokens": ..., "step_correct": ...}
    """

    def __init__(self, **sizes: int):
        self.sizes = sizes
        self.flat = torch.zeros(sum(sizes.values()), dtype=torch.float64)

    def add(self, **values) -> None:
        views = self._split(self.flat)
        for name, value in values.items():
            views[name] += torch.as_tensor(value, dtype=torch.float64)

    def all_reduced(self, env: DistEnv) -> dict[str, torch.Tensor]:
        """The sums over every rank, by name (a copy: this rank's sums are unchanged)."""
        return self._split(all_reduce_sum(self.flat.clone(), env))

    def zero_(self) -> None:
        self.flat.zero_()

    def load_flat(self, flat: torch.Tensor) -> None:
        if flat.shape != self.flat.shape:
            raise ValueError(f"expected {self.flat.numel()} sums ({self.sizes}), got {flat.numel()}")
        self.flat = flat.to(torch.float64).clone()

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.sizes, torch.split(flat, list(self.sizes.values()))))
