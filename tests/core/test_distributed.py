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


HANG_GUARD_S = 600  # only ends a hung test: nothing here waits for it to pass
SHORT_TIMEOUT_S = 3  # the process group's timeout while on_rank0 runs a call that outlives it


def _on_rank0_worker(rank: int, init_file: str, queue, rank1_waits) -> None:
    import traceback
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    try:
        # The start-up under a generous timeout: the two spawned interpreters (each importing torch) reach the
        # rendezvous seconds apart on a loaded machine, and a 3 s timeout here failed the test without a word.
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=HANG_GUARD_S))
        env = DistEnv(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
        calls = []

        def decide(value):
            calls.append(rank)
            if value is None:
                raise DataError("the hash failed on rank 0")
            return value

        def slow():
            assert rank1_waits.wait(HANG_GUARD_S)  # rank 1 is on its way into on_rank0 before this call starts to last
            time.sleep(2 * SHORT_TIMEOUT_S)  # twice the group's timeout, as a cold weights hash outlives the real one
            return "hashed"

        def crash():
            raise KeyError("oops")

        result = on_rank0(lambda: decide({"sha": "abc"}), env)
        try:
            on_rank0(lambda: decide(None), env)
            error = None
        except DataError as e:  # every rank gets rank 0's error, none waits in a collective
            error = str(e)
        _set_pg_timeout(timedelta(seconds=SHORT_TIMEOUT_S))  # a collective that waited for `slow` would time out
        if rank == 1:
            rank1_waits.set()
        slow_result = on_rank0(slow, env)
        _set_pg_timeout(timedelta(seconds=HANG_GUARD_S))  # what follows under the generous one again
        try:
            on_rank0(crash, env)
            crashed = None
        except KeyError as e:  # rank 0: its own exception, with its traceback
            crashed = f"KeyError {e}"
        except PipelineError as e:  # the other ranks: one line that says rank 0 failed
            crashed = str(e)
        barrier(env)  # the group still works after a call longer than its timeout
        queue.put((rank, "ok", result, error, calls, slow_result, crashed))
    except BaseException:  # the test shows it at once, rather than waiting for a result that never comes
        queue.put((rank, "failed", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_on_rank0_runs_once_and_hands_every_rank_its_result_or_its_error(tmp_path):
    """on_rank0 runs fn on rank 0 alone and hands every rank its result, its PipelineError, or a one-line error
    for any other exception; a call longer than the process group's timeout does not trip it (rank 1 waits in
    on_rank0 for twice the timeout). Nothing but that call depends on time: the processes start and meet under a
    generous timeout, and a rank that fails or dies is reported at once."""
    import queue as queue_module

    import torch.multiprocessing as mp

    assert on_rank0(lambda: 7, DistEnv()) == 7  # one process: a plain call
    with pytest.raises(DataError, match="boom"):
        on_rank0(lambda: (_ for _ in ()).throw(DataError("boom")), DistEnv())
    ctx = mp.get_context("spawn")
    queue, rank1_waits = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_on_rank0_worker, args=(r, str(tmp_path / "pg-init"), queue, rank1_waits))
             for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    hang_guard = time.monotonic() + HANG_GUARD_S
    try:
        while len(results) < len(procs):
            try:
                rank, outcome, *rest = queue.get(timeout=1)
            except queue_module.Empty:
                died = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                assert not died, f"ranks died without a word (exit codes {died})"
                assert time.monotonic() < hang_guard, f"no result in {HANG_GUARD_S} s: a hang"
                continue
            assert outcome == "ok", f"rank {rank} failed:\n{rest[0]}"
            results[rank] = rest
        for p in procs:
            p.join(timeout=HANG_GUARD_S)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert results[0] == [{"sha": "abc"}, "the hash failed on rank 0", [0, 0], "hashed", "KeyError 'oops'"]
    # rank 1 never ran fn
    assert results[1] == [{"sha": "abc"}, "the hash failed on rank 0", [], "hashed",
                          "rank 0 failed (KeyError: 'oops'); its traceback is in its output above"]
