"""04's training step (common/train/step.py): one optimizer step equals a plain reference (the TTT loss by a
hand loop over the naive full-mask attention, plain autograd, clip, AdamW), in every configuration 04 can pick;
the bf16 compute copy; the compiled regions; and how many ops the host dispatches per step."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.step_instruments import count_dispatched_ops, explain_regions
from common.train.data import MicroBatch
from common.train.optim import build_optimizer
from common.train.step import StepLoss, StepSettings, TrainStep, build_step
from tests.model.test_ttt import make_batch, make_model, random_vocab_map, reference_ttt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEQ = [9, 2, 13, 5, 11]
STEPS, DECAY, CLIP, LR = 3, 0.8, 0.5, 1e-2


def adamw(model):
    return build_optimizer(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.01, foreach=False)


def settings(**kw) -> StepSettings:
    """The step's settings here: build_step's AdamW is the reference's (adamw), fp32 unless told."""
    return StepSettings(ttt_steps=STEPS, loss_decay=DECAY, grad_clip=CLIP, lr=LR, betas=(0.9, 0.95), weight_decay=0.01,
                        **kw)


def setup(layers=2):
    model = make_model(seed=3, layers=layers)
    d2t, t2d, _ = random_vocab_map(seed=1)
    model.set_vocab_map(d2t, t2d)
    model.load_target_embedding(torch.randn(model.config.vocab_size, model.config.hidden_size,
                                            generator=torch.Generator().manual_seed(2)))
    aux, ids, final, loss_mask, pos, lm_head = make_batch(SEQ, seed=4, scale=3.0)
    mb = MicroBatch(ids, loss_mask.long(), aux, final, pos, list(SEQ), [f"s{i}" for i in range(len(SEQ))])
    return model, mb, lm_head


def reference_step(model, mb, lm_head):
    """The plain step: hand-loop loss (naive attention), backward, clip, AdamW. Returns (loss, grads, weights after)."""
    model = copy.deepcopy(model)
    model.attention_impl, model.gradient_checkpointing = "naive", False
    optimizer = adamw(model)
    loss, *_ = reference_ttt(model, mb.aux_hidden, mb.input_ids, mb.final_hidden, mb.loss_mask, mb.position_ids,
                             mb.seq_lens, lm_head, STEPS, DECAY)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, CLIP)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer.step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("attention,checkpointing,chunk", [("chunked", False, 512), ("chunked", False, 7),
                                                           ("chunked", True, 7), ("naive", True, 512)])
def test_one_step_equals_the_plain_reference(attention, checkpointing, chunk):
    """Loss, clipped gradients and updated weights of TrainStep.run equal the reference's (fp32, CPU): the chunked
    attention's and the fused loss's hand-written backward passes, in one chunk or several (chunk 7 cuts samples),
    with and without gradient checkpointing."""
    model, mb, lm_head = setup()
    want_loss, want_grads, want_weights = reference_step(model, mb, lm_head)
    model.attention_impl, model.gradient_checkpointing, model.attn_chunk_size = attention, checkpointing, chunk
    step = build_step(model, lm_head, settings())
    result = step.run([(mb, True)], 1, denominator=None)
    assert result.applied
    out, real, tokens = result.outputs[0]
    assert real and tokens == sum(SEQ)
    torch.testing.assert_close(out.loss.detach(), want_loss, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)
            # AdamW's first update is lr * g / (|g| + 1e-8): where |g| ~ 1e-8 or below (the gradients above agree to
            # 1e-10 there), two gradients equal up to rounding move a weight up to ~lr / 100 apart; where |g| is well
            # above eps the updates agree to rounding
            torch.testing.assert_close(p.detach(), want_weights[name], rtol=0, atol=LR / 100, msg=name)
            large = want_grads[name].abs() > 1e-6
            torch.testing.assert_close(p.detach()[large], want_weights[name][large], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_attention_loss_equals_the_reference():
    """flex_attention has no CPU backward (it runs on CUDA, where bench/gpu.sh and 04's start-up self-check compare
    its gradients with the chunked attention's): its loss, forward only, equals the reference's."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model, mb, lm_head = setup()
    want_loss, _, _ = reference_step(model, mb, lm_head)
    model.attention_impl = "flex"
    loss = StepLoss(model, lm_head, settings())
    with torch.no_grad():
        out = loss(mb)
    torch.testing.assert_close(out.loss, want_loss, rtol=1e-5, atol=1e-5)


def test_bf16_compute_copy_trains_the_fp32_master():
    """bf16: forward and backward on a bf16 copy; the fp32 master gets fp32 gradients and the AdamW update, and
    the copy follows it (one cast per step). The loss agrees with fp32 to bf16 precision; the embedding is shared."""
    model, mb, lm_head = setup()
    want_loss, want_grads, _ = reference_step(model, mb, lm_head)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    step = build_step(model, lm_head.bfloat16(), settings(dtype=torch.bfloat16))
    assert step.loss.compute is not model and step.loss.compute.embed_tokens.weight is model.embed_tokens.weight
    bf16_mb = MicroBatch(mb.input_ids, mb.loss_mask, mb.aux_hidden.bfloat16(), mb.final_hidden.bfloat16(),
                         mb.position_ids, mb.seq_lens, mb.sample_ids)
    result = step.run([(bf16_mb, True)], 1, denominator=None)
    assert result.applied
    torch.testing.assert_close(result.outputs[0][0].loss.detach(), want_loss, rtol=3e-2, atol=0)
    masters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for (name, master), copy_ in zip(masters, step.loss.copy.params):
        assert master.dtype == torch.float32 and master.grad.dtype == torch.float32 and copy_.dtype == torch.bfloat16
        assert copy_.grad is None  # moved to the master
        assert torch.equal(copy_.detach(), master.detach().bfloat16()), name
        assert not torch.equal(master.detach(), before[name]), name  # updated
        cos = torch.nn.functional.cosine_similarity(master.grad.flatten(), want_grads[name].flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))
    # a checkpoint loaded into the master: refresh() brings the copy along
    with torch.no_grad():
        model.fc.weight.mul_(2.0)
    step.loss.refresh()
    assert torch.equal(step.loss.copy.module.fc.weight, model.fc.weight.bfloat16())


def test_compiled_regions_equal_eager_and_do_not_break():
    """train.compile: the decoder layers' dense halves under torch.compile (fullgraph, dynamic in T; aot_eager here:
    dynamo and AOT autograd as on a GPU, without generating kernels) give the eager step's loss and gradients, and
    a second micro-batch of another length reuses the graphs."""
    import torch._dynamo

    torch._dynamo.reset()
    model, mb, lm_head = setup()
    eager = copy.deepcopy(model)
    e_step = build_step(eager, lm_head, settings())
    c_step = build_step(model, lm_head, settings(compile=True, compile_backend="aot_eager"))
    assert explain_regions(eager, mb) == {"layer 0 pre_attention": 0, "layer 0 post_attention": 0,
                                          "layer 1 pre_attention": 0, "layer 1 post_attention": 0}
    torch._dynamo.utils.counters.clear()
    graphs = []
    for batch in (mb, shorter(mb, 31)):
        want = e_step.run([(batch, True)], 1, denominator=None)
        got = c_step.run([(batch, True)], 1, denominator=None)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        torch.testing.assert_close(got.outputs[0][0].loss, want.outputs[0][0].loss, rtol=1e-6, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert graphs[0] >= 2 and graphs[1] == graphs[0], graphs  # compiled at the first micro-batch, not again
    torch._dynamo.reset()


def shorter(mb: MicroBatch, n: int) -> MicroBatch:
    """The first samples of mb, n tokens."""
    lens, total = [], 0
    for length in mb.seq_lens:
        if total + length > n:
            break
        lens.append(length)
        total += length
    return MicroBatch(mb.input_ids[:total], mb.loss_mask[:total], mb.aux_hidden[:total], mb.final_hidden[:total],
                      mb.position_ids[:total], lens, mb.sample_ids[:len(lens)])


def test_ops_per_step_at_the_bench_layout():
    """The host's work per optimizer step at the GPU bench's layout (4 samples x 512 tokens, 7 TTT steps; the
    count does not depend on the widths): measured 3,200-3,800 fp32 ops (was 11,760 before the step was rewritten;
    13,059 with bf16 autocast). The bound catches a change that brings per-chunk or per-position Python loops back."""
    import importlib.util

    spec_ = importlib.util.spec_from_file_location("gpu_train_bench", "bench/gpu_train_bench.py")
    bench = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(bench)
    gen = torch.Generator().manual_seed(0)
    step, _ = bench.build_bench_step(bench.CONFIGS["smoke-a"], torch.device("cpu"), gen, attention="chunked",
                                     compile=False, dtype=torch.float32, max_len=2048)
    mb = bench.synthetic_batch(bench.CONFIGS["smoke-a"], 2048, torch.device("cpu"), gen, samples=4, dtype=torch.float32)
    step.run([(mb, True)], 1, denominator=None)  # AdamW's state, lazy buffers
    ops, _ = count_dispatched_ops(lambda: step.run([(mb, True)], 1, denominator=None))
    print(f"aten ops per optimizer step: {ops}")
    assert ops <= 4000, ops


def test_ddp_reduces_bf16_gradients_in_fp32(tmp_path):
    """The bf16 compute copy under DDP: the comm hook sums a bucket in fp32 and rounds once; with one process the
    gradients equal the unwrapped copy's exactly (the hook's fp32 round trip of bf16 values is lossless)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.core.distributed import fp32_allreduce_hook

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model, mb, lm_head = setup()
        plain = build_step(copy.deepcopy(model), lm_head.bfloat16(), settings(dtype=torch.bfloat16))

        def wrap(m):
            ddp = DDP(m, broadcast_buffers=False)
            ddp.register_comm_hook(None, fp32_allreduce_hook)
            return ddp

        bf16 = settings(dtype=torch.bfloat16)  # a DDP wrapper by hand: build_step wraps only with several processes
        wrapped = TrainStep(StepLoss(model, lm_head.bfloat16(), bf16), adamw, wrap=wrap)
        bf16_mb = MicroBatch(mb.input_ids, mb.loss_mask, mb.aux_hidden.bfloat16(), mb.final_hidden.bfloat16(),
                             mb.position_ids, mb.seq_lens, mb.sample_ids)
        for step in (plain, wrapped):
            assert step.run([(bf16_mb, True)], 1, denominator=None).applied
        assert wrapped.ddp
        for a, b in zip(plain.params, wrapped.params):
            assert torch.equal(a.grad, b.grad) and torch.equal(a.detach(), b.detach())
    finally:
        dist.destroy_process_group()
