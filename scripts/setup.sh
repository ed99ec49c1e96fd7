#!/usr/bin/env bash
# Create (or bring up to date) the virtual environment .venv in the checkout.
# Idempotent: a second run with nothing changed installs nothing.
set -euo pipefail

usage() {
  cat <<USAGE
usage: scripts/setup.sh [--python PYTHON]

Creates .venv in the repository root with torch 2.13.0 (CPU), the Python 3.11
fork of fairseq 0.12 (fairseq-fixed 0.12.3.1, built here: about 3 minutes the
first time) and this plugin in editable mode.
  --python PYTHON   interpreter for the venv (default: python3, 3.11 needed)
USAGE
}

PYTHON=python3
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "setup.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

TORCH=torch==2.13.0
FAIRSEQ=fairseq-fixed==0.12.3.1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.powernorm-setup"

cd "$ROOT"
want="$(cat scripts/setup.sh requirements.txt setup.py | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0  # up to date
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# torch first, pinned: anything unpinned later must find it satisfied
"${pip[@]}" "$TORCH"
"${pip[@]}" -r requirements.txt
# fairseq without its declared deps (they include torchaudio, which pulls
# another torch), built against the torch, numpy and Cython installed above
"$VENV/bin/python" -m pip uninstall -y -q ve-fairseq 2>/dev/null || true
"${pip[@]}" --no-deps --no-build-isolation "$FAIRSEQ"
"${pip[@]}" --no-deps -e .
"$VENV/bin/python" -c "import torch, fairseq, powernorm_fairseq; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$STAMP"
echo "setup.sh: environment ready in $VENV"
