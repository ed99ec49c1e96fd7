"""``python -m powernorm_fairseq.cli.study``: what scripts/norm-study.sh runs."""

import sys

from .command import main

sys.argv[0] = "norm-study.sh"  # what an error line names (the plugin's hook reads it), not __main__.py
main()
