"""Stage 04's memory planner: the peak memory per GPU of training, estimated from the config before
anything is loaded (docs/design.md#memory-planner-04), like 02's disk planner.

    plan = plan_memory(draft_cfg, cfg.train, world_size=8, device_type="cuda")
    print(plan.describe())             # one line: the peak and its main terms
    check_fits(plan, cfg, capacity)    # ConfigError naming what to change when it cannot fit

What is alive at the peak (read off common/model/draft/, common/model/ttt.py, common/train/trainer.py
and common/core/distributed.py; P = trainable parameters, the draft family's count (DraftFamily.trainable_params,
common/model/draft/registry.py), W = ranks, T = train.batch_max_tokens,
K = train.ttt_steps, c = bytes of the compute dtype, 2 in bf16, 4 in fp32):

- state: the fp32 master weights (4P; FSDP: 4P/W; train.anchor_weight > 0: twice, the init's copy),
  AdamW's exp_avg + exp_avg_sq (8P; FSDP 8P/W, allocated at the first optimizer step: the steady
  state from step 2 on is what is planned),
  the gradients (4P; DDP adds its 4P of all-reduce buckets; FSDP: the unsharded gradients in the
  param dtype during backward, plus 4P fp32 kept between micro-batches when grad_accum > 1),
  bf16 weights (single process / DDP: autocast's cached casts, 2P; FSDP: the root unit's
  all-gathered params, gathered once per micro-batch and kept through its backward), the frozen
  target embedding [V, H] and the teacher lm_head [V, H_t] (compute dtype).
- the micro-batch: aux [T, n_aux*H_t] + final [T, H_t] in the compute dtype, ids/mask/positions int64;
  the teacher log-probs [T, V_d] fp32 (built in 1024-row chunks, alive until backward ends).
- saved activations per TTT step (the sum over K steps is alive when backward starts):
  gradient_checkpointing on: each layer's outputs h, k, v, the step's embeddings and RoPE cos/sin,
  and the rows gathered for the loss chunks [<=T, H]; off: also every layer's internals
  (norm inputs in fp32, the q/k/v/MLP inputs, q, attention output, 4 x [T, I] of the MLP, and an MLA
  draft's q and kv latents with their norms). The attention's widths are the family's
  (DraftFamily.attention_widths): a Llama layer's k and v are KV heads x head_dim, an MLA layer's k is
  heads x (qk_nope + qk_rope) and its v heads x v_head_dim. EAGLE-3.1 adds the norm of the aux states before fc
  (fc_norm or norm_before_fc: once per micro-batch) and, with norm_output, the final norm over all T rows in every
  step but the last.
- the largest transient on top: the backward of the last step's layer (recomputed when
  checkpointing; its internal gradients; the k/v gradients of all K steps pending), the
  attention chunk (scores [heads, 512, S] fp32, S <= longest sample + 512, ~5 copies in backward),
  or the loss chunk ([1024, V_d] fp32, ~6 copies), or the optimizer step (foreach temporaries, GPU).

Checked against measured peaks (torch's allocator total, CPU) in tests/train/test_memory_plan.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from common.core.errors import ConfigError
from common.core.io import format_bytes, parse_json
from common.model.sizes import check_model_sizes

# What the planner leaves free on a GPU of C bytes: the CUDA context, NCCL buffers and the caching
# allocator's fragmentation are not tensors: refuse above C * USABLE_FRACTION.
USABLE_FRACTION = 0.92


@dataclass
class MemoryPlan:
    peak: int  # bytes, per GPU (per process)
    phase: str  # where the peak is: "backward", "loss chunk", "optimizer step", "teacher"
    terms: dict[str, int]  # the main terms of the peak, bytes
    setting: dict = field(default_factory=dict)  # what the plan was made for

    def describe(self) -> str:
        s = self.setting
        par = s["parallel"] if s["world_size"] > 1 else "1 process"
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.terms.items() if v > 0)
        return (f"peak ~{format_bytes(self.peak)} per GPU at the {self.phase} ({par} x{s['world_size']}, "
                f"{s['dtype']}, {s['trainable_params'] / 1e6:.1f}M trainable params, batch_max_tokens {s['batch_max_tokens']}, "
                f"ttt_steps {s['ttt_steps']}, gradient_checkpointing {'on' if s['gradient_checkpointing'] else 'off'}"
                f"{' (auto)' if s.get('gradient_checkpointing_auto') else ''}): {parts}")


def trainable_params(d) -> int:
    """P of a draft config, as its family counts it (common.model.draft.registry)."""
    from common.model.draft import family_of_config

    return family_of_config(d).trainable_params(d)


def resolve_dtype_bytes(precision: str, device_type: str) -> int:
    """As common.train.trainer.resolve_precision: auto = bf16 on GPU, fp32 on CPU."""
    if precision == "auto":
        precision = "bf16" if device_type == "cuda" else "fp32"
    return 2 if precision == "bf16" else 4


def plan_memory(d, t, *, world_size: int = 1, device_type: str = "cuda", embed_bf16: bool = True,
                max_sample_len: Optional[int] = None, batch_max_tokens: Optional[int] = None) -> MemoryPlan:
    """The peak memory of one rank of 04 for draft config `d` (common.model.draft.DraftModelConfig) and
    the config's train section `t`. embed_bf16: the target's embedding is bf16 (then 04 keeps it bf16 on
    a bf16 GPU run); max_sample_len: the longest sample (attention spans a sample; default T)."""
    # the step's own chunk sizes, read from the code that uses them (imported here: torch loads with them)
    from common.model.draft import ATTN_SCORES_BYTES, DEFAULT_ATTN_CHUNK, family_of_config
    from common.model.ttt import LOSS_CHUNK_ROWS, TEACHER_CHUNK_ROWS

    T = int(batch_max_tokens or t.batch_max_tokens)
    K, W = int(t.ttt_steps), int(world_size)
    c = resolve_dtype_bytes(t.precision, device_type)
    bf16 = c == 2
    mode = t.parallel if W > 1 else "single"
    family = family_of_config(d)  # the architecture's own weight counts; the activations read the config's sizes
    P = family.trainable_params(d)
    H, I, L = d.hidden_size, d.intermediate_size, d.num_hidden_layers
    w = family.attention_widths(d)  # q, k, v, attention output, rope and latent widths of the family's attention
    V, Vd, Ht, A = d.vocab_size, d.draft_vocab_size, d.target_hidden_size, d.num_aux
    gc = bool(t.gradient_checkpointing)
    C = min(T, DEFAULT_ATTN_CHUNK)
    S = min(T, (max_sample_len or T) + C - 1)  # keys one attention chunk sees (from its first row's sample start)
    rows = min(T, LOSS_CHUNK_ROWS)

    # -- state -------------------------------------------------------------------------------------
    shard = (lambda n: math.ceil(n / W)) if mode == "fsdp" else (lambda n: n)
    weights = 4 * shard(P)
    adam = 8 * shard(P)
    # train.anchor_weight > 0: an fp32 copy of the init's weights, sharded like the masters (common.train.step.set_anchor)
    anchor = 4 * shard(P) if getattr(t, "anchor_weight", 0) > 0 else 0
    if mode == "fsdp":
        working = c * P  # the root unit's all-gathered params (param_dtype), through forward and backward
        grads = c * P + (4 * P if t.grad_accum > 1 else 0)  # unsharded grads (+ fp32 accumulated ones)
    elif bf16:  # common.train.step.ComputeCopy: bf16 weights and their gradients (and DDP's bf16 buckets)
        working = 2 * P
        grads = 4 * P + 2 * P + (2 * P if mode == "ddp" else 0)
    else:
        working = 0
        grads = 4 * P + (4 * P if mode == "ddp" else 0)  # DDP's buckets (gradient_as_bucket_view off)
    embed_bytes = 2 if (bf16 and device_type == "cuda" and embed_bf16) else 4
    frozen = V * H * embed_bytes + 8 * Vd + V  # embedding, d2t, t2d
    teacher_head = V * Ht * c

    # -- the micro-batch and the teacher ------------------------------------------------------------
    batch = T * ((A + 1) * Ht * c + 3 * 8)
    teacher = T * (4 * Vd + 8 + 1)  # log-probs, argmax, in_draft_vocab
    # packed layout, counted masks, and the attention's masks: 1 byte per padded query-key pair of every chunk
    bookkeeping = T * (6 * 8 + K) + math.ceil(T / C) * C * S

    # -- saved activations per TTT step ---------------------------------------------------------------
    a = c  # activations (linear outputs under autocast, layer outputs)
    n = c  # RMSNorm output: weight (in the compute dtype) x normalised input

    def norm_saved(d_in: int) -> int:  # RMSNorm: an fp32 copy of its input (unless fp32) and the normalised input
        return (4 if d_in != 4 else 0) + d_in

    def attn_part(first: bool) -> int:
        """Bytes per token a layer call keeps for the backward of its attention half (beyond its inputs
        and its outputs h, k, v): the input norms, the q/k/v input, q after RoPE, the attention output, and the
        latents inside the attention (MLA: through their norms into the up-projections)."""
        b = (norm_saved(a) + norm_saved(embed_bytes)) * H if first else norm_saved(a) * H
        b += (2 * H if first else H) * (n if n == c else 3 * c)  # q/k/v input: shared, or 3 autocast casts
        return b + (w.q + w.out) * a + w.normed_latents * (norm_saved(a) + n)

    def mlp_part() -> int:
        """... and of its MLP half: the residual stream (fp32) and its norm, the MLP input, 4 x [T, I]."""
        return 4 * H + a * H + H * (n if n == c else 2 * c) + 4 * I * a

    outputs = H * a + (w.k + w.v) * a  # h, k, v of every layer call
    per_step = L * outputs + H * embed_bytes + 2 * w.rope * 4  # + the step's embeddings, RoPE cos/sin
    # the loss: the rows it gathers, hidden[r] (<= T of them), the final norm's fp32 input and output, the normed
    # rows the fused lm_head + loss keeps, their indices, weights and log-sum-exp
    per_step += H * (3 * a + (4 if a != 4 else 0)) + 28
    if not gc:
        per_step += attn_part(True) + mlp_part() + (L - 1) * (attn_part(False) + mlp_part())
    # EAGLE-3.1: fc_norm (or the Llama draft's norm_before_fc) normalises the aux states before fc, once per
    # micro-batch; norm_output feeds each later step the final norm of all T rows, not only of the rows the loss
    # gathers. Each norm keeps what norm_saved says and its output (fc's input; the next step's)
    fc_input_norm = (norm_saved(c) + n) * A * Ht if (d.fc_norm or d.norm_before_fc) else 0
    next_step_norm = (K - 1) * (norm_saved(a) + n) * H if d.norm_output else 0
    saved = T * (K * per_step + H * a + fc_input_norm + next_step_norm)  # + fc(aux), the step-0 hidden

    # -- transients on top of the saved set, in the backward of the last step's last layer ----------
    last = attn_part(L == 1)
    # one chunk batch's fp32 scores [heads, pairs] (common.model.draft.attention.TTTAttention: batches of at most
    # ATTN_SCORES_BYTES, or one chunk when a chunk alone is larger); in its backward: the recomputed
    # probabilities, their gradient, and its bf16 cast (~3 copies)

    pairs = min(math.ceil(T / C) * C * S, max(ATTN_SCORES_BYTES // (4 * d.num_attention_heads), C * S))
    scores = 4 * d.num_attention_heads * pairs
    # the gradients of q and the attention output, of the k/v of all K steps, and of the latents (fp32 in their norms)
    attn_bwd = T * ((last if gc else -mlp_part()) + (w.q + w.out) * a + K * (w.k + w.v) * a + w.normed_latents * 4) + 3 * scores
    mlp_bwd = T * ((last + mlp_part() if gc else 0) + 3 * I * a + H * 4)
    loss_chunk = rows * Vd * (c + 3 * 4) + rows * H * 4 * 3  # the loss chunk: logits (+ fp32), teacher rows, product
    teacher_build = TEACHER_CHUNK_ROWS * (V * (c + 4) + 8 * Vd)  # [1024, V] logits while the teacher is built
    optim_tmp = 4 * shard(P) if device_type == "cuda" else 4 * family.largest_param(d) * 2  # foreach sqrt; CPU: per tensor
    backward = max(attn_bwd, mlp_bwd)

    # each moment's terms (the peak is the largest sum)
    common = {"weights": weights, "AdamW": adam, "anchor": anchor, "embedding+teacher head": frozen + teacher_head}
    in_use = {**common, "weights": weights + working, "grads": grads, "batch+teacher logp": batch + teacher + bookkeeping}
    moments = {
        "backward": {**in_use, "activations": saved, "transient": backward},
        "loss chunk": {**in_use, "activations": saved, "transient": loss_chunk},
        "teacher": {**in_use, "grads": 0, "transient": teacher_build},
        "optimizer step": {**common, "weights": weights + (working if mode != "fsdp" else 0),
                           "grads": 4 * shard(P) + (2 * P if bf16 and mode == "ddp" else 0), "batch+teacher logp": batch,
                           "transient": optim_tmp},
    }
    if mode == "fsdp":  # after backward, resharded: the unsharded grads + the fp32 reduce-scatter input and output
        moments["reduce-scatter"] = {**common, "grads": c * P + 4 * P + 4 * shard(P), "batch+teacher logp": batch + teacher}
    totals = {k: sum(v.values()) for k, v in moments.items()}
    phase = max(totals, key=totals.get)
    peak, terms = totals[phase], moments[phase]
    setting = {"world_size": W, "parallel": mode, "dtype": "bf16" if bf16 else "fp32", "trainable_params": P,
               "batch_max_tokens": T, "ttt_steps": K, "gradient_checkpointing": gc, "grad_accum": t.grad_accum,
               "min_batch_tokens": int(max_sample_len or 1)}
    return MemoryPlan(peak, phase, terms, setting)


# ---------------------------------------------------------------------------------------------------
# The check at 04's start


def gpu_capacity(cfg, device) -> Optional[int]:
    """Bytes the planner checks against: train.gpu_memory_gb when set, else the CUDA device's total; None
    (no check) on CPU without train.gpu_memory_gb."""
    gb = getattr(cfg.train, "gpu_memory_gb", None)
    if gb is not None:
        return int(gb * 1e9)
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[1])
    return None


def check_fits(plan: MemoryPlan, capacity: Optional[int], replan) -> None:
    """ConfigError (one line, naming what to change) when plan.peak exceeds USABLE_FRACTION of capacity.
    replan(**changes) -> MemoryPlan for a changed setting: batch_max_tokens=, parallel=, gradient_checkpointing=."""
    if capacity is None:
        return
    usable = int(capacity * USABLE_FRACTION)
    if plan.peak <= usable:
        return
    s = plan.setting
    # Only what the planner says fits is suggested (a fix that does not fit either is no advice).
    switches = {}
    if not s["gradient_checkpointing"]:
        switches["gradient_checkpointing"] = (True, "set train.gradient_checkpointing: true")
    if s["world_size"] > 1 and s["parallel"] != "fsdp":
        switches["parallel"] = ("fsdp", "use train.parallel: fsdp")
    fixes = []
    for names in [[n] for n in switches] + ([list(switches)] if len(switches) > 1 else []):
        p = replan(**{n: switches[n][0] for n in names})
        if p.peak <= usable and not (len(names) > 1 and fixes):  # both together only when neither alone fits
            fixes.append(f"{' and '.join(switches[n][1] for n in names)} (~{format_bytes(p.peak)})")
    lo, hi = 0, s["batch_max_tokens"]  # the largest batch_max_tokens that fits as configured otherwise
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if replan(batch_max_tokens=mid).peak <= usable else (lo, mid)
    if lo >= s["min_batch_tokens"]:  # a micro-batch holds at least the longest sample (never split)
        step = 256 if lo >= max(2048, s["min_batch_tokens"] + 256) else 1
        fits = lo // step * step
        fixes.insert(0, f"lower train.batch_max_tokens to {fits} (~{format_bytes(replan(batch_max_tokens=fits).peak)}; "
                        f"raise train.grad_accum to keep the batch)")
    if not fixes:
        fixes.append("use GPUs with more memory or a smaller draft")
    raise ConfigError(
        f"04's estimated peak memory {format_bytes(plan.peak)} per GPU does not fit {format_bytes(capacity)} "
        f"({USABLE_FRACTION:.0%} usable = {format_bytes(usable)}): {'; or '.join(fixes)} "
        f"(train.gpu_memory_gb overrides the capacity; docs/design.md#memory-planner-04)")


def plan_for_capacity(d, t, capacity: Optional[int], **kw):
    """(plan, replanner) with train.gradient_checkpointing resolved: null = off unless the step does not fit
    `capacity` without it (recomputation costs a forward per TTT step: only when memory asks for it)."""
    resolved = SimpleNamespace(**{f: getattr(t, f) for f in _PLANNED_FIELDS})
    auto = t.gradient_checkpointing is None
    if auto:
        resolved.gradient_checkpointing = False
        if capacity is not None and plan_memory(d, resolved, **kw).peak > capacity * USABLE_FRACTION:
            resolved.gradient_checkpointing = True
    plan = plan_memory(d, resolved, **kw)
    plan.setting["gradient_checkpointing_auto"] = auto
    return plan, replanner(d, resolved, **kw)


_PLANNED_FIELDS = ("ttt_steps", "precision", "parallel", "gradient_checkpointing", "grad_accum", "batch_max_tokens",
                   "anchor_weight")


def replanner(d, t, **kw):
    """replan(**changes) for check_fits: plan_memory with some train settings changed."""
    def replan(batch_max_tokens=None, parallel=None, gradient_checkpointing=None) -> MemoryPlan:
        t2 = SimpleNamespace(**{f: getattr(t, f) for f in _PLANNED_FIELDS})
        if parallel is not None:
            t2.parallel = parallel
        if gradient_checkpointing is not None:
            t2.gradient_checkpointing = gradient_checkpointing
        return plan_memory(d, t2, batch_max_tokens=batch_max_tokens, **kw)
    return replan


# ---------------------------------------------------------------------------------------------------
# From a config alone (no GPU, no weights): scripts/plan_memory.py


def target_sizes_from_config_json(model: str) -> Optional[dict]:
    """The target's text config (a dict) from model/config.json when it is a local directory, else None."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    return target_sizes_from_json(path, "fix target.model")


def target_sizes_from_json(path: Path, fix: str = "give the target's config.json or a JSON of its sizes") -> dict:
    """The target's text config (a dict) from a config.json, or a JSON of its sizes (configs/targets/kimi-k2.5.json);
    an unreadable file is one ConfigError line ending with `fix`."""
    try:
        doc = parse_json(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the target's config {path} ({' '.join(str(e).split())}); {fix}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} holds a JSON {type(doc).__name__}, not a config object; {fix}")
    for key in ("text_config", "language_config", "llm_config"):
        sub = doc.get(key)
        if isinstance(sub, dict) and sub.get("num_hidden_layers") is not None:  # 0 too: draft_config_from refuses it
            return {**sub, "torch_dtype": sub.get("torch_dtype") or doc.get("torch_dtype") or doc.get("dtype")}
    return doc


def draft_config_from(cfg, target: dict, source: str = "the target's config"):
    """The draft config 04 would build (of the family draft_family_for picks, as 04 does), from the run config and
    the target's (text) config dict (read from `source`, which the errors name)."""
    from common.target.loading import resolve_aux_layer_ids
    from common.train.init_from import draft_family_for

    try:
        check_model_sizes(target)  # a string, zero or NaN size is one error, not a traceback or an absurd plan
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}; correct the value there") from None
    needed = ["num_hidden_layers", "hidden_size", "vocab_size"] + ([] if cfg.draft.num_attention_heads else ["num_attention_heads"])
    missing = [k for k in needed if target.get(k) is None]
    if missing:
        heads = " (or set draft.num_attention_heads)" if "num_attention_heads" in missing else ""
        raise ConfigError(f"{source} has no {', '.join(missing)}, which building the draft needs; add the target's "
                          f"value{heads}")
    text = SimpleNamespace(**target)
    layers = target["num_hidden_layers"]
    info = SimpleNamespace(hidden_size=target["hidden_size"], vocab_size=target["vocab_size"], text_config=text)
    aux = resolve_aux_layer_ids(cfg.target.aux_layer_ids, layers)
    family = draft_family_for(cfg)  # the trainer's choice: the init's architecture, else draft.architecture
    if cfg.train.init_from:  # 04 trains the init's architecture, in the draft vocab of train.init_vocab
        from common.model.draft import NORM_FLAGS
        from common.model.export import read_draft_config

        init = read_draft_config(cfg.train.init_from)
        vocab = init.draft_vocab_size if cfg.train.init_vocab == "own" else min(cfg.vocab.draft_vocab_size, info.vocab_size)
        norms = {flag: getattr(cfg.draft, flag) for flag in NORM_FLAGS}  # draft.*'s (init_from refuses others, or converts)
        return dataclasses.replace(init, draft_vocab_size=vocab, aux_layer_ids=list(aux), **norms)
    return family.build_config(cfg, info, cfg.vocab.draft_vocab_size, aux)


def plan_for_config(cfg, world_size: int, device_type: str = "cuda", target: Optional[dict] = None) -> MemoryPlan:
    target = target or target_sizes_from_config_json(cfg.target.model)
    if target is None:
        raise ConfigError(f"target.model {cfg.target.model} is not a local directory with a config.json; give the "
                          f"target's sizes (--target-hidden-size, --target-vocab-size, --target-num-layers)")
    d = draft_config_from(cfg, target)
    dtype = str(target.get("torch_dtype") or "bfloat16")
    return plan_memory(d, cfg.train, world_size=world_size, device_type=device_type, embed_bf16="bfloat16" in dtype,
                       max_sample_len=cfg.tokenize.max_seq_len)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
