"""04's training step: the one function that 04's trainer and every benchmark run (docs/design.md#the-training-step-04).

    step = TrainStep(draft, teacher_head, make_optimizer, settings, env)   # draft: fp32 master weights
    result = step.run(micro_batches, count, denominator, lr)           # forward + backward each, clip, AdamW

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

from common.core.distributed import DistEnv
from common.model.draft import Eagle3DraftModel
from common.model.ttt import TTTOutput, ttt_loss


@dataclass
class StepSettings:
    ttt_steps: int
    loss_decay: float
    grad_clip: float  # 0 = no clipping
    dtype: torch.dtype = torch.float32  # compute dtype: bf16 = compute copy + autocast
    parallel: str = "ddp"  # ddp | fsdp (with more than one process)
    compile: bool = False
    compile_backend: str = "inductor"  # tests: "aot_eager" (dynamo + AOT autograd, no kernels generated)
    anchor_weight: float = 0.0  # L2-SP lambda towards the weights at set_anchor() (train.anchor_weight); 0 = off


@dataclass
class StepResult:
    outputs: list[tuple[TTTOutput, bool, int]] = field(default_factory=list)  # per micro-batch: output, real, tokens
    grad_norm: float = float("nan")
    applied: bool = False  # False: the gradient was not finite and nothing was updated
    anchor_loss: float = 0.0  # lambda * sum((w - w_anchor)^2) at the weights the gradient was taken at


class ComputeCopy:
    """A bf16 copy of the fp32 master draft that forward and backward run on. The frozen target embedding
    and the vocab-map buffers are shared with the master, not copied."""

    def __init__(self, master: Eagle3DraftModel, dtype: torch.dtype):
        shared = {id(master.embed_tokens.weight): master.embed_tokens.weight}
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


class TrainStep:
    """One optimizer step over some micro-batches; see the module docstring."""

    def __init__(self, draft: Eagle3DraftModel, teacher_head: torch.Tensor, make_optimizer, settings: StepSettings,
                 env: Optional[DistEnv] = None, wrap=None):
        """draft: the fp32 master; make_optimizer(draft) -> its optimizer, called once the draft is wrapped (FSDP
        replaces its parameters); wrap(module) -> the DDP/FSDP-wrapped module (common.core.distributed.wrap_parallel),
        applied to the compute copy when there is one."""
        self.draft, self.teacher_head, self.s, self.env = draft, teacher_head, settings, env
        distributed = env is not None and env.distributed
        self.fsdp = distributed and settings.parallel == "fsdp"
        # FSDP's mixed-precision policy already computes on bf16 all-gathered copies of fp32 shards
        self.copy = ComputeCopy(draft, settings.dtype) if settings.dtype != torch.float32 and not self.fsdp else None
        compute = self.copy.module if self.copy else draft
        if settings.compile:
            compute.compile_regions(settings.compile_backend)
        self.compute = compute
        self.model = wrap(compute) if wrap is not None else compute
        self.ddp = isinstance(self.model, nn.parallel.DistributedDataParallel)
        self.optimizer = make_optimizer(draft)
        self.world_size = env.world_size if env is not None else 1
        self.params = [p for p in draft.parameters() if p.requires_grad]
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

    def autocast(self):
        if self.s.dtype == torch.float32:
            return contextlib.nullcontext()
        device_type = self.teacher_head.device.type
        return torch.autocast(device_type, dtype=self.s.dtype)

    def describe_precision(self) -> str:
        if self.s.dtype == torch.float32:
            return "fp32 weights and compute"
        how = "FSDP's bf16 all-gather of fp32 shards" if self.fsdp else "a bf16 compute copy"
        return f"fp32 master weights, {how}"

    def refresh(self) -> None:
        """The master changed outside a step (a checkpoint was loaded into it): bring the compute copy along."""
        if self.copy is not None:
            self.copy.refresh()

    def loss(self, mb, denominator: Optional[float] = None, per_position: bool = False) -> TTTOutput:
        """The TTT loss of one micro-batch (on the device), through the (wrapped) compute model."""
        with self.autocast():
            return ttt_loss(self.model, mb.aux_hidden, mb.input_ids, mb.final_hidden, mb.loss_mask, mb.position_ids,
                            mb.seq_lens, self.teacher_head, self.s.ttt_steps, self.s.loss_decay, denominator=denominator,
                            per_position=per_position)

    def run(self, micro_batches: Iterable, count: int, denominator: Optional[float], lr: Optional[float] = None) -> StepResult:
        """micro_batches yields `count` pairs (micro-batch on the device, real): a stand-in (real False) keeps
        the collectives of a rank that ran out of data in step, with weight 0. Each loss is a sum divided by
        `denominator` (the whole global step's count), so the gradient is the mean over the global batch;
        DDP/FSDP average over ranks, hence x world_size. denominator None: each micro-batch's own step-0 count."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        if self.copy is None:  # with a copy, its gradients start at None and overwrite the masters'
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
        if self.copy is not None:
            self.copy.grads_to_master()
        if self.anchor is not None and self.s.anchor_weight > 0:  # before clipping: clipped as part of the loss's gradient
            result.anchor_loss = self.add_anchor_gradient()
        clip = self.s.grad_clip if self.s.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        result.grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(result.grad_norm):  # the same on every rank (the gradients are all-reduced)
            return result
        self.optimizer.step()
        if self.copy is not None:
            self.copy.refresh()
        result.applied = True
        return result


def resolve_compile(requested: Optional[bool], device: torch.device) -> tuple[bool, str]:
    """train.compile resolved: null = on CUDA, off on CPU (the demo and CI would spend their time compiling)."""
    if requested is not None:
        return bool(requested), "train.compile"
    return (True, "CUDA") if device.type == "cuda" else (False, "CPU")


def count_dispatched_ops(fn) -> tuple[int, dict]:
    """(aten ops dispatched while fn() runs, by op name): what the host does per op whatever the op's size
    (bench/gpu_train_bench.py --count-ops; a test bounds it)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.by_op = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.by_op[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        fn()
    return sum(counter.by_op.values()), counter.by_op


def count_top_level_ops(fn) -> int:
    """aten ops called from Python (or from compiled code) while fn() runs, from torch.profiler's record: ops
    nested in another aten op are not counted. Unlike count_dispatched_ops it works under torch.compile (a
    dispatch mode makes dynamo fall back), where a fused kernel is no aten op at all."""
    from torch.profiler import ProfilerActivity, profile

    def top_level(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and top_level(e))


def explain_regions(draft: Eagle3DraftModel, mb) -> dict:
    """torch._dynamo.explain over each decoder layer's two compiled regions (DecoderLayer.pre_attention and
    post_attention), on a micro-batch's step-0 inputs: {region: graph breaks}."""
    import torch._dynamo

    breaks = {}
    with torch.no_grad():
        hidden = draft.combine_aux(mb.aux_hidden)
        embeds = draft.embed_tokens(mb.input_ids).to(hidden.dtype)
        cos, sin = (x[:, None, :] for x in draft.rotary(mb.position_ids))
        for i, layer in enumerate(draft.decoder_layers):
            pre = torch._dynamo.explain(layer.pre_attention)(hidden, embeds if layer.first else None, cos, sin)
            q, _, _, residual = layer.pre_attention(hidden, embeds if layer.first else None, cos, sin)
            post = torch._dynamo.explain(layer.post_attention)(q, residual)
            breaks[f"layer {i} pre_attention"] = pre.graph_break_count
            breaks[f"layer {i} post_attention"] = post.graph_break_count
            hidden = layer.post_attention(q, residual)
    torch._dynamo.reset()
    return breaks
