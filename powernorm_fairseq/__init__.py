"""powernorm-fairseq: Power Normalization and its neighbours as a fairseq plugin.

Pass ``--user-dir`` pointing at this package to any fairseq command: fairseq
imports it, and it registers the ``powernorm_transformer`` and
``powernorm_transformer_lm`` models and their architectures. Imported
without fairseq (the norm library ``powernorm_fairseq.norms``, the console
tools), it loads nothing of fairseq and changes nothing; ``patches`` lists
what the plugin changes in fairseq, and when.
"""

import sys

__version__ = "0.1.0"

if "fairseq" in sys.modules:  # imported by fairseq (--user-dir): register the models
    from . import models  # noqa: F401
