"""04's training step, assembled in one place (build_step) for 04's trainer and every benchmark
(docs/design.md#the-training-step-04).

    settings = StepSettings.from_train(cfg.train, dtype, compile)            # or StepSettings(...) by hand (benches)
    step = build_step(draft, teacher_head, settings, env, fsdp_units)        # draft: fp32 master weights
    result = step.run(micro_batches, count, denominator, lr)                 # forward + backward each, clip, AdamW
    out = StepLoss(draft, teacher_head, settings)(micro_batch)               # the loss alone (offline eval)

Two layers:
- `StepLoss`: the TTT loss of one micro-batch as training computes it: the compute copy, the precision
  (autocast), the compiled regions. 04's trainer evaluates through its step's loss (`step.loss`), and an
  exported draft is evaluated through one of its own, with no optimizer.
- `TrainStep`: one optimizer step on top of a StepLoss: the parallel wrapper (DDP/FSDP), gradient
  accumulation over micro-batches, the L2-SP anchor, clipping and AdamW.

What one optimizer step does, and why it is cheap for the host (the GPU must not wait on Python):
- bf16 precision: the forward and backward run on a bf16 *compute copy* of the draft (`ComputeCopy`); the
  optimizer updates the fp32 master weights (the draft itself, which checkpoints and exports see) from the
  copy's gradients, then refreshes the copy once. Autocast then has no fp32 weight to re-cast at every
  use and in every recomputation (18% of the GPU time when it did). FSDP does the same through its
  mixed-precision policy (bf16 all-gather of fp32 shards), so it gets no copy. fp32: no copy.
- the TTT loss (common.model.ttt.ttt_loss): one host sync per micro-batch; the attention
  (common.model.draft.attention.TTTAttention) and the draft lm_head + loss (common.model.ttt.SoftCrossEntropy) have
  hand-written backward passes that keep no [rows, keys] or [rows, V_d] tensor between forward and backward.
- `compile_regions`: torch.compile over each decoder layer's dense parts (norms, projections, RoPE, MLP) with
  fullgraph=True (a graph break is an error, not a slow path), dynamic in the token count so one compile
  serves every micro-batch; train.compile "auto" = on CUDA only (a CPU run would spend its time compiling).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch import nn

from common.core.distributed import DistEnv, wrap_parallel
from common.model.draft import DraftModelContract
from common.model.ttt import TTTOutput, ttt_loss
from common.train.optim import build_optimizer


@dataclass(kw_only=True)
class StepSettings:
    """train.* as the step uses them, with dtype and compile resolved for the device."""
    # the loss (StepLoss)
    ttt_steps: int
    loss_decay: float
    dtype: torch.dtype = torch.float32  # compute dtype: bf16 = compute copy + autocast
    parallel: str = "ddp"  # ddp | fsdp (with more than one process; fsdp: no compute copy)
    compile: bool = False
    compile_backend: str = "inductor"  # tests: "aot_eager" (dynamo + AOT autograd, no kernels generated)
    # the update (TrainStep); AdamW as common.train.optim.build_optimizer builds it, the defaults are train.*'s
    grad_clip: float  # 0 = no clipping
    anchor_weight: float = 0.0  # L2-SP lambda towards the weights at set_anchor() (train.anchor_weight); 0 = off
    lr: float = 1e-4  # the initial lr: run(..., lr) sets each step's
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0

    @classmethod
    def from_train(cls, t, dtype: torch.dtype = torch.float32, compile: bool = False) -> "StepSettings":
        """From the config's train section; dtype and compile as resolved for the device (resolve_precision,
        resolve_compile)."""
        return cls(ttt_steps=t.ttt_steps, loss_decay=t.loss_decay, grad_clip=t.grad_clip, dtype=dtype,
                   parallel=t.parallel, compile=compile, anchor_weight=t.anchor_weight, lr=t.lr, betas=tuple(t.betas),
                   weight_decay=t.weight_decay)


@dataclass
class StepResult:
    outputs: list[tuple[TTTOutput, bool, int]] = field(default_factory=list)  # per micro-batch: output, real, tokens
    grad_norm: float = float("nan")
    applied: bool = False  # False: the gradient was not finite and nothing was updated
    anchor_loss: float = 0.0  # lambda * sum((w - w_anchor)^2) at the weights the gradient was taken at


class ComputeCopy:
    """A bf16 copy of the fp32 master draft that forward and backward run on. The frozen target embedding
    and the vocab-map buffers are shared with the master, not copied."""

    def __init__(self, master: DraftModelContract, dtype: torch.dtype):
        shared = {id(master.embedding.weight): master.embedding.weight}
        self.module = copy.deepcopy(master, memo=shared)
        self.master_params = [p for p in master.parameters() if p.requires_grad]
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        for p in self.params:
            p.data = p.data.to(dtype)

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """The copy's gradients (bf16) into the masters' .grad (fp32, allocated once and overwritten every step:
        nothing needs zeroing); the copy's are dropped."""
        for m, c in zip(self.master_params, self.params):
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            if c.grad is None:  # a parameter no loss reached this step
                c.grad = torch.zeros_like(c)
        torch._foreach_copy_([m.grad for m in self.master_params], [c.grad for c in self.params])
        for c in self.params:
            c.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """master -> copy, after each optimizer step and after a checkpoint was loaded into the master."""
        torch._foreach_copy_(self.params, self.master_params)


class StepLoss:
    """The TTT loss of one micro-batch, computed as 04 trains: `loss(mb)`; see the module docstring."""

    def __init__(self, draft: DraftModelContract, teacher_head: torch.Tensor, settings: StepSettings,
                 env: Optional[DistEnv] = None):
        """draft: the fp32 master; teacher_head: the target's lm_head (in the compute dtype, on the device);
        env: whether FSDP will shard the draft (then no compute copy: FSDP's bf16 all-gather is one)."""
        self.draft, self.teacher_head, self.s = draft, teacher_head, settings
        distributed = env is not None and env.distributed
        self.fsdp = distributed and settings.parallel == "fsdp"
        # FSDP's mixed-precision policy already computes on bf16 all-gathered copies of fp32 shards
        self.copy = ComputeCopy(draft, settings.dtype) if settings.dtype != torch.float32 and not self.fsdp else None
        self.compute = self.copy.module if self.copy else draft  # the module forward and backward run on
        if settings.compile:
            self.compute.compile_regions(settings.compile_backend)
        self.model = self.compute  # what the loss calls: TrainStep puts the DDP/FSDP wrapper here

    def __call__(self, mb, denominator: Optional[float] = None, per_position: bool = False) -> TTTOutput:
        """The TTT loss of micro-batch `mb` (on the device), through the (wrapped) compute model."""
        with self.autocast():
            return ttt_loss(self.model, mb.aux_hidden, mb.input_ids, mb.final_hidden, mb.loss_mask, mb.position_ids,
                            mb.seq_lens, self.teacher_head, self.s.ttt_steps, self.s.loss_decay, denominator=denominator,
                            per_position=per_position)

    def autocast(self):
        if self.s.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.teacher_head.device.type, dtype=self.s.dtype)

    def describe_precision(self) -> str:
        if self.s.dtype == torch.float32:
            return "fp32 weights and compute"
        how = "FSDP's bf16 all-gather of fp32 shards" if self.fsdp else "a bf16 compute copy"
        return f"fp32 master weights, {how}"

    def refresh(self) -> None:
        """The master changed outside a step (a checkpoint was loaded into it): bring the compute copy along."""
        if self.copy is not None:
            self.copy.refresh()


class TrainStep:
    """One optimizer step over some micro-batches, on top of a StepLoss; see the module docstring."""

    def __init__(self, loss: StepLoss, make_optimizer, env: Optional[DistEnv] = None, wrap=None):
        """make_optimizer(draft) -> its optimizer, called once the draft is wrapped (FSDP replaces its parameters);
        wrap(module) -> the DDP/FSDP-wrapped module (common.core.distributed.wrap_parallel). The settings are the
        loss's (loss.s)."""
        self.loss, self.s = loss, loss.s
        # the wrapper goes around the module the loss runs (the compute copy when there is one) and the loss calls
        # it, so DDP's gradient hooks and FSDP's all-gathers see every forward
        if wrap is not None:
            loss.model = wrap(loss.compute)
        self.model = loss.model
        self.ddp = isinstance(self.model, nn.parallel.DistributedDataParallel)
        self.fsdp = loss.fsdp
        self.optimizer = make_optimizer(loss.draft)
        self.world_size = env.world_size if env is not None else 1
        self.params = [p for p in loss.draft.parameters() if p.requires_grad]
        self.anchor: Optional[list[torch.Tensor]] = None  # set_anchor()

    @torch.no_grad()
    def set_anchor(self) -> None:
        """Anchor the weights to their values now (04: the init's): with anchor_weight > 0 every step adds the
        gradient of anchor_weight * sum((w - w_anchor)^2). An fp32 copy of the masters (FSDP: of this rank's shards)."""
        self.anchor = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def add_anchor_gradient(self) -> float:
        """Add 2 lambda (w - w_anchor) to the masters' gradients, once per optimizer step, after the micro-batches'
        gradients are accumulated and all-reduced: the same on every rank, whatever the split into ranks and
        micro-batches (a loss term would be scaled by each micro-batch's weight). Returns the penalty."""
        for p in self.params:
            if p.grad is None:  # no loss reached it this step: the anchor still does
                p.grad = torch.zeros_like(p)
        # foreach: a few kernels for all the weights, not three per weight (the step is host-bound on GPUs)
        drift = torch._foreach_sub(self.params, self.anchor)
        torch._foreach_add_([p.grad for p in self.params], drift, alpha=2 * self.s.anchor_weight)
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(drift)))
        total = total.full_tensor() if hasattr(total, "full_tensor") else total  # FSDP: over every rank's shards
        return self.s.anchor_weight * float(total) ** 2

    def run(self, micro_batches: Iterable, count: int, denominator: Optional[float], lr: Optional[float] = None) -> StepResult:
        """micro_batches yields `count` pairs (micro-batch on the device, real): a stand-in (real False) keeps
        the collectives of a rank that ran out of data in step, with weight 0. Each loss is a sum divided by
        `denominator` (the whole global step's count), so the gradient is the mean over the global batch;
        DDP/FSDP average over ranks, hence x world_size. denominator None: each micro-batch's own step-0 count."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        compute_copy = self.loss.copy
        if compute_copy is None:  # with a copy, its gradients start at None and overwrite the masters'
            self.optimizer.zero_grad(set_to_none=True)
        result = StepResult()
        for j, (mb, real) in enumerate(micro_batches):
            last = j == count - 1
            sync = self.model.no_sync() if (self.ddp and not last) else contextlib.nullcontext()
            if self.fsdp:
                self.model.set_requires_gradient_sync(last)
            with sync:
                out = self.loss(mb, denominator)
                (out.loss * (self.world_size if real else 0.0)).backward()
            result.outputs.append((out, real, mb.num_tokens))
        if compute_copy is not None:
            compute_copy.grads_to_master()
        if self.anchor is not None and self.s.anchor_weight > 0:  # before clipping: clipped as part of the loss's gradient
            result.anchor_loss = self.add_anchor_gradient()
        clip = self.s.grad_clip if self.s.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        result.grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(result.grad_norm):  # the same on every rank (the gradients are all-reduced)
            return result
        self.optimizer.step()
        if compute_copy is not None:
            compute_copy.refresh()
        result.applied = True
        return result


def build_step(draft: DraftModelContract, teacher_head: torch.Tensor, settings: StepSettings,
               env: Optional[DistEnv] = None, fsdp_units: tuple[type, ...] = ()) -> TrainStep:
    """04's training step over `draft` (the fp32 master), as 04's trainer and the benches run it: the loss
    (StepLoss), the parallel wrapper when `env` has several processes (common.core.distributed.wrap_parallel;
    fsdp_units: the draft family's fsdp_unit_classes) and 04's AdamW (multi-tensor updates on GPU)."""
    def wrap(module):
        return wrap_parallel(module, env, settings.parallel, settings.dtype, fsdp_units)

    def adamw(module):
        on_gpu = teacher_head.device.type == "cuda"
        return build_optimizer(module, settings.lr, settings.betas, settings.weight_decay, foreach=on_gpu)

    distributed = env is not None and env.distributed
    return TrainStep(StepLoss(draft, teacher_head, settings, env), adamw, env, wrap if distributed else None)


def resolve_compile(requested: Optional[bool], device: torch.device) -> tuple[bool, str]:
    """train.compile resolved: null = on CUDA, off on CPU (the demo and CI would spend their time compiling)."""
    if requested is not None:
        return bool(requested), "train.compile"
    return (True, "CUDA") if device.type == "cuda" else (False, "CPU")
