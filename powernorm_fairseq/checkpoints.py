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

import torch

from .files import atomic_path

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
        with atomic_path(dst_path) as tmp:
            shutil.copyfile(src_path, tmp)
        return True

    copy.atomic = True
    PathManager.copy = staticmethod(copy)


def resume_with_the_same_batches():
    """Make a resumed run iterate over the same batches as an uninterrupted one.

    fairseq builds the training batches once, when the iterator is created,
    from a permutation seeded with ``seed + epoch`` (``FairseqTask.get_batch_iterator``),
    and reuses them for every later epoch, shuffling their order with
    ``seed + epoch`` each epoch. An uninterrupted run creates the iterator at
    epoch 1; a run resumed in epoch E > 1 creates it at E and so trains on
    differently composed batches from the first resumed update on. Here a
    reusable training iterator created at epoch E is built as at epoch 1 and
    then set to epoch E (the per-epoch order still follows ``seed + E``).
    Iterators that fairseq rebuilds every epoch anyway are left alone.
    """
    import inspect

    from fairseq.tasks import FairseqTask

    if getattr(FairseqTask.get_batch_iterator, "same_batches", False):
        return
    original = FairseqTask.get_batch_iterator
    signature = inspect.signature(original)

    def get_batch_iterator(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        epoch, dataset = a["epoch"], a["dataset"]
        reusable = (not a["disable_iterator_cache"] and not a["update_epoch_batch_itr"]
                    and not getattr(self.cfg, "rebuild_batches", False)
                    and self.can_reuse_epoch_itr(dataset) and dataset not in self.dataset_to_epoch_iter)
        if epoch <= 1 or not reusable:
            return original(*bound.args, **bound.kwargs)
        a["epoch"] = 1
        itr = original(*bound.args, **bound.kwargs)
        itr.epoch = epoch
        dataset.set_epoch(epoch)
        return itr

    get_batch_iterator.same_batches = True
    FairseqTask.get_batch_iterator = get_batch_iterator
