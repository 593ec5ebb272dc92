"""common.core.distributed in one process: every collective is the identity, and NamedSums keeps named
sums in one fixed flat layout (what a checkpoint stores); on_rank0 with two gloo processes. The 2-process
training paths run in tests/train/test_train_ddp.py."""

import time

import pytest
import torch

from common.core.distributed import DistEnv, NamedSums, all_reduce_sum, barrier, init_distributed, on_rank0
from common.core.errors import DataError, PipelineError


def test_single_process_environment_and_collectives(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    env = init_distributed()
    assert (env.rank, env.world_size, env.local_rank, env.is_main, env.distributed) == (0, 1, 0, True, False)
    t = torch.tensor([1.0, 2.0])
    assert all_reduce_sum(t, env) is t and on_rank0(lambda: {"a": 1}, env) == {"a": 1}
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


def _on_rank0_worker(rank: int, init_file: str, queue) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    # a 3 s process-group timeout: the slow call below outlives it, as a cold weights hash outlives the real one
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=3))
    env = DistEnv(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    calls = []

    def decide(value):
        calls.append(rank)
        if value is None:
            raise DataError("the hash failed on rank 0")
        return value

    def slow():
        time.sleep(5.0)
        return "hashed"

    def crash():
        raise KeyError("oops")

    try:
        result = on_rank0(lambda: decide({"sha": "abc"}), env)
        try:
            on_rank0(lambda: decide(None), env)
            error = None
        except DataError as e:  # every rank gets rank 0's error, none waits in a collective
            error = str(e)
        slow_result = on_rank0(slow, env)
        try:
            on_rank0(crash, env)
            crashed = None
        except KeyError as e:  # rank 0: its own exception, with its traceback
            crashed = f"KeyError {e}"
        except PipelineError as e:  # the other ranks: one line that says rank 0 failed
            crashed = str(e)
        barrier(env)  # the group still works after a call longer than its timeout
        queue.put((rank, result, error, calls, slow_result, crashed))
    finally:
        dist.destroy_process_group()


def test_on_rank0_runs_once_and_hands_every_rank_its_result_or_its_error(tmp_path):
    """on_rank0 runs fn on rank 0 alone and hands every rank its result, its PipelineError, or a one-line error
    for any other exception; a call longer than the process group's timeout does not trip it."""
    import torch.multiprocessing as mp

    assert on_rank0(lambda: 7, DistEnv()) == 7  # one process: a plain call
    with pytest.raises(DataError, match="boom"):
        on_rank0(lambda: (_ for _ in ()).throw(DataError("boom")), DistEnv())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_on_rank0_worker, args=(r, str(tmp_path / "pg-init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {rank: rest for rank, *rest in (queue.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == [{"sha": "abc"}, "the hash failed on rank 0", [0, 0], "hashed", "KeyError 'oops'"]
    # rank 1 never ran fn
    assert results[1] == [{"sha": "abc"}, "the hash failed on rank 0", [], "hashed",
                          "rank 0 failed (KeyError: 'oops'); its traceback is in its output above"]
