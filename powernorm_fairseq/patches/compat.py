"""fairseq 0.12 under NumPy 2.

fairseq's ``TokenBlockDataset`` (the language-modeling task with
``--sample-break-mode eos``) and ``LanguagePairDataset`` ask for
``np.compat.long``, which NumPy 2 removed; with NumPy 1 it was Python's int.
"""

import types

import numpy as np

from .base import installs_once


@installs_once
def numpy_compat_long():
    """Give NumPy 2 the ``np.compat.long`` that fairseq 0.12 uses (a no-op on NumPy 1)."""
    if not hasattr(getattr(np, "compat", None), "long"):
        np.compat = types.SimpleNamespace(long=int)


@installs_once
def bf16_without_tpu():
    """``--bf16`` on a GPU or CPU.

    fairseq 0.12 makes ``--bf16`` imply ``--tpu`` (options.py), and without
    torch_xla the run dies in ``get_tpu_device``. Where torch_xla is absent,
    the training configuration keeps ``--bf16`` and drops the implied
    ``--tpu``: fairseq then casts the model to bfloat16 on the GPU (or CPU)
    and keeps float32 master weights without a loss scaler, its own bf16
    path. The namespace is converted by ``fairseq_cli.train`` after the
    plugin is imported, so the converter is wrapped there too.
    """
    import importlib.util
    import sys

    from fairseq.dataclass import utils as dataclass_utils

    original = dataclass_utils.convert_namespace_to_omegaconf
    if importlib.util.find_spec("torch_xla") is not None:
        return

    def convert(args):
        if getattr(args, "bf16", False) and getattr(args, "tpu", False):
            args.tpu = False
        return original(args)

    dataclass_utils.convert_namespace_to_omegaconf = convert
    train = sys.modules.get("fairseq_cli.train")
    if train is not None and getattr(train, "convert_namespace_to_omegaconf", None) is original:
        train.convert_namespace_to_omegaconf = convert
