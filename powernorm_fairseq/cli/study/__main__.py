"""``python -m powernorm_fairseq.cli.study``: what scripts/norm-study.sh runs."""

from .command import main

main()
