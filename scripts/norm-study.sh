#!/usr/bin/env bash
# The normalization study: one command for a grid of training runs over
# learning rate x depth x width x norm x init x seed, resumable, with its
# convergence tables (study.md, study.json) and figures. docs/study.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT, whole: a SIGTERM ends every cell too
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active
exec python -m powernorm_fairseq.cli.study "$@"
