"""fairseq 0.12 under NumPy 2.

fairseq's ``TokenBlockDataset`` (the language-modeling task with
``--sample-break-mode eos``) and ``LanguagePairDataset`` ask for
``np.compat.long``, which NumPy 2 removed; with NumPy 1 it was Python's int.
"""

import types

import numpy as np


def numpy_compat_long():
    """Give NumPy 2 the ``np.compat.long`` that fairseq 0.12 uses (a no-op on NumPy 1)."""
    try:
        np.compat.long
    except AttributeError:
        np.compat = types.SimpleNamespace(long=int)
