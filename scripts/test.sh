#!/usr/bin/env bash
# Set up .venv (idempotent) and run the test suite; extra arguments go to pytest.
#   --fast   the first tier only: the tests that run no command and train in no
#            other process (a few minutes); without it, both tiers
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
args=()
for arg in "$@"; do
  if [[ "$arg" == --fast ]]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
exec "$ROOT/.venv/bin/python" -m pytest "${args[@]+"${args[@]}"}"
