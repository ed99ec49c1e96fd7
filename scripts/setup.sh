#!/usr/bin/env bash
# Create (or bring up to date) the virtual environment .venv in the checkout.
# Idempotent: a second run with nothing changed installs nothing.
set -euo pipefail

usage() {
  cat <<USAGE
usage: scripts/setup.sh [--python PYTHON]

Creates .venv in the repository root with torch 2.13.0, the maintained fork
of fairseq 0.12 (fairseq-fixed 0.12.3.1, built here: about 3 minutes the first
time) and this plugin in editable mode.
  --python PYTHON      interpreter for the venv: Python 3.11, 3.12 or 3.13
                       (default: python3)
  --torch-index URL    the package index torch comes from (default: pip's own).
                       PyPI's torch for Linux x86_64 is a CUDA build; for the CPU
                       build, or another CUDA version, name PyTorch's index, e.g.
                       https://download.pytorch.org/whl/cpu or .../whl/cu128
USAGE
}

PYTHON=python3 TORCH_INDEX=""
SUPPORTED="3.11 3.12 3.13"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --torch-index) TORCH_INDEX="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "setup.sh: error: unknown option '$1'$(python3 -c 'import difflib, sys
close = difflib.get_close_matches(sys.argv[1], sys.argv[2:], 1, 0.75)
print(f"; did you mean {close[0]}?" if close else "", end="")' "$1" --python --torch-index --help 2>/dev/null)" \
         "(see --help)" >&2; exit 2 ;;
  esac
done

TORCH=torch==2.13.0
FAIRSEQ=fairseq-fixed==0.12.3.1
TRITON=triton==3.9.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.powernorm-setup"

cd "$ROOT"
fail() { echo "setup.sh: error: $*" >&2; exit 2; }
have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
  || fail "--python: cannot run '$PYTHON'"
[[ " $SUPPORTED " == *" $have "* ]] \
  || fail "Python $have ($PYTHON) is not supported: use 3.11, 3.12 or 3.13 (--python PYTHON)"
if [[ -x "$VENV/bin/python" ]]; then
  venv_has=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [[ "$venv_has" == "$have" ]] \
    || fail ".venv has Python $venv_has, not $have ($PYTHON): remove .venv to rebuild it with $have"
fi
want="$(cat scripts/setup.sh requirements.txt requirements-dev.txt pyproject.toml setup.py powernorm_fairseq/norms/kernels/csrc/* | sha256sum | cut -d' ' -f1) $have $TORCH_INDEX"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0  # up to date
fi

# stage WHAT CMD...: say what the set-up does now and how long it has run, and again whenever
# POWERNORM_HEARTBEAT seconds (55: a line a minute at least) pass without a line while CMD runs; CMD's status
START=$SECONDS HEARTBEAT=${POWERNORM_HEARTBEAT:-55}
HEARTBEAT=${HEARTBEAT%.*} && (( HEARTBEAT >= 1 )) || HEARTBEAT=1
elapsed() { printf '%d:%02d' $(( (SECONDS - START) / 60 )) $(( (SECONDS - START) % 60 )); }
stage() {
  local what=$1 pid said=$SECONDS
  shift
  echo "setup.sh: $what ($(elapsed))"
  "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 0.2
    if (( SECONDS - said >= HEARTBEAT )); then
      echo "setup.sh: still $what ($(elapsed))"
      said=$SECONDS
    fi
  done
  wait "$pid"
}

[[ -x "$VENV/bin/python" ]] || stage "creating $VENV" "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# torch first, pinned: anything unpinned later must find it satisfied
stage "installing $TORCH (the largest download)" "${pip[@]}" "$TORCH" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
stage "installing requirements-dev.txt (the runtime's, the tests' and the linter's)" "${pip[@]}" -r requirements-dev.txt
# triton runs the GPU kernels (powernorm_fairseq/norms/kernels/gpu.py). A CUDA
# torch brings the triton it was built with, which must stay; a CPU torch has
# none, and then this one runs the kernels in Triton's interpreter for the
# tests and compiles them for a GPU.
"$VENV/bin/python" -c "import triton" 2>/dev/null || stage "installing $TRITON" "${pip[@]}" "$TRITON"
# fairseq without its declared deps (they include torchaudio, which pulls
# another torch), built against the torch, numpy and Cython installed above
"$VENV/bin/python" -m pip uninstall -y -q ve-fairseq 2>/dev/null || true
stage "building $FAIRSEQ against that torch" "${pip[@]}" --no-deps --no-build-isolation "$FAIRSEQ"
# the plugin, editable; its build compiles the CPU kernels (setup.py) against the torch above
stage "installing the plugin and compiling its CPU kernels" "${pip[@]}" --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, fairseq, powernorm_fairseq; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$STAMP"
built=$("$VENV/bin/python" -c "import torch; print(torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU only')")
echo "setup.sh: environment ready in $VENV (Python $have, torch $built), in $(elapsed)"
if command -v nvidia-smi >/dev/null && [[ "$built" == *"CPU only"* ]]; then
  echo "setup.sh: this machine has an NVIDIA GPU but the torch installed is CPU only; for a CUDA build run" \
       "'rm -r .venv' and 'bash scripts/setup.sh --torch-index https://download.pytorch.org/whl/cu128'" >&2
fi
