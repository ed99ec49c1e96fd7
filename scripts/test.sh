#!/usr/bin/env bash
# Set up .venv (idempotent), lint the code (ruff) and run the test suite; other
# arguments go to pytest.
#   --fast     the fast tier only: the tests that run in pytest's own process
#              (half a minute); without it, both tiers
#   -n N       N workers (default: one per CPU core, at most 4; pytest-xdist); -n 0: one process
#   -h, --help this text
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cores=$(nproc 2>/dev/null || echo 2)
args=() workers=(-n "$(( cores < 4 ? cores : 4 ))" --dist worksteal)
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --fast) args+=(--tier fast) ;;
    -n|-n[0-9]*|--numprocesses*) workers=(); args+=("$arg") ;;
    *) args+=("$arg") ;;
  esac
done
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# Bytecode written and reused (some images turn it off): the suite's hundreds
# of processes import the plugin, and each pytest worker rewrites the test
# modules' asserts; compiled anew each time, collection alone took 11 s, not 7.
unset PYTHONDONTWRITEBYTECODE
"$ROOT/.venv/bin/ruff" check --quiet .
exec "$ROOT/.venv/bin/python" -m pytest "${workers[@]+"${workers[@]}"}" "${args[@]+"${args[@]}"}"
