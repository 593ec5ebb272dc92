"""The test run's own machinery: each pytest-xdist worker is pinned to its share of the cores (conftest.py,
pin_this_worker_to_its_cores), and the all_cores fixture gives a test every core back for its duration."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ALL = os.environ.get("EAGLE3_TEST_ALL_CORES")
pinned = pytest.mark.skipif(not ALL, reason="runs only where conftest pinned this xdist worker (2+ workers, 2+ cores)")


@pinned
def test_a_worker_and_what_it_starts_use_its_own_cores_only():
    every = [int(c) for c in ALL.split(",")]
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    index = int(os.environ["PYTEST_XDIST_WORKER"][2:]) % count
    share = len(every) // count
    mine = set(every[index * share:(index + 1) * share])
    assert os.sched_getaffinity(0) == mine
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(sorted(mine))  # vLLM-CPU binds its OMP threads to exactly these


@pinned
def test_all_cores_gives_every_core_back_for_the_test_only(all_cores):
    assert os.sched_getaffinity(0) == {int(c) for c in ALL.split(",")}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
