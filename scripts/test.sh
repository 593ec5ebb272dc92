#!/usr/bin/env bash
# Run the test suite on a fresh machine: sets up the environment (idempotent), then pytest.
#   bash scripts/test.sh            default suite (unit + integration with a real vLLM CPU server)
#   bash scripts/test.sh --all      also the slow end-to-end tests (what CI runs)
#   bash scripts/test.sh -k extract any other arguments go to pytest
#   EAGLE3_TEST_WORKERS=0 bash scripts/test.sh   one process (default: 2 pytest-xdist workers)
# Two workers, because much of a test's time is one process waiting (a subprocess importing torch, vLLM starting,
# a stage's single-threaded steps), and each worker's vLLM server and training fit twice in 24 GiB. worksteal:
# the slow tests take minutes each, so an idle worker takes tests from the busy one's queue.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup.sh" | tail -n 1)"
cd "$root"
marker=(-m "not slow")
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then marker=(); else args+=("$a"); fi
done
workers="${EAGLE3_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then parallel=(-n "$workers" --dist worksteal); fi
exec "$py" -m pytest tests "${marker[@]}" "${parallel[@]}" "${args[@]}"
