"""common.core.distributed in one process: every collective is the identity, and NamedSums keeps named
sums in one fixed flat layout (what a checkpoint stores); on_rank0 with two gloo processes. The 2-process
training paths run in tests/train/test_train_ddp.py."""

import pytest
import torch

from common.core.distributed import DistEnv, NamedSums, all_reduce_sum, barrier, broadcast_object, init_distributed, on_rank0
from common.core.errors import DataError


def test_single_process_environment_and_collectives(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    env = init_distributed()
    assert (env.rank, env.world_size, env.local_rank, env.is_main, env.distributed) == (0, 1, 0, True, False)
    t = torch.tensor([1.0, 2.0])
    assert all_reduce_sum(t, env) is t and broadcast_object({"a": 1}, env) == {"a": 1}
    barrier(env)  # no process group: returns at once


def test_named_sums_add_by_name_in_a_fixed_layout():
    sums = NamedSums(loss=1, tokens=1, step_correct=3)
    sums.add(loss=0.5, tokens=128, step_correct=[3, 2, 1])
    sums.add(loss=0.25, step_correct=[1, 1, 0])
    totals = sums.all_reduced(DistEnv())
    assert totals["loss"].tolist() == [0.75] and totals["tokens"].tolist() == [128.0]
    assert totals["step_correct"].tolist() == [4.0, 3.0, 1.0]
    assert sums.flat.tolist() == [0.75, 128.0, 4.0, 3.0, 1.0]  # names in declaration order
    sums.zero_()
    assert sums.flat.tolist() == [0.0] * 5 and totals["loss"].tolist() == [0.75]  # all_reduced gave a copy

    restored = NamedSums(loss=1, tokens=1, step_correct=3)
    restored.load_flat(torch.tensor([0.75, 128.0, 4.0, 3.0, 1.0]))
    assert restored.all_reduced(DistEnv())["step_correct"].tolist() == [4.0, 3.0, 1.0]
    with pytest.raises(ValueError, match="expected 5 sums"):
        restored.load_flat(torch.zeros(4))


def _on_rank0_worker(rank: int, port: int, queue) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    env = DistEnv(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    calls = []

    def decide(value):
        calls.append(rank)
        if value is None:
            raise DataError("the hash failed on rank 0")
        return value

    try:
        result = on_rank0(lambda: decide({"sha": "abc"}), env)
        try:
            on_rank0(lambda: decide(None), env)
            error = None
        except DataError as e:  # every rank gets rank 0's error, none waits in a collective
            error = str(e)
        queue.put((rank, result, error, calls))
    finally:
        dist.destroy_process_group()


def test_on_rank0_runs_once_and_hands_every_rank_its_result_or_its_error():
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    assert on_rank0(lambda: 7, DistEnv()) == 7  # one process: a plain call
    with pytest.raises(DataError, match="boom"):
        on_rank0(lambda: (_ for _ in ()).throw(DataError("boom")), DistEnv())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_on_rank0_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {rank: (result, error, calls) for rank, result, error, calls in (queue.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == ({"sha": "abc"}, "the hash failed on rank 0", [0, 0])
    assert results[1] == ({"sha": "abc"}, "the hash failed on rank 0", [])  # rank 1 never ran it
