#!/usr/bin/env bash
# A table of the PowerNorm paper with one command: every row x seed of a config
# family trained with train.sh and scored with evaluate.sh, here or on a SLURM
# cluster, then OUT/table.md and table.json. docs/reproduce.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT, whole: a SIGTERM ends every run too
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active
exec python -m powernorm_fairseq.cli.reproduce "$@"
