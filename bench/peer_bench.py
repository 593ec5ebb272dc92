"""Stage 04's training step beside the same step in SpecForge 0.2.0 (the peer): time, tokens/s, peak memory.

Both implementations train the same EAGLE-3 draft (one layer, fc over 3 concatenated aux states, draft vocab)
from the same initial weights (ours, copied name for name into SpecForge's draft) on the same inputs, in one
process, one after the other:

  ours        bench/gpu_train_bench.py's step, i.e. 04's (common.train.step.build_step): fp32 master weights,
              forward and backward in bf16, the TTT loss with the bf16 target lm_head as teacher, clip 0.5,
              AdamW, attention and torch.compile as 04 resolves them; one packed row of `samples` samples
              (position ids restart per sample).
  specforge   specforge.training.strategies.base.Eagle3TrainStrategy.forward_loss (its offline step: the frozen
              TargetHead turns the stored final hidden state into the teacher) over
              specforge.algorithms.eagle3.model.OnlineEagle3Model over
              specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3 with bf16 parameters, then backward
              and its BF16Optimizer (fp32 master copies, clip 0.5, AdamW); batch [samples, sample_len] with an
              all-ones attention mask. Attention backends "sdpa" and "flex_attention" (its default).
              Its loss is the Triton LogSoftmaxLoss on GPU; on CPU (no Triton kernels) the same function's
              reference, specforge.core.loss._compute_loss. Not included: its FSDP wrapper (1 GPU) and data loader.

First, the check that both compute the same thing: one forward of each from the initial weights, in fp32 (TF32
off), per SpecForge backend. It compares (1) the draft logits of every TTT step at the positions that are
trained (step 0: all positions), (2) the per-step losses (SpecForge divides each step's summed CE by all B*L
positions, ours by the counted step-0 positions: ours is rescaled), (3) the set of trained positions per step
as SpecForge's loop sees it after its own shifts, and the number its t2d filter keeps. It fails (exit 1) above
1e-3 absolute on the logits (fp32 rounding gives ~1e-7 at the smoke sizes, ~1e-5 expected at 4096-7168 wide;
a token, RoPE position or teacher one place off gives differences of the logits' own size, 0.05-1) or 1e-3
relative on the losses, or on any differing position. The step-0 logits with each side in its training
precision (bf16) are compared too, printed only.

Alignment. At TTT step i, SpecForge's position t reads token x_{t+1+i}, RoPE position t+i and the teacher of
position t+1+i (which predicts x_{t+2+i}), exactly as ours. Its loss mask is another matter: it is read at
t+i (the mask of x_{t+i}; its data loader zeroes the last position of a sample) where ours is the mask of the
predicted token x_{t+2+i}, valid only while x_{t+2+i} is inside the sample. Left as is, SpecForge would train
two positions earlier in every masked span and also the position whose target lies past the sample end. It
is given loss_mask'[t] = loss_mask[t+2] (0 at the last two positions of a sample), which makes the trained
positions identical (checked, above). The losses are printed on each side's own scale.

Printed per implementation: median step time (after warm-up), tokens/s, peak memory
(torch.cuda.max_memory_allocated on GPU, reset before each; on CPU the process's RSS high-water mark, which
only grows, so later rows include earlier ones), and SpecForge time / our time per backend.
Writes <out>/peer_bench.json.

Setup (a separate venv; never the project's):
    bash bench/peer_setup.sh                       # prints the venv's python
    ~/.cache/eagle3-pipeline/peer-venv/bin/python bench/peer_bench.py --smoke       # CPU: tiny sizes, ~1-3 min
On a GPU box (no network there: wheels fetched here with `bash bench/peer_setup.sh --wheels DIR`, then
`PYTHON=/path/to/python-with-cuda-torch bash bench/peer_setup.sh --from DIR` there, which reuses that torch):
    ~/.cache/eagle3-pipeline/peer-venv/bin/python bench/peer_bench.py    # llama8b and kimi, 4 x 512 tokens, 7 steps
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
import warnings
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gpu_train_bench as gtb  # noqa: E402  (our step, configs and synthetic inputs)

warnings.filterwarnings("ignore", message="flash_attn is not found")  # SpecForge's "fa" backend only
# SpecForge calls flex_attention uncompiled for q_len <= 128 on purpose (a PyTorch issue it cites)
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

LOGIT_TOL = 1e-3  # fp32, absolute
LOSS_TOL = 1e-3  # fp32, relative
DECAY = 0.8  # both: loss = sum_i 0.8**i * loss_i (SpecForge's ploss_decay default)


# ------------------------------------------------------------------------------------------------
# Inputs and our side
# ------------------------------------------------------------------------------------------------


def make_batch(spec, args, device, gen):
    """(our step's micro-batch, the same as a tuple (aux [T, 3H], ids [T], final [T, H], loss_mask [T],
    position_ids [T], seq_lens)): `samples` equal samples packed into one row, states in bf16 (what 04's reader
    hands the step)."""
    mb = gtb.synthetic_batch(spec, args.seq_len, device, gen, samples=args.samples)
    return mb, (mb.aux_hidden, mb.input_ids, mb.final_hidden, mb.loss_mask, mb.position_ids, list(mb.seq_lens))


def build_ours(spec, device, args, gen) -> SimpleNamespace:
    """04's full optimizer step (common.train.step.build_step, called by bench/gpu_train_bench.py). Returns draft
    (fp32 master), lm_head (the bf16 teacher), run(batch) -> loss, and compute + autocast: the module and context
    the training forward runs in (for the bf16 comparison)."""
    step, _ = gtb.build_bench_step(spec, device, gen, ttt_steps=args.ttt_steps, attention=args.attention,
                                   max_len=args.seq_len)
    loss = step.loss
    run = lambda mb: step.run([(mb, True)], 1, denominator=None).outputs[0][0].loss  # noqa: E731
    info = {"attention": loss.draft.attention_impl, "compile": step.s.compile, "precision": loss.describe_precision()}
    return SimpleNamespace(draft=loss.draft, lm_head=loss.teacher_head, run=run, compute=loss.compute,
                           autocast=loss.autocast, info=info)


# ------------------------------------------------------------------------------------------------
# SpecForge side
# ------------------------------------------------------------------------------------------------


def sf_config(cfg):
    """The LlamaConfig SpecForge builds LlamaForCausalLMEagle3 from, with our draft config's values."""
    from transformers import LlamaConfig

    if cfg.num_hidden_layers != 1 or cfg.rope_scaling or cfg.norm_before_residual or cfg.num_aux != 3:
        raise SystemExit("SpecForge's LlamaForCausalLMEagle3 is one layer, 3 aux states, plain RoPE, "
                         "norm_before_residual false: this draft config is not that")
    config = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, num_hidden_layers=1, max_position_embeddings=cfg.max_position_embeddings,
                         vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    config.draft_vocab_size = cfg.draft_vocab_size
    config.target_hidden_size = cfg.target_hidden_size
    return config


@torch.no_grad()
def build_sf_draft(cfg, backend: str, our_state: dict, device, dtype):
    """SpecForge's draft holding our initial weights. Every tensor of its state dict is copied from the
    tensor of the same name in ours (the names coincide: both follow the official EAGLE-3 checkpoint)."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    with torch.device("meta"):  # no random init of tensors that are overwritten next
        draft = LlamaForCausalLMEagle3(sf_config(cfg), attention_backend=backend)
    theirs = draft.state_dict()
    if set(theirs) != set(our_state):
        raise SystemExit(f"state dicts differ: only SpecForge {sorted(set(theirs) - set(our_state))}, "
                         f"only ours {sorted(set(our_state) - set(theirs))}")
    for name, t in theirs.items():
        if t.shape != our_state[name].shape:
            raise SystemExit(f"{name}: SpecForge {tuple(t.shape)}, ours {tuple(our_state[name].shape)}")
    # copies (never views of our_state: SpecForge's optimizer writes its parameters in place), cast on the host:
    # the same rounding as SpecForge's fp32 build + .to(torch_dtype), without an fp32 model on the device
    state = {k: v.to(dtype if v.is_floating_point() else v.dtype, copy=True).to(device) for k, v in our_state.items()}
    draft.load_state_dict(state, strict=True, assign=True)
    draft.midlayer.self_attn._init_rope()  # its rotary cos/sin caches are non-persistent: rebuild them off meta
    draft.freeze_embedding()  # as SpecForge's build_eagle3_draft
    draft = draft.to(device=device, dtype=dtype)  # SpecForge builds in fp32, then .to(torch_dtype); bool/long buffers stay
    for name, t in draft.state_dict().items():  # the copy is exact (fp32) / a rounding (bf16) of ours
        if not torch.equal(t.cpu(), our_state[name].to(t.dtype)):
            raise SystemExit(f"{name} was not copied")
    return draft


def sf_target_head(weight: torch.Tensor):
    """SpecForge's TargetHead over our teacher lm_head [V, H]. Its __init__ reads a model directory's config;
    the training step only uses .fc, forward() and preprocess(), so the module is assembled directly."""
    from specforge.modeling.target.target_head import TargetHead

    head = TargetHead.__new__(TargetHead)
    nn.Module.__init__(head)
    head.fc = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.fc.weight = nn.Parameter(weight, requires_grad=False)
    return head.eval()


def sf_batch(batch):
    """Our packed row as SpecForge's offline TrainBatch: one row per sample, [B, L, ...]."""
    from specforge.runtime.contracts import TrainBatch

    aux, ids, final, mask, pos, seq_lens = batch
    B, L = len(seq_lens), seq_lens[0]
    if any(n != L for n in seq_lens):
        raise SystemExit(f"SpecForge takes a [B, L] batch: the samples must have equal lengths, got {seq_lens}")
    mask = mask.view(B, L).long()
    sf_mask = torch.zeros_like(mask)
    sf_mask[:, : L - 2] = mask[:, 2:]  # its mask at t = ours at the predicted token t+2 (module docstring)
    tensors = {"input_ids": ids.view(B, L), "attention_mask": torch.ones_like(mask), "loss_mask": sf_mask,
               "hidden_state": aux.view(B, L, -1), "target": final.view(B, L, -1),
               "position_ids": pos.view(B, L)}
    return TrainBatch(sample_ids=[str(i) for i in range(B)], strategy="eagle3", tensors=tensors,
                      metadata={"target_repr": "hidden_state"})


class _ReferenceLoss:
    """CPU: SpecForge's LogSoftmaxLoss is Triton only; its reference `_compute_loss` computes the same value."""

    @staticmethod
    def apply(logits, target_p, position_mask):
        from specforge.core.loss import _compute_loss

        return _compute_loss(logits, target_p, position_mask)


def use_specforge_loss_for(device) -> str:
    import specforge.algorithms.eagle3.model as sf_model
    from specforge.core.loss import LogSoftmaxLoss

    sf_model.LogSoftmaxLoss = LogSoftmaxLoss if device.type == "cuda" else _ReferenceLoss
    return "LogSoftmaxLoss (Triton)" if device.type == "cuda" else "_compute_loss (reference, torch.compile)"


def build_sf(cfg, args, backend, our_state, head_weight, device, dtype, compact_teacher: bool):
    """(draft, strategy): OnlineEagle3Model in SpecForge's Eagle3TrainStrategy, TargetHead(head_weight) the teacher."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.training.strategies.base import Eagle3TrainStrategy

    draft = build_sf_draft(cfg, backend, our_state, device, dtype)
    model = OnlineEagle3Model(draft_model=draft, length=args.ttt_steps, attention_backend=backend)
    strategy = Eagle3TrainStrategy(model, target_head=sf_target_head(head_weight), ploss_decay=DECAY,
                                   compact_teacher=compact_teacher)
    return draft, strategy


def capture(obj, method: str, pick):
    """Wrap obj.<method> on the instance: every call appends pick(kwargs, result) to the list returned
    (SpecForge calls compute_logits and _acc_and_loss once per TTT step). restore() unwraps."""
    seen = []
    original = getattr(obj, method)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append(pick(kwargs, result))
        return result

    setattr(obj, method, wrapper)
    return seen, lambda: delattr(obj, method)


def capture_logits(draft):
    return capture(draft, "compute_logits", lambda kw, logits: logits.detach())


# ------------------------------------------------------------------------------------------------
# Check: the same numbers from the same weights
# ------------------------------------------------------------------------------------------------


def valid_rows(seq_lens, step: int, device) -> torch.Tensor:
    """[T] bool: step `step` at t predicts a token inside its sample (what both train)."""
    return torch.cat([torch.arange(n, device=device) + 2 + step <= n - 1 for n in seq_lens])


def counted_positions(batch, ttt_steps: int) -> list:
    """Ours, per step: [T] bool, the prediction at t is trained (common.model.ttt: inside the sample, loss_mask
    of the predicted token x_{t+2+i})."""
    from common.model.draft import PackedLayout

    ids, mask, seq_lens = batch[1], batch[3].bool(), batch[5]
    layout = PackedLayout.build(seq_lens, ids.numel(), ids.device)
    return [layout.step_valid(i) & mask[layout.shifted(2 + i)[0]] for i in range(ttt_steps)]


@torch.no_grad()
def compare(ours_logits: list, sf_logits: list, seq_lens) -> dict:
    steps = []
    for i, (a, b) in enumerate(zip(ours_logits, sf_logits)):
        b = b.reshape(a.shape).float().to(a.device)
        rows = torch.ones(a.shape[0], dtype=torch.bool, device=a.device) if i == 0 else valid_rows(seq_lens, i, a.device)
        steps.append({"max_abs_diff": float((a.float() - b)[rows].abs().max()), "max_abs_logit": float(a[rows].abs().max())})
    return {"step0_max_abs_diff": steps[0]["max_abs_diff"], "step0_max_abs_logit": steps[0]["max_abs_logit"],
            "all_steps_max_abs_diff": max(s["max_abs_diff"] for s in steps), "per_step": steps}


@torch.no_grad()
def check_fp32(args, backend, our_draft, our_state, lm_head, batch, device) -> dict:
    """fp32 forward of both from the initial weights: logits of every step and the per-step losses."""
    from common.model.ttt import ttt_loss

    aux, ids, final, mask, pos, seq_lens = batch
    batch32 = (aux.float(), ids, final.float(), mask, pos, seq_lens)
    ours = our_draft.forward_ttt(aux.float(), ids, pos, seq_lens, args.ttt_steps)
    ours_loss = ttt_loss(our_draft, *batch32, lm_head.float(), args.ttt_steps, DECAY)
    draft, strategy = build_sf(our_draft.config, args, backend, our_state, lm_head.float(), device, torch.float32,
                               args.sf_compact_teacher)
    seen, restore = capture_logits(draft)
    masks, restore_masks = capture(strategy.trainable_module(), "_acc_and_loss",
                                   lambda kw, _: (kw["loss_mask"].bool().flatten(), int(kw["position_mask"].sum())))
    out = strategy.forward_loss(sf_batch(batch32))
    restore(), restore_masks()
    result = compare(ours, seen, seq_lens)
    # SpecForge: step loss = summed CE / (B*L); ours: summed CE / counted step-0 positions
    scale = ours_loss.denominator / ids.numel()
    pairs = [(o * scale, float(s)) for o, s in zip(ours_loss.step_losses, out.metrics["plosses"])]
    result["step_losses_ours_rescaled"] = [a for a, _ in pairs]
    result["step_losses_specforge"] = [b for _, b in pairs]
    result["loss_max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    # the positions each step trains, as SpecForge's loop sees them after its own shifts: the same set as ours
    # (loss mask and sample ends), and as many kept by the filter "target top-1 in the draft vocab"
    ours_counted = counted_positions(batch, args.ttt_steps)
    result["positions_differing_per_step"] = [int((m != c).sum()) for (m, _), c in zip(masks, ours_counted)]
    result["trained_per_step"] = [int(c.sum()) for c in ours_counted]
    result["kept_by_t2d_filter_ours"] = ours_loss.step_loss_counts
    result["kept_by_t2d_filter_specforge"] = [k for _, k in masks]
    result["ok"] = (result["all_steps_max_abs_diff"] <= LOGIT_TOL and result["loss_max_rel_diff"] <= LOSS_TOL
                    and not any(result["positions_differing_per_step"])
                    and result["kept_by_t2d_filter_ours"] == result["kept_by_t2d_filter_specforge"])
    del draft, strategy, out, ours, seen
    return result


@torch.no_grad()
def ours_first_logits_bf16(ours, batch) -> torch.Tensor:
    """Our step-0 logits as trained (the bf16 compute copy / fp32 master under bf16 autocast), on the CPU."""
    aux, ids, _, _, pos, seq_lens = batch
    with ours.autocast():
        return ours.compute.forward_ttt(aux, ids, pos, seq_lens, 1)[0].float().cpu()


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device):
    gc.collect()  # the previous implementation's model and optimizer state
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device):
    """After building: the peak then counts what stays resident (model, master weights, inputs, teacher
    lm_head) plus the training steps' own, not the one-off transients of building."""
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "torch.cuda.max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "process RSS high-water mark (cumulative)"


def time_steps(step, warmup: int, steps: int, device) -> tuple[list[float], list[float]]:
    """(seconds per timed step, loss of every step): warm-up steps first (compilation, allocator)."""
    losses, times = [], []
    for _ in range(warmup):
        losses.append(float(step().detach()))
    sync(device)
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return times, losses


def summary(name, times, losses, T, device, n_params) -> dict:
    med = statistics.median(times)
    mem, kind = peak_memory(device)
    return {"impl": name, "step_ms_median": med * 1e3, "step_ms_all": [t * 1e3 for t in times],
            "tokens_per_s": T / med, "peak_memory_gb": mem, "peak_memory_kind": kind,
            "losses": losses, "trainable_params": n_params}


def run_ours(ours, batch, T: int, args, device) -> dict:
    reset_peak(device)
    times, losses = time_steps(lambda: ours.run(batch), args.warmup, args.steps, device)
    n = sum(p.numel() for p in ours.draft.parameters() if p.requires_grad)
    return {**summary("ours", times, losses, T, device, n), **ours.info}


def run_specforge(cfg, args, backend, our_state, lm_head, batch, ours_bf16, device) -> dict:
    from specforge.optimizer import BF16Optimizer

    free_memory(device)
    draft, strategy = build_sf(cfg, args, backend, our_state, lm_head, device, torch.bfloat16, args.sf_compact_teacher)
    model = strategy.trainable_module()
    # lr 1e-4 and clip 0.5 are its defaults; a constant lr as in gpu_train_bench (its default 1.5% warm-up of the
    # total steps would keep the lr ~0 here); the schedule changes no work
    optimizer = BF16Optimizer(model, lr=1e-4, max_grad_norm=0.5, total_steps=1_000_000, warmup_ratio=0.0,
                              lr_scheduler="constant")
    tb = sf_batch(batch)
    seen, restore = capture_logits(draft)  # first forward as trained (bf16): printed, not checked
    with torch.no_grad():
        strategy.forward_loss(tb)
    restore()
    bf16_diff = compare([ours_bf16], [seen[0].cpu()], batch[5])["step0_max_abs_diff"]
    del seen

    def step():
        loss = strategy.forward_loss(tb).loss
        loss.backward()
        optimizer.step()  # clip 0.5, fp32 master AdamW, copy back to bf16, grads cleared
        return loss

    reset_peak(device)
    times, losses = time_steps(step, args.warmup, args.steps, device)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    result = summary(f"specforge-{backend}", times, losses, batch[1].numel(), device, n)
    result["bf16_step0_max_abs_diff_vs_ours"] = bf16_diff
    return result  # its model and optimizer go with this frame


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def error_line(e: Exception, device) -> str:
    if device.type == "cuda":  # unexpected there: keep the whole story on stderr
        traceback.print_exc()
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def run_checks(name, args, our_draft, our_state, lm_head, batch, device) -> dict:
    checks = {}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the check in true fp32
    for backend in args.backends:
        try:
            checks[backend] = c = check_fp32(args, backend, our_draft, our_state, lm_head, batch, device)
        except Exception as e:  # noqa: BLE001 -- reported; a failure only if the backend then trains
            checks[backend] = {"ok": None, "error": error_line(e, device)}
            print(f"{name:8} check {backend:14}: not run ({checks[backend]['error']})", flush=True)
            continue
        print(f"{name:8} check {backend:14}: fp32 step-0 logits max |diff| {c['step0_max_abs_diff']:.3g} "
              f"(max |logit| {c['step0_max_abs_logit']:.3g}), all {args.ttt_steps} steps {c['all_steps_max_abs_diff']:.3g}; "
              f"step losses max rel diff {c['loss_max_rel_diff']:.3g}; trained positions {c['trained_per_step']}, "
              f"differing {c['positions_differing_per_step']}, after the t2d filter {c['kept_by_t2d_filter_ours']} / "
              f"{c['kept_by_t2d_filter_specforge']} -> {'ok' if c['ok'] else 'MISMATCH'}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return checks


def bench_config(name, args, device) -> dict:
    spec = gtb.CONFIGS[name]
    gen = torch.Generator(device=device).manual_seed(0)
    ours = build_ours(spec, device, args, gen)
    our_batch, batch = make_batch(spec, args, device, gen)
    our_state = {k: v.detach().to("cpu", copy=True) for k, v in ours.draft.state_dict().items()}  # initial weights
    our_cfg, lm_head = ours.draft.config, ours.lm_head
    doc = {"config": name, **spec, "samples": args.samples, "sample_len": args.seq_len // args.samples,
           "tokens": args.seq_len, "ttt_steps": args.ttt_steps, "results": [], "skipped": {}}
    doc["checks"] = run_checks(name, args, ours.draft, our_state, lm_head, batch, device)
    ours_bf16 = ours_first_logits_bf16(ours, batch)

    doc["results"].append(run_ours(ours, our_batch, args.seq_len, args, device))
    del ours, our_batch  # trained: SpecForge starts from our_state
    for backend in args.backends:
        try:
            r = run_specforge(our_cfg, args, backend, our_state, lm_head, batch, ours_bf16, device)
        except Exception as e:  # noqa: BLE001 -- flex_attention has no CPU backward; OOM on a small GPU
            doc["skipped"][backend] = error_line(e, device)
            continue
        r["ratio_vs_ours"] = r["step_ms_median"] / doc["results"][0]["step_ms_median"]
        doc["results"].append(r)
    # a backend that trains must have passed its check
    doc["ok"] = all(c["ok"] if b not in doc["skipped"] else c["ok"] is not False for b, c in doc["checks"].items())
    return doc


def print_config(doc):
    print(f"{doc['config']:8} {doc['samples']} x {doc['sample_len']} tokens, {doc['ttt_steps']} TTT steps "
          f"(loss: each side's own scale, SpecForge's CE per B*L positions, ours per counted position):", flush=True)
    for r in doc["results"]:
        extra = f"  ({r['attention']} attention, compile {r['compile']})" if r["impl"] == "ours" else ""
        if "ratio_vs_ours" in r:
            extra = (f"  specforge/ours {r['ratio_vs_ours']:5.2f}x  (bf16 first-forward max |diff| "
                     f"{r['bf16_step0_max_abs_diff_vs_ours']:.3g})")
        print(f"  {r['impl']:26} step {r['step_ms_median']:9.1f} ms  {r['tokens_per_s']:>10,.0f} tok/s  "
              f"peak {r['peak_memory_gb']:6.2f} GB  loss {r['losses'][0]:.4g} -> {r['losses'][-1]:.4g}{extra}", flush=True)
    for backend, why in doc["skipped"].items():
        print(f"  {'specforge-' + backend:26} skipped: {why}", flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the script: smoke-a, 2 x 64 tokens, 3 TTT steps, 1 warm-up + 2 timed steps")
    p.add_argument("--configs", nargs="+", choices=list(gtb.CONFIGS), help="default: llama8b kimi (smoke: smoke-a)")
    p.add_argument("--samples", type=int, help="samples per step (default 4; smoke 2)")
    p.add_argument("--seq-len", type=int, help="tokens per step, all samples (default 2048; smoke 128)")
    p.add_argument("--ttt-steps", type=int, help="default 7 (smoke 3)")
    p.add_argument("--steps", type=int, help="timed optimizer steps, median reported (default 5; smoke 2)")
    p.add_argument("--warmup", type=int, help="default 2 (smoke 1)")
    p.add_argument("--backends", nargs="+", default=["sdpa", "flex_attention"], choices=["sdpa", "flex_attention"],
                   help="SpecForge attention backends")
    p.add_argument("--attention", default="auto", choices=["auto", "chunked", "flex", "naive"],
                   help="ours, as train.attention_impl (auto: flex where it checks out on this GPU, else chunked)")
    p.add_argument("--sf-compact-teacher", action="store_true",
                   help="SpecForge's training.compact_teacher (off by default there: full fp32 target logits)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
    args = p.parse_args()
    smoke = dict(configs=["smoke-a"], samples=2, seq_len=128, ttt_steps=3, steps=2, warmup=1)
    full = dict(configs=["llama8b", "kimi"], samples=4, seq_len=2048, ttt_steps=7, steps=5, warmup=2)
    for k, v in (smoke if args.smoke else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.seq_len % args.samples:
        p.error(f"--seq-len {args.seq_len} is not a multiple of --samples {args.samples}")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("no CUDA device: run with --smoke on CPU (tiny sizes), or on a GPU machine")
    if importlib.util.find_spec("specforge") is None:
        sys.exit("specforge is not importable: run this with the peer venv's python (bash bench/peer_setup.sh prints it)")

    loss_impl = use_specforge_loss_for(device)
    args.out.mkdir(parents=True, exist_ok=True)
    out_path = args.out / "peer_bench.json"
    doc = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()}, "
           f"{torch.get_num_threads()} threads)", "torch": torch.__version__, "specforge": version("specforge"),
           "transformers": version("transformers"), "specforge_loss": loss_impl, "smoke": args.smoke,
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": {k: str(v) for k, v in vars(args).items()},
           "configs": []}
    print(f"peer_bench: {doc['device']}, torch {doc['torch']}, specforge {doc['specforge']} (loss: {loss_impl}); "
          f"writing {out_path}", flush=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as gpu_train_bench.py; off during the fp32 check
    failed = False
    for name in args.configs:
        c = bench_config(name, args, device)
        doc["configs"].append(c)
        print_config(c)
        failed |= not c["ok"]
        out_path.write_text(json.dumps(doc, indent=2) + "\n")
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out_path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"peer_bench: done -> {out_path}", flush=True)
    if failed:
        sys.exit(f"peer_bench: the implementations disagree (fp32 logits > {LOGIT_TOL}, losses > {LOSS_TOL} relative, "
                 f"other trained positions), or a backend trained whose check did not run")


if __name__ == "__main__":
    main()
