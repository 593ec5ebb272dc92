"""common.core.distributed in one process: every collective is the identity, and NamedSums keeps named
sums in one fixed flat layout (what a checkpoint stores). The 2-process paths run in
tests/train/test_train_ddp.py."""

import pytest
import torch

from common.core.distributed import DistEnv, NamedSums, all_reduce_sum, barrier, broadcast_object, init_distributed


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
