"""Under FSDP2 the draft is one FSDP unit: one all-gather and one reduce-scatter per micro-batch, counted on
the collectives FSDP2 calls (2 processes, gloo). With a unit per decoder layer, the layer (which runs once
per TTT step) was gathered again in the backward of every step: 5 all-gathers and 2 reduce-scatters per
micro-batch at 4 TTT steps (1 + 7 all-gathers at the Kimi config)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TTT_STEPS = 4


def _count_collectives(rank: int, world: int, init_file: str, queue) -> None:
    torch.set_num_threads(1)
    # a file store: no port to pick (one picked free may be taken before the group binds it)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from common.core.distributed import DistEnv, wrap_parallel
        from common.model.ttt import ttt_loss
        from tests.model.test_ttt import make_batch, make_model

        counts = {"all_gather": 0, "reduce_scatter": 0}
        for name, key in (("all_gather_single", "all_gather"), ("all_gather_into_tensor", "all_gather"),
                          ("reduce_scatter_single", "reduce_scatter"), ("reduce_scatter_tensor", "reduce_scatter")):
            original = getattr(dist, name, None)
            if original is None:
                continue

            def counted(*args, _original=original, _key=key, **kwargs):
                counts[_key] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        model = make_model(seed=3, layers=1)
        model.gradient_checkpointing = True
        env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
        wrapped = wrap_parallel(model, env, "fsdp", torch.float32)
        seq = [12, 9]
        aux, ids, final, loss_mask, pos, lm_head = make_batch(seq, seed=rank)
        per_micro_batch = []
        for _ in range(2):
            before = dict(counts)
            out = ttt_loss(wrapped, aux, ids, final, loss_mask, pos, seq, lm_head, ttt_steps=TTT_STEPS, decay=0.8)
            out.loss.backward()
            per_micro_batch.append({k: counts[k] - before[k] for k in counts})
        queue.put((rank, per_micro_batch))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_one_all_gather_and_one_reduce_scatter_per_micro_batch(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_count_collectives, args=(r, 2, str(tmp_path / "pg"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, per_micro_batch in results.items():
        # one unit: gathered once before the TTT steps, its gradients reduce-scattered once after the backward
        assert per_micro_batch == [{"all_gather": 1, "reduce_scatter": 1}] * 2, (rank, per_micro_batch)
