#!/usr/bin/env bash
# Run the test suite on a fresh machine: sets up the environment (idempotent), then pytest.
#   bash scripts/test.sh            default suite (unit + integration with a real vLLM CPU server)
#   bash scripts/test.sh --all      also the slow end-to-end tests (what CI runs)
#   bash scripts/test.sh -k extract any other arguments go to pytest
#   EAGLE3_TEST_WORKERS=0 bash scripts/test.sh   the default suite in one process (default: 2 pytest-xdist workers)
# The default suite runs in 2 workers: much of a fast test's time is one process waiting (a subprocess importing
# torch, a stage's single-threaded steps). The slow tests run after it in one process: each runs whole pipelines with
# vLLM-CPU servers, whose OMP threads are bound to the cores and spin, so two at once ran up to 5x slower each
# (2026-12-07: the Kimi-shaped proxy's test took 1437 s beside another, 205 s alone).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup.sh" | tail -n 1)"
cd "$root"
all=0
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then all=1; else args+=("$a"); fi
done
workers="${EAGLE3_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then parallel=(-n "$workers" --dist worksteal); fi
rc=0
"$py" -m pytest tests -m "not slow" "${parallel[@]}" "${args[@]}" || rc=$?
if [ "$all" = 1 ]; then
  # rc 5: no slow test matched the other arguments (e.g. -k), which is not a failure of the run
  slow_rc=0
  "$py" -m pytest tests -m slow "${args[@]}" || slow_rc=$?
  if [ "$slow_rc" != 0 ] && [ "$slow_rc" != 5 ]; then rc=$slow_rc; fi
fi
if [ "$rc" = 5 ] && [ "$all" = 1 ]; then rc=0; fi
exit "$rc"
