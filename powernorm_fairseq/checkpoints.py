"""Loading fairseq checkpoints under torch >= 2.6.

torch.load defaults to ``weights_only=True`` since torch 2.6, and a fairseq
checkpoint holds its training configuration as an ``argparse.Namespace``
(legacy ``args``) next to the weights. Allowing exactly the types fairseq
writes keeps the safe loader on while ``fairseq-generate``,
``fairseq-interactive``, resume and checkpoint averaging work unchanged.
"""

import argparse

import torch

SAFE_GLOBALS = [argparse.Namespace]


def allow_fairseq_checkpoints():
    torch.serialization.add_safe_globals(SAFE_GLOBALS)
