#!/usr/bin/env bash
# Set up .venv and run the whole benchmark suite (about 40 minutes on 2 cores);
# arguments go to bench/run.py (see --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
exec "$ROOT/.venv/bin/python" "$ROOT/bench/run.py" "$@"
