"""Loading fairseq checkpoints under torch >= 2.6.

torch.load defaults to ``weights_only=True`` since torch 2.6, and a fairseq
checkpoint holds its training configuration as an ``argparse.Namespace``
(legacy ``args``) next to the weights. Allowing exactly the types fairseq
writes keeps the safe loader on while ``fairseq-generate``,
``fairseq-interactive``, resume and checkpoint averaging work unchanged.
"""

import argparse
import os
import shutil
import tempfile

import torch

SAFE_GLOBALS = [argparse.Namespace]


def allow_fairseq_checkpoints():
    torch.serialization.add_safe_globals(SAFE_GLOBALS)


def atomic_checkpoint_copies():
    """Make fairseq's checkpoint copies atomic.

    fairseq writes the first checkpoint of a save to a temporary file and
    renames it, then *copies* it to the others (checkpoint_best.pt,
    checkpoint_last.pt); an interrupt during a copy would leave a truncated
    checkpoint_last.pt that the next run tries to resume from. Local copies
    go through a temporary file and a rename here; other paths are left to
    fairseq's PathManager.
    """
    from fairseq.file_io import PathManager

    if getattr(PathManager.copy, "atomic", False):
        return
    original = PathManager.copy

    def copy(src_path, dst_path, overwrite=False):
        if "://" in str(src_path) or "://" in str(dst_path):
            return original(src_path, dst_path, overwrite)
        if os.path.exists(dst_path) and not overwrite:
            return False
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dst_path)),
                                   prefix=f".{os.path.basename(dst_path)}.")
        os.close(fd)
        try:
            shutil.copyfile(src_path, tmp)
            os.replace(tmp, dst_path)
        except BaseException:
            os.unlink(tmp)
            raise
        return True

    copy.atomic = True
    PathManager.copy = staticmethod(copy)
