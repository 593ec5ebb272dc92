"""The TTT loss: teacher construction, alignment/masks against a by-hand loop, accuracy through
d2t, chunking invariance, and a loss that falls when training on a fixed batch."""

from __future__ import annotations

import math

import pytest
import torch

from common.model.draft import DraftModelConfig, Eagle3DraftModel
from common.model import ttt
from common.model.ttt import TTTOutput, teacher_from_final_hidden, ttt_loss

H, H_T, V, V_D = 64, 48, 300, 100


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(seed=0, layers=1, vocab=V, draft_vocab=V_D) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    cfg = DraftModelConfig(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=H_T,
                           aux_layer_ids=[1, 2, 3], num_hidden_layers=layers)
    return Eagle3DraftModel(cfg)


def random_vocab_map(seed=0, vocab=V, draft_vocab=V_D):
    g = torch.Generator().manual_seed(seed)
    used = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    d2t = used - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d, used


def make_batch(seq_lens, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    aux = torch.randn(T, 3 * H_T, generator=g)
    ids = torch.randint(0, V, (T,), generator=g)
    final = torch.randn(T, H_T, generator=g) * scale
    loss_mask = (torch.rand(T, generator=g) < 0.7).to(torch.uint8)
    pos = torch.cat([torch.arange(n) for n in seq_lens])
    lm_head = torch.randn(V, H_T, generator=g) / math.sqrt(H_T)
    return aux, ids, final, loss_mask, pos, lm_head


# ---------------------------------------------------------------------------------------------
# teacher
# ---------------------------------------------------------------------------------------------


def test_teacher_equals_full_logits_and_is_chunk_invariant():
    d2t, t2d, used = random_vocab_map()
    _, _, final, _, _, lm_head = make_batch([37], scale=3.0)
    full = final @ lm_head.T  # [T, V]
    want_logp = torch.log_softmax(full[:, t2d], dim=-1)
    want_argmax = full.argmax(-1)
    for chunk in (1, 5, 37, 1000):
        logp, argmax = teacher_from_final_hidden(final, lm_head, t2d, chunk_tokens=chunk)
        assert logp.dtype == torch.float32 and argmax.dtype == torch.int64
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
        assert torch.equal(argmax, want_argmax)
        logp_d2t, _ = teacher_from_final_hidden(final, lm_head, t2d, chunk_tokens=chunk, d2t=d2t)
        torch.testing.assert_close(logp_d2t, want_logp, rtol=0, atol=1e-5)
    # renormalised over the draft vocab
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(37), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# loss against a by-hand loop over (step, sample, t)
# ---------------------------------------------------------------------------------------------


def reference_ttt(model, aux, ids, final, loss_mask, pos, seq_lens, lm_head, steps, decay):
    logits = model.forward_ttt(aux, ids, pos, seq_lens, steps)
    full = final @ lm_head.T
    draft_ids = model.draft_vocab_target_ids()
    starts = [sum(seq_lens[:k]) for k in range(len(seq_lens))]
    denom = sum(1 for o, L in zip(starts, seq_lens) for t in range(L) if t + 2 <= L - 1 and loss_mask[o + t + 2])
    losses, correct, counts = [], [], []
    for i in range(steps):
        total, right, n = torch.zeros(()), 0, 0
        for o, L in zip(starts, seq_lens):
            for t in range(L):
                if t + 2 + i > L - 1 or not loss_mask[o + t + 2 + i]:
                    continue
                n += 1
                target_logits = full[o + t + 1 + i]
                p = torch.softmax(target_logits[draft_ids], -1)
                logq = torch.log_softmax(logits[i][o + t], -1)
                top = int(target_logits.argmax())
                if model.t2d[top]:
                    total = total - (p * logq).sum()
                right += int(draft_ids[logits[i][o + t].argmax()] == top)
        losses.append(total / max(1, denom))
        correct.append(right)
        counts.append(n)
    return sum(decay**i * l for i, l in enumerate(losses)), [float(l.detach()) for l in losses], correct, counts


@pytest.mark.parametrize("layers", [1, 2])
def test_ttt_loss_equals_hand_loop(layers):
    model = make_model(layers=layers)
    d2t, t2d, _ = random_vocab_map()
    model.set_vocab_map(d2t, t2d)
    seq = [9, 2, 13, 5]
    aux, ids, final, loss_mask, pos, lm_head = make_batch(seq, scale=3.0)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)  # so the draft argmax is not arbitrary
        # make the teacher agree with the draft's step-0 top-1 at every other position
        lm_head = lm_head / lm_head.norm(dim=-1, keepdim=True)
        draft_top = model.draft_to_target_ids(model.forward_ttt(aux, ids, pos, seq, 1)[0].argmax(-1))
        for t in range(0, sum(seq) - 1, 2):
            final[t + 1] = 6.0 * lm_head[draft_top[t]]
    out = ttt_loss(model, aux, ids, final, loss_mask, pos, seq, lm_head, ttt_steps=4, decay=0.8, chunk_tokens=3)
    want_loss, want_steps, want_correct, want_counts = reference_ttt(model, aux, ids, final, loss_mask, pos, seq,
                                                                     lm_head, 4, 0.8)
    assert isinstance(out, TTTOutput)
    torch.testing.assert_close(out.loss, want_loss, rtol=1e-5, atol=1e-5)
    assert out.step_losses == pytest.approx(want_steps, rel=1e-5, abs=1e-6)
    assert out.step_correct == want_correct
    assert out.step_counts == want_counts
    assert out.denominator == want_counts[0]
    assert sum(want_correct) > 0  # the accuracy path was exercised


def test_step_counts_follow_the_alignment():
    """seq [5, 3], every token loss-masked: step i counts max(0, L-2-i) per sample; a zero in loss_mask
    at row r removes the position predicting token r at every step."""
    model = make_model()
    seq = [5, 3]
    aux, ids, final, _, pos, lm_head = make_batch(seq)
    ones = torch.ones(8, dtype=torch.uint8)
    out = ttt_loss(model, aux, ids, final, ones, pos, seq, lm_head, ttt_steps=4, decay=1.0)
    assert out.step_counts == [3 + 1, 2 + 0, 1, 0]
    mask = ones.clone()
    mask[3] = 0  # token x_3 of sample 0: predicted by t=1 at step 0 and by t=0 at step 1
    out = ttt_loss(model, aux, ids, final, mask, pos, seq, lm_head, ttt_steps=4, decay=1.0)
    assert out.step_counts == [3, 1, 1, 0]
    mask = ones.clone()
    mask[:2] = 0  # prompt tokens 0, 1 are never predicted, so nothing changes
    mask[7] = 0  # last token of sample 1 (its only step-0 target)
    out = ttt_loss(model, aux, ids, final, mask, pos, seq, lm_head, ttt_steps=4, decay=1.0)
    assert out.step_counts == [3, 2, 1, 0]
    assert out.denominator == 3
    out.loss.backward()  # the all-empty last step keeps the graph usable
    assert model.lm_head.weight.grad is not None


def test_accuracy_maps_draft_predictions_through_d2t(monkeypatch):
    """Draft always predicts draft id 1 (= target id 5); the teacher's top-1 is 5, 7 or 3 (3 is outside
    the draft vocab): correct == number of counted positions whose teacher top-1 is 5; positions with top-1
    3 count for accuracy but are dropped from the loss (official t2d filter)."""
    model = make_model(vocab=10, draft_vocab=3)
    d2t = torch.tensor([2, 4, 5])  # draft 0,1,2 -> target 2,5,7
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[2, 5, 7]] = True
    model.set_vocab_map(d2t, t2d)
    # the draft's top-1 is draft id 1 at every row (the loss is beside the point here)
    monkeypatch.setattr(ttt, "step_loss", lambda m, hidden, rows, *a: (0.0 * hidden[rows].sum(), torch.ones_like(rows)))
    seq = [8]
    tops = [5, 7, 3, 5, 5, 3, 7, 5]  # teacher top-1 at positions 0..7
    lm_head = torch.eye(10, H_T)
    final = torch.stack([lm_head[k] * 5.0 for k in tops])
    ids = torch.randint(0, 10, (8,))
    aux = torch.randn(8, 3 * H_T)
    pos = torch.arange(8)
    out = ttt_loss(model, aux, ids, final, torch.ones(8, dtype=torch.uint8), pos, seq, lm_head, ttt_steps=2, decay=1.0)
    # step 0: t = 0..5, teacher rows 1..6 -> tops 7,3,5,5,3,7 -> 2 correct; step 1: rows 2..6 -> 3,5,5,3,7 -> 2
    assert out.step_counts == [6, 5]
    assert out.step_correct == [2, 2]
    assert out.step_loss_counts == [4, 3]  # rows with top-1 3 dropped from the loss
    assert out.step_hits is None
    # per position (what common.model.acceptance replays): step i at index t is right when tops[t+1+i] == 5
    out = ttt_loss(model, aux, ids, final, torch.ones(8, dtype=torch.uint8), pos, seq, lm_head, ttt_steps=2, decay=1.0,
                   per_position=True)
    assert out.step_hits.tolist() == [[False, False, True, True, False, False, False, False],
                                      [False, True, True, False, False, False, False, False]]


def test_chunking_and_checkpointing_do_not_change_loss_or_grads():
    seq = [11, 4, 9]
    aux, ids, final, loss_mask, pos, lm_head = make_batch(seq, seed=3, scale=2.0)
    results = []
    for chunk, ckpt, gc, attn_chunk in [(1000, False, False, 1024), (4, True, False, 3), (7, True, True, 5)]:
        model = make_model(seed=1, layers=2)
        model.gradient_checkpointing = gc
        model.attn_chunk_size = attn_chunk
        out = ttt_loss(model, aux, ids, final, loss_mask, pos, seq, lm_head, ttt_steps=3, decay=0.8,
                       chunk_tokens=chunk)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (ref, ref_grads), *others = results
    for out, grads in others:
        torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=1e-5)
        assert out.step_correct == ref.step_correct and out.step_counts == ref.step_counts
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packed_loss_is_independent_of_packing():
    """Same samples, packed in one row or run one by one with the global denominator: same total."""
    model = make_model(seed=2)
    seq = [7, 10, 6]
    aux, ids, final, loss_mask, pos, lm_head = make_batch(seq, seed=4, scale=2.0)
    packed = ttt_loss(model, aux, ids, final, loss_mask, pos, seq, lm_head, ttt_steps=3, decay=0.8)
    total, start = 0.0, 0
    for n in seq:
        sl = slice(start, start + n)
        part = ttt_loss(model, aux[sl], ids[sl], final[sl], loss_mask[sl], pos[sl], [n], lm_head, ttt_steps=3,
                        decay=0.8, denominator=packed.denominator)
        total = total + part.loss
        start += n
    torch.testing.assert_close(packed.loss, total, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# training on a fixed batch
# ---------------------------------------------------------------------------------------------


def test_loss_falls_and_accuracy_rises_on_a_fixed_batch():
    """A 'bigram' target: the teacher at position p is peaked on succ(x_p), a draft-vocab token. The draft
    can learn it from its input token at every step, so 50 AdamW steps must more than halve the loss."""
    torch.manual_seed(0)
    d2t, t2d, used = random_vocab_map(seed=5)
    model = make_model(seed=3)
    model.set_vocab_map(d2t, t2d)
    model.load_target_embedding(torch.randn(V, H))
    g = torch.Generator().manual_seed(6)
    seq = [40, 25, 35]
    T = sum(seq)
    ids = used[torch.randint(0, V_D, (T,), generator=g)]  # tokens from the draft vocab
    succ = used[torch.randint(0, V_D, (V,), generator=g)]
    lm_head = torch.randn(V, H_T, generator=g)
    lm_head = lm_head / lm_head.norm(dim=-1, keepdim=True)
    final = 8.0 * lm_head[succ[ids]]
    aux = torch.randn(T, 3 * H_T, generator=g)
    loss_mask = torch.ones(T, dtype=torch.uint8)
    pos = torch.cat([torch.arange(n) for n in seq])
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3, weight_decay=0.0)
    history = []
    for _ in range(50):
        out = ttt_loss(model, aux, ids, final, loss_mask, pos, seq, lm_head, ttt_steps=3, decay=0.8)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        history.append(out)
    first, last = history[0], history[-1]
    assert last.loss.item() < 0.5 * first.loss.item(), (first.loss.item(), last.loss.item())
    for step in range(3):
        acc0 = first.step_correct[step] / first.step_counts[step]
        acc1 = last.step_correct[step] / last.step_counts[step]
        assert acc1 > acc0 + 0.5, (step, acc0, acc1)


@pytest.mark.skipif(not hasattr(torch, "distributed") or not torch.distributed.is_available(),
                    reason="torch.distributed unavailable")
def test_works_through_a_ddp_wrapper(tmp_path):
    """ttt_loss runs the draft through model(...), so DDP sees the forward and syncs every gradient."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = make_model(seed=4)
        ddp = DDP(model)
        seq = [8, 6]
        aux, ids, final, loss_mask, pos, lm_head = make_batch(seq, seed=2)
        out = ttt_loss(ddp, aux, ids, final, loss_mask, pos, seq, lm_head, ttt_steps=2, decay=0.8)
        out.loss.backward()
        assert all(p.grad is not None for p in model.trainable_parameters())
        plain = make_model(seed=4)
        ref = ttt_loss(plain, aux, ids, final, loss_mask, pos, seq, lm_head, ttt_steps=2, decay=0.8)
        ref.loss.backward()
        torch.testing.assert_close(model.fc.weight.grad, plain.fc.weight.grad, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_checkpointed_steps_keep_no_teacher_copy_until_backward():
    """A checkpointed TTT step keeps no copy of the teacher until backward (handing `teacher_logp[rows]`, a fresh
    [rows, V_d] float32 copy, into checkpoint() would keep one per step). Counted with autograd's saved-tensor
    hooks: the bytes saved for backward in [*, V_d] float32 tensors other than the teacher itself stay below one
    such copy."""
    seq = [40, 33, 28]  # T = 101: the attention mask [T, T] is not mistaken for a [*, V_D] tensor
    aux, ids, final, loss_mask, pos, lm_head = make_batch(seq, seed=5)
    model = make_model(seed=2)
    teacher = teacher_from_final_hidden(final, lm_head, model.t2d, chunk_tokens=1024, d2t=model.d2t)
    teacher_ptr = teacher[0].untyped_storage().data_ptr()
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ttt_loss(model, aux, ids, final, loss_mask, pos, seq, lm_head, ttt_steps=3, decay=0.8, teacher=teacher,
                       chunk_tokens=1024)
    copies = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
              if t.dtype == torch.float32 and t.dim() == 2 and t.shape[-1] == V_D and t.untyped_storage().data_ptr() != teacher_ptr}
    one_copy = out.step_counts[0] * V_D * 4
    assert sum(copies.values()) < one_copy, (sum(copies.values()), one_copy)
    out.loss.backward()  # and the recomputation still works
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
