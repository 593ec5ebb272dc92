"""The TTT attention of the draft: step-0 keys of the same sample up to the query's row, plus the keys of steps
1..i at the query's own row (docs/design.md#ttt-alignment-and-loss).

Backends (train.attention_impl), AttentionBackend objects in ATTENTION_BACKENDS, chosen by choose_attention:
  - "chunked" (exact on CPU and GPU): `TTTAttention`, an autograd Function with a hand-written backward
    (FlashAttention's algebra in PyTorch ops). Queries in chunks of `attn_chunk_size` rows, each seeing the
    step-0 keys from the sample start of its first row (block-causal mask, built once per micro-batch), padded
    and batched into a few bmm's per step, plus the step's "diagonal" keys (steps 1..i at the query's own row)
    in one batched product, under one joint fp32 log-sum-exp. Forward keeps the output and the log-sum-exp,
    backward recomputes the probabilities: no [heads, T, S] tensor lives between them.
  - "flex": torch flex_attention over the concatenated step KV with a block mask per micro-batch and step
    count, compiled on CUDA (no CPU backward). 04's "auto" picks it on a GPU where a start-up self-check
    against "chunked" passes (FlexAttention.self_check).
  - "naive": the reference: the full (steps*T) x (steps*T) mask, plain softmax attention.

Every backend takes q and k of one head width and v of another (MLA: q/k heads of qk_nope + qk_rope, v heads of
v_head_dim), and the softmax scale of AttentionMeta.scale (None: 1/sqrt(q's head width)).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from common.core.errors import ConfigError
from common.model.draft.layout import PackedLayout, _wide

ATTN_SCORES_BYTES = 1 << 30  # fp32 scores of one chunk batch of the chunked attention, all heads (1 GiB)
DEFAULT_ATTN_CHUNK = 512  # queries per chunk of the chunked attention (the memory planner reads it too)


@dataclass
class AttentionMeta:
    """What every attention call of one micro-batch shares: the layout and, built once on first use and
    reused by every TTT step and layer, the chunk batches (chunked) or the block masks (flex)."""

    layout: PackedLayout
    chunk_size: int = DEFAULT_ATTN_CHUNK
    impl: str = "chunked"
    block_masks: dict = field(default_factory=dict)  # flex: one block mask per number of steps
    pairs_budget: int = 1 << 22  # query-key pairs per chunk batch (its fp32 scores: heads x pairs x 4 B)
    scale: float | None = None  # the softmax scale of q.k; None: 1/sqrt(q's head width) (MLA's yarn scales it)
    _plan: "ChunkPlan | None" = None

    def softmax_scale(self, q: torch.Tensor) -> float:
        return q.shape[-1] ** -0.5 if self.scale is None else self.scale

    def chunk_plan(self, device) -> "ChunkPlan":
        if self._plan is None:
            self._plan = plan_chunks(self.layout, self.chunk_size, self.pairs_budget, device)
        return self._plan


@dataclass
class ChunkBatch:
    """n query chunks padded to C queries and S keys each, attended in one batched computation."""

    queries: torch.Tensor  # [n * C] row of each query (the last chunk's padding repeats its last row; dropped)
    keys: torch.Tensor  # [n * S] row of each padded step-0 key
    blocked: torch.Tensor  # [n, C, S] bool: True where the query may not see the key (other sample, later, padding)
    query_weight: torch.Tensor | None  # [n * C] 1.0 for a real query, 0.0 for padding (None: no padding)
    whole_rows: bool = False  # queries and keys are rows 0..T-1 in order (equal whole samples): no gathers

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.blocked.shape)

    @property
    def blocked5(self) -> torch.Tensor:
        """blocked as [n, 1, C, 1, S]: broadcast over kv heads and the g query heads of each."""
        n, C, S = self.blocked.shape
        return self.blocked.view(n, 1, C, 1, S)

    def rows(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x if self.whole_rows else x.index_select(0, index)

    def add_rows(self, total: torch.Tensor, index: torch.Tensor, part: torch.Tensor) -> None:
        part = _as(part, total.dtype)
        if self.whole_rows:
            total.add_(part.reshape(total.shape))
        else:
            total.index_add_(0, index, part.reshape(-1, *total.shape[1:]))


@dataclass
class ChunkPlan:
    batches: list[ChunkBatch]  # in row order; only the last chunk is padded
    num_tokens: int

    def to_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The batches' outputs, concatenated, as [T, ...]: the last chunk's padding dropped."""
        return out if out.shape[0] == self.num_tokens else out[: self.num_tokens]


def query_chunks(layout: PackedLayout, chunk_size: int) -> list[tuple[int, int, int]]:
    """(start, stop, key_start) per chunk: rows [start, stop) of chunk_size queries (the last one shorter), seeing
    the step-0 keys from the start of the sample of their first row, key_start, up to stop - 1."""
    starts = layout.starts
    return [(a, min(a + chunk_size, layout.num_tokens), starts[bisect.bisect_right(starts, a) - 1])
            for a in range(0, layout.num_tokens, chunk_size)]


def plan_chunks(layout: PackedLayout, chunk_size: int, pairs_budget: int, device) -> ChunkPlan:
    """The chunks (query_chunks) grouped, in row order, into batches of at most pairs_budget padded query-key
    pairs (at least one chunk each): a fixed handful of batched ops per step and batch, whatever the samples."""
    chunks = query_chunks(layout, chunk_size)
    C = chunks[0][1] - chunks[0][0]
    groups, group = [], []
    for c in chunks:
        trial = group + [c]
        if group and len(trial) * C * max(b - lo for _, b, lo in trial) > pairs_budget:
            groups.append(group)
            trial = [c]
        group = trial
    groups.append(group)
    # the masks are built on the device in a few tensor ops (a long micro-batch has 10^8 query-key pairs);
    # 1 byte per pair, kept for the micro-batch (common.train.memory_plan counts it)
    batches, sample, T = [], layout.sample, layout.num_tokens
    for group in groups:
        n, S = len(group), max(b - lo for _, b, lo in group)
        a, b, lo = (torch.tensor(col, device=sample.device)[:, None] for col in zip(*group))
        qi, ki = a + torch.arange(C, device=sample.device), lo + torch.arange(S, device=sample.device)
        q_real, k_real = qi < b, ki < b
        qi, ki = torch.minimum(qi, b - 1), torch.minimum(ki, b - 1)
        allowed = (sample[qi][:, :, None] == sample[ki][:, None, :]) & (ki[:, None, :] <= qi[:, :, None])
        allowed &= q_real[:, :, None] & k_real[:, None, :]
        allowed[:, :, 0] |= ~q_real  # a padded query sees one key: a finite softmax, its output is dropped
        # equal whole chunks that start their own keys: queries and keys are the rows in order
        whole = len(groups) == 1 and all(lo_ == a_ and b_ - a_ == C == S for a_, b_, lo_ in group) and n * C == T
        weight = None if bool(q_real.all()) else q_real.flatten().float()
        batches.append(ChunkBatch(qi.flatten().to(device), ki.flatten().to(device), (~allowed).to(device),
                                  None if weight is None else weight.to(device), whole))
    return ChunkPlan(batches, T)


class TTTAttention(torch.autograd.Function):
    """Exact TTT attention of one step's queries, with a hand-written backward (FlashAttention's algebra in
    PyTorch ops, per chunk batch): forward keeps q, the keys and values, the output and each row's log-sum-exp;
    backward recomputes a chunk batch's probabilities from them. So no [heads, C, S] probabilities are kept
    between forward and backward (nothing to checkpoint) and a step dispatches a fixed, small number of ops
    per chunk batch, whatever the step. Scores, softmax and the probabilities' gradients are fp32; the
    matmuls run in the inputs' dtype (bf16 on GPU).

    apply(plan, scale, q, k_0, v_0, k_1..k_i, v_1..v_i): q [T, nh, d]; k_j [T, nkv, d] (step j's keys after
    RoPE), v_j [T, nkv, dv] (dv may differ from d: MLA); scale multiplies q.k; a query at row t sees the step-0
    keys of its sample up to t, and k_1..k_i at row t only.
    """

    @staticmethod
    def forward(ctx, plan: "ChunkPlan", scale: float, q, k0, v0, *diag):
        outs, lses = [], []
        with torch.autocast(q.device.type, enabled=False):  # the dtypes are chosen here (autocast skips backward)
            for cb in plan.batches:
                out, lse = _attend_forward(cb, q, k0, v0, diag, scale)
                outs.append(out)
                lses.append(lse)
        out = plan.to_rows(torch.cat(outs) if len(outs) > 1 else outs[0])
        ctx.plan, ctx.scale = plan, scale
        ctx.save_for_backward(q, k0, v0, out, *lses, *diag)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        plan = ctx.plan
        q, k0, v0, out, *rest = ctx.saved_tensors
        lses, diag = rest[:len(plan.batches)], rest[len(plan.batches):]
        n_diag = len(diag) // 2
        # D = rowsum(dO * O), the softmax's backward term shared by every key of a query row
        delta = (_wide(grad_out) * _wide(out)).sum(dim=-1)  # [T, nh]
        grad_out = _as(grad_out, q.dtype)
        # summed in fp32 (a key row is seen by several chunks of a long sample), returned in the inputs' dtype
        acc = _wide(q[:0]).dtype
        dq, dk0, dv0 = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k0, v0))
        # the diag keys' and values' gradients of every earlier step at once: [T, nkv, i, d] and [T, nkv, i, dv]
        T, nkv, d = k0.shape
        d_diag = [torch.zeros(T, nkv, n_diag, x.shape[-1], dtype=acc, device=x.device) for x in (k0, v0)] if n_diag else []
        for cb, lse in zip(plan.batches, lses):
            _attend_backward(cb, q, k0, v0, diag, lse, grad_out, delta, dq, dk0, dv0, d_diag, ctx.scale)
        return (None, None, _as(dq, q.dtype), _as(dk0, k0.dtype), _as(dv0, v0.dtype),
                *[_as(g, k0.dtype) for d_ in d_diag for g in d_.unbind(2)])


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)  # no op dispatched when it is one already


def _by_kv_head(x: torch.Tensor, n: int, rows: int, nkv: int) -> torch.Tensor:
    """[n * rows, nkv, r, d] rows of n chunks (r = g query heads of a kv head, or steps) -> [n * nkv, rows * r, d]:
    one matrix per (chunk, kv head), as bmm wants them."""
    # contiguous: reshape may return a strided view (one chunk, or one kv head), which later views cannot split
    return x.view(n, rows, nkv, -1).transpose(1, 2).reshape(n * nkv, -1, x.shape[-1]).contiguous()


def _to_rows(x: torch.Tensor, n: int, nkv: int, rows: int) -> torch.Tensor:
    """The inverse of _by_kv_head: [n * nkv, rows * r, d] -> [n * rows, nkv, r, d]."""
    return x.view(n, nkv, rows, -1).transpose(1, 2).reshape(n * rows, nkv, -1, x.shape[-1])


def _batch_inputs(cb: "ChunkBatch", q, k0, v0, diag):
    """The chunk batch's queries [n*nkv, C*g, d], keys [n*nkv, S, d] and values [n*nkv, S, dv] (one matrix per
    chunk and kv head; query rows ordered (c, g)), and the diag keys [n*nkv*C, i, d] and values [n*nkv*C, i, dv]
    at the queries' rows (wide: fp32)."""
    n, C, S = cb.shape
    nkv, d, dv = k0.shape[1], k0.shape[2], v0.shape[2]
    qh = _by_kv_head(cb.rows(q, cb.queries).view(n * C, nkv, -1, d), n, C, nkv)
    kh = _by_kv_head(cb.rows(k0, cb.keys).view(n * S, nkv, 1, d), n, S, nkv)
    vh = _by_kv_head(cb.rows(v0, cb.keys).view(n * S, nkv, 1, dv), n, S, nkv)
    n_diag = len(diag) // 2
    kd = vd = None
    if n_diag:
        kd = _wide(_by_kv_head(cb.rows(torch.stack(diag[:n_diag], dim=2), cb.queries), n, C, nkv)).reshape(-1, n_diag, d)
        vd = _wide(_by_kv_head(cb.rows(torch.stack(diag[n_diag:], dim=2), cb.queries), n, C, nkv)).reshape(-1, n_diag, dv)
    return qh, kh, vh, kd, vd


def _probabilities(cb: "ChunkBatch", qh, kh, kd, scale: float, lse=None):
    """Softmax probabilities of the chunk batch over its step-0 keys [n*nkv, C*g, S] and its diag keys
    [n*nkv*C, g, i] (None without), and the log-sum-exp [n*nkv, C*g] (given in backward: from forward)."""
    n, C, S = cb.shape
    B, Cg, d = qh.shape
    scores = _wide(torch.bmm(qh, kh.transpose(1, 2)))  # [B, C*g, S]
    scores.view(n, B // n, C, Cg // C, S).mul_(scale).masked_fill_(cb.blocked5, float("-inf"))
    diag_scores = None
    if kd is not None:
        diag_scores = torch.bmm(_wide(qh).view(B * C, Cg // C, d), kd.transpose(1, 2)).mul_(scale)  # [B*C, g, i]
    if lse is None:
        lse = scores.logsumexp(dim=-1)
        if diag_scores is not None:  # fold in the diag keys: log(exp(lse) + sum exp(diag))
            lse = torch.logaddexp(lse, diag_scores.logsumexp(dim=-1).view(B, Cg))
    p = scores.sub_(lse.unsqueeze(-1)).exp_()
    p_diag = None if diag_scores is None else diag_scores.sub_(lse.view(B * C, Cg // C, 1)).exp_()
    return p, p_diag, lse


def _attend_forward(cb: "ChunkBatch", q, k0, v0, diag, scale: float):
    n, C, _ = cb.shape
    nkv, dv = k0.shape[1], v0.shape[2]
    qh, kh, vh, kd, vd = _batch_inputs(cb, q, k0, v0, diag)
    B, Cg, _ = qh.shape
    p, p_diag, lse = _probabilities(cb, qh, kh, kd, scale)
    out = _wide(torch.bmm(_as(p, vh.dtype), vh))  # [B, C*g, dv]
    if p_diag is not None:
        out.view(B * C, Cg // C, dv).baddbmm_(p_diag, vd)
    return _as(_to_rows(out, n, nkv, C).reshape(n * C, -1, dv), q.dtype), lse


def _attend_backward(cb: "ChunkBatch", q, k0, v0, diag, lse, grad_out, delta, dq, dk0, dv0, d_diag, scale: float):
    """Adds the chunk batch's gradients into dq, dk0, dv0 and d_diag ([T, nkv, i, d] and [T, nkv, i, dv]; index_add: key rows repeat
    across chunks). FlashAttention's algebra: dV = P^T dO; dS = P * (dO V^T - D) * scale; dQ = dS K; dK = dS^T Q
    (the g query heads of a kv head are rows of one matrix: their dK and dV sum in the matmul)."""
    n, C, S = cb.shape
    nkv, dv = k0.shape[1], v0.shape[2]
    qh, kh, vh, kd, vd = _batch_inputs(cb, q, k0, v0, diag)
    B, Cg, d = qh.shape
    p, p_diag, _ = _probabilities(cb, qh, kh, kd, scale, lse)
    do, dlt = cb.rows(grad_out, cb.queries), cb.rows(delta, cb.queries)
    if cb.query_weight is not None:  # the last chunk's padding repeats a real row: its gradient must not count
        do = do * _as(cb.query_weight, do.dtype)[:, None, None]
        dlt = dlt * cb.query_weight[:, None]
    do_h = _by_kv_head(do.view(n * C, nkv, -1, dv), n, C, nkv)  # [B, C*g, dv]
    dlt = _by_kv_head(dlt.view(n * C, nkv, -1, 1), n, C, nkv).view(B, Cg, 1)
    dv_h = torch.bmm(_as(p, do_h.dtype).transpose(1, 2), do_h)  # [B, S, dv]
    ds = _wide(torch.bmm(do_h, vh.transpose(1, 2))).sub_(dlt).mul_(p).mul_(scale)  # [B, C*g, S]
    ds = _as(ds, q.dtype)
    dq_h = _wide(torch.bmm(ds, kh))  # [B, C*g, d]
    dk_h = torch.bmm(ds.transpose(1, 2), qh)  # [B, S, d]
    if p_diag is not None:
        do_d = _wide(do_h).view(B * C, Cg // C, dv)
        ds_diag = torch.bmm(do_d, vd.transpose(1, 2)).sub_(dlt.view(B * C, Cg // C, 1)).mul_(p_diag).mul_(scale)
        dq_h.view(B * C, Cg // C, d).baddbmm_(ds_diag, kd)
        i = kd.shape[1]
        dkd = torch.bmm(ds_diag.transpose(1, 2), _wide(qh).view(B * C, Cg // C, d)).view(B, C * i, d)
        dvd = torch.bmm(p_diag.transpose(1, 2), do_d).view(B, C * i, dv)
        cb.add_rows(d_diag[0], cb.queries, _to_rows(dkd, n, nkv, C))
        cb.add_rows(d_diag[1], cb.queries, _to_rows(dvd, n, nkv, C))
    cb.add_rows(dq, cb.queries, _to_rows(dq_h, n, nkv, C))
    cb.add_rows(dk0, cb.keys, _to_rows(dk_h, n, nkv, S))
    cb.add_rows(dv0, cb.keys, _to_rows(dv_h, n, nkv, S))


def chunked_ttt_attention(q, ks, vs, meta: AttentionMeta) -> torch.Tensor:
    """q [T, nh, d] of step i = len(ks) - 1; ks/vs: per-step keys [T, nkv, d] (after RoPE) and values [T, nkv, dv]."""
    return TTTAttention.apply(meta.chunk_plan(q.device), meta.softmax_scale(q), q, ks[0], vs[0], *ks[1:], *vs[1:])


def build_ttt_mask(seq_lens, steps: int, device=None) -> torch.Tensor:
    """The full TTT mask over the concatenated sequence [step 0 | step 1 | ...], [(steps*T), (steps*T)] bool.

    Row (i, t) may attend column (j, s) iff j == 0 and s <= t in the same sample (the step-0
    context), or 1 <= j <= i and s == t (the query's own earlier draft steps).
    """
    seq_lens = [int(n) for n in seq_lens]
    T = sum(seq_lens)
    sample = torch.repeat_interleave(torch.arange(len(seq_lens), device=device),
                                     torch.tensor(seq_lens, device=device))
    n = torch.arange(steps * T, device=device)
    step, tok = n // T, n % T
    q_step, q_tok = step[:, None], tok[:, None]
    k_step, k_tok = step[None, :], tok[None, :]
    context = (k_step == 0) & (sample[k_tok] == sample[q_tok]) & (k_tok <= q_tok)
    own_chain = (k_step >= 1) & (k_step <= q_step) & (k_tok == q_tok)
    return context | own_chain


def naive_ttt_attention(q, ks, vs, meta_or_seq_lens) -> torch.Tensor:
    """Reference: plain softmax attention of step i's queries over all steps' keys with the full mask (the scale:
    the meta's, or 1/sqrt(d) given seq_lens)."""
    meta = meta_or_seq_lens if isinstance(meta_or_seq_lens, AttentionMeta) else None
    seq_lens = meta.layout.seq_lens if meta else meta_or_seq_lens
    scale = meta.softmax_scale(q) if meta else q.shape[-1] ** -0.5
    T, nh, d = q.shape
    step = len(ks) - 1
    mask = build_ttt_mask(seq_lens, step + 1, device=q.device)[step * T:(step + 1) * T]  # rows of step i
    k = torch.cat(ks, dim=0)
    v = torch.cat(vs, dim=0)
    g = nh // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("thd,shd->hts", _wide(q), _wide(k)) * scale
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", p, _wide(v)).to(q.dtype)


def flex_ttt_attention(q, ks, vs, meta: AttentionMeta) -> torch.Tensor:
    """flex_attention over [k_0 | k_1 | ... | k_i] with the TTT mask as a block mask.

    Experimental: checked against `naive` on CPU (eager, forward only: flex has no CPU backward);
    not yet run on CUDA, where it is compiled. "chunked" is the default and exact everywhere.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    T = q.shape[0]
    n_steps = len(ks)
    sample = meta.layout.sample
    if n_steps not in meta.block_masks:
        def mask_mod(b, h, q_idx, kv_idx):
            blk = kv_idx // T
            tok = kv_idx - blk * T
            # clamp: block-mask construction may probe indices in the padding past T
            same_sample = sample[tok.clamp(max=T - 1)] == sample[q_idx.clamp(max=T - 1)]
            context = (blk == 0) & same_sample & (tok <= q_idx)
            return context | ((blk > 0) & (tok == q_idx))

        meta.block_masks[n_steps] = create_block_mask(mask_mod, None, None, T, n_steps * T, device=q.device)
    k = torch.cat(ks, dim=0).transpose(0, 1).unsqueeze(0)
    v = torch.cat(vs, dim=0).transpose(0, 1).unsqueeze(0)
    out = _FLEX(q.transpose(0, 1).unsqueeze(0), k, v, block_mask=meta.block_masks[n_steps], scale=meta.softmax_scale(q),
                enable_gqa=True)
    return out[0].transpose(0, 1)


def _flex_fn():
    from torch.nn.attention.flex_attention import flex_attention

    if torch.cuda.is_available():
        return torch.compile(flex_attention)  # packed rows vary in length: let dynamo go dynamic
    return flex_attention


class _LazyFlex:
    fn = None

    def __call__(self, *args, **kwargs):
        if _LazyFlex.fn is None:
            _LazyFlex.fn = _flex_fn()
        return _LazyFlex.fn(*args, **kwargs)


_FLEX = _LazyFlex()

# ----------------------------------------------------------------------------- backends


class AttentionBackend:
    """One TTT attention implementation, as the draft and 04 use it: `attend(q, ks, vs, meta)`, whether it can
    run on a device at all (`unsupported`), and whether it computes the right thing there at these heads
    (`self_check`, run by `choose_attention` before 04 picks it by itself)."""

    name = ""
    label = ""  # how 04's start-up line names it

    def attend(self, q, ks, vs, meta: AttentionMeta) -> torch.Tensor:
        raise NotImplementedError

    def unsupported(self, device: torch.device) -> str | None:
        """Why this backend cannot run forward and backward on `device`, or None."""
        return None

    def self_check(self, heads: int, kv_heads: int, head_dim: int, device: torch.device,
                   value_head_dim: int | None = None) -> str | None:
        """Why this backend must not be picked by itself here (it fails or disagrees with "chunked"), or None.
        value_head_dim: the value heads' width when it is not head_dim (MLA)."""
        return None


class ChunkedAttention(AttentionBackend):
    name = label = "chunked"

    def attend(self, q, ks, vs, meta):
        return chunked_ttt_attention(q, ks, vs, meta)


class NaiveAttention(AttentionBackend):
    name = label = "naive"

    def attend(self, q, ks, vs, meta):
        return naive_ttt_attention(q, ks, vs, meta)


class FlexAttention(AttentionBackend):
    name, label = "flex", "flex_attention"

    def attend(self, q, ks, vs, meta):
        return flex_ttt_attention(q, ks, vs, meta)

    def unsupported(self, device):
        return None if device.type == "cuda" else "flex_attention has no CPU backward"

    def self_check(self, heads, kv_heads, head_dim, device, value_head_dim=None):
        """None when flex's forward and backward run at this head layout and equal the chunked attention's (bf16
        tolerance); else why not, in a few words (e.g. PyTorch #198224: flex's backward fails on SM120 for
        head_dim > 128)."""
        try:
            g = torch.Generator(device=device).manual_seed(0)  # its own generator: the caller's RNG stream is untouched
            seq_lens, steps = [200, 56], 3
            T = sum(seq_lens)
            make = lambda h, d=head_dim: torch.randn(T, h, d, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
            q = make(heads)
            ks, vs = [make(kv_heads) for _ in range(steps)], [make(kv_heads, value_head_dim or head_dim) for _ in range(steps)]
            results = []
            for backend in (self, ATTENTION_BACKENDS["chunked"]):
                meta = AttentionMeta(PackedLayout.build(seq_lens, T, device), impl=backend.name)
                out = backend.attend(q, ks, vs, meta)
                grads = torch.autograd.grad(out.float().square().sum(), [q, *ks, *vs])
                results.append([out, *grads])
            for a, b in zip(*results):
                err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
                if not err < 0.05:
                    return f"its result differs from chunked by {err:.2g} (relative)"
            return None
        except Exception as e:  # any failure means: use the chunked attention
            return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (ChunkedAttention(), FlexAttention(), NaiveAttention())}
AUTO_PREFERENCE = ("flex", "chunked")  # what "auto" tries, in order; chunked runs everywhere


def choose_attention(requested: str, heads: int, kv_heads: int, head_dim: int, device: torch.device,
                     value_head_dim: int | None = None) -> tuple[str, str]:
    """train.attention_impl resolved to a backend name, and why (04 prints it): a named backend where it can run on
    `device`; "auto" = the first of AUTO_PREFERENCE that can run here and passes its self-check at the draft's head
    layout (value_head_dim: the value heads' width where it is not head_dim, as MLA's)."""
    if requested != "auto":
        if requested not in ATTENTION_BACKENDS:
            raise ConfigError(f"train.attention_impl={requested!r} is unknown; use auto or one of {sorted(ATTENTION_BACKENDS)}")
        why_not = ATTENTION_BACKENDS[requested].unsupported(device)
        if why_not:
            raise ConfigError(f"train.attention_impl={requested} cannot run on {device.type} ({why_not}); set it to auto or chunked")
        return requested, "train.attention_impl"
    passed_over = []
    for name in AUTO_PREFERENCE:
        backend = ATTENTION_BACKENDS[name]
        why_not = backend.unsupported(device)
        if why_not is None:
            problem = backend.self_check(heads, kv_heads, head_dim, device, value_head_dim)
            if problem is None:
                if name == "chunked":  # the fallback: say why the others were passed over
                    return name, "; ".join(passed_over) or "train.attention_impl auto"
                return name, f"{backend.label} checked against chunked on this {'GPU' if device.type == 'cuda' else device.type}"
            why_not = f"{backend.label} unusable here: {problem}"
        passed_over.append(why_not)
    raise AssertionError("chunked runs everywhere")  # unreachable: chunked has no unsupported device and no self-check
