#!/usr/bin/env bash
# Run the test suite on a fresh machine: sets up the environment (idempotent), then pytest.
#   bash scripts/test.sh            default suite (unit + integration with a real vLLM CPU server)
#   bash scripts/test.sh --all      also the slow end-to-end tests (what CI runs)
#   bash scripts/test.sh -k extract any other arguments go to pytest
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup.sh" | tail -n 1)"
cd "$root"
marker=(-m "not slow")
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then marker=(); else args+=("$a"); fi
done
exec "$py" -m pytest tests "${marker[@]}" "${args[@]}"
