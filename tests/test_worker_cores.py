"""The test run's own machinery: each pytest-xdist worker is pinned to its share of the cores (conftest.py,
pin_this_worker_to_its_cores), and the all_cores fixture gives a test every core back for its duration."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import worker_cores

ALL = os.environ.get("EAGLE3_TEST_ALL_CORES")
pinned = pytest.mark.skipif(not ALL, reason="runs only where conftest pinned this xdist worker (2+ workers, 2+ cores)")


def test_the_workers_shares_are_equal_and_disjoint():
    for cores, count in (([0, 1], 2), ([0, 1, 2, 3, 4], 2), ([4, 5, 6, 7], 4)):
        shares = [worker_cores(cores, i, count) for i in range(count)]
        assert all(len(s) == len(cores) // count for s in shares)
        assert len({c for s in shares for c in s}) == count * (len(cores) // count)


@pinned
def test_a_worker_and_what_it_starts_use_its_own_cores_only():
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    mine = set(worker_cores([int(c) for c in ALL.split(",")], int(os.environ["PYTEST_XDIST_WORKER"][2:]) % count, count))
    assert len(mine) >= 1 and os.sched_getaffinity(0) == mine
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(sorted(mine))  # vLLM-CPU binds its OMP threads to exactly these


@pinned
def test_all_cores_gives_every_core_back_for_the_test_only(all_cores):
    assert os.sched_getaffinity(0) == {int(c) for c in ALL.split(",")}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
