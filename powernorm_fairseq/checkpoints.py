"""Loading fairseq checkpoints under torch >= 2.6.

torch.load defaults to ``weights_only=True`` since torch 2.6, and a fairseq
checkpoint holds its training configuration as an ``argparse.Namespace``
(legacy ``args``) next to the weights. Allowing exactly the types fairseq
writes keeps the safe loader on while ``fairseq-generate``,
``fairseq-interactive``, resume and checkpoint averaging work unchanged.
"""

import argparse
import errno
import os
import pickle
import shutil
import zipfile

import torch

from .errors import InputFileError
from .files import atomic_path

SAFE_GLOBALS = [argparse.Namespace]
#: what torch.load raises on a file that is no (complete) checkpoint
UNREADABLE = (pickle.UnpicklingError, RuntimeError, EOFError, IndexError, KeyError, ValueError, TypeError,
              AttributeError, UnicodeDecodeError, zipfile.BadZipFile)


def allow_fairseq_checkpoints():
    torch.serialization.add_safe_globals(SAFE_GLOBALS)


def why_unreadable(path, exc: BaseException) -> str:
    """One line naming ``path`` and what is wrong with it, for an exception of torch.load."""
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in text:
        return (f"{path}: refused: it holds what the weights-only loader does not read (objects other "
                "than tensors and a configuration, i.e. code that loading would run)")
    return f"{path}: not a readable checkpoint (truncated, corrupt or another kind of file)"


def load(path):
    """A checkpoint's state, read on the CPU by torch's weights-only loader
    with fairseq's configuration type allowed: whatever else a pickle holds
    (code) is refused, as is a truncated or foreign file, in one line that
    names the file (:class:`InputFileError`)."""
    allow_fairseq_checkpoints()
    if not os.path.exists(path):
        raise InputFileError(f"{path}: no such checkpoint")
    if os.path.isdir(path):
        raise InputFileError(f"{path}: is a directory, not a checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except UNREADABLE as exc:
        raise InputFileError(why_unreadable(path, exc)) from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise InputFileError(f"{path}: not a fairseq checkpoint (no model state)")
    return state


def model_setting(state, key):
    """A model flag of a checkpoint, or None: fairseq keeps the flags in
    ``cfg.model`` (an ``argparse.Namespace`` or a dict), older versions in ``args``."""
    cfg = (state.get("cfg") or {}).get("model") or state.get("args")
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def name_unreadable_checkpoints():
    """fairseq's checkpoint reader (generate, interactive, eval-lm, resume,
    --restore-file) with the one-line refusals of :func:`load`: a checkpoint
    that holds code, or is truncated or no checkpoint at all, is named in
    one line instead of a traceback that does not name it."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_checkpoint_to_cpu
    if getattr(original, "names_files", False):
        return

    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        try:
            return original(path, arg_overrides, load_on_all_ranks)
        except UNREADABLE as exc:
            if isinstance(exc, InputFileError):
                raise
            raise InputFileError(why_unreadable(path, exc)) from exc

    load_checkpoint_to_cpu.names_files = True
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu


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


def name_failed_saves():
    """A checkpoint fairseq cannot write (a full disk) ends the run in one line
    naming the file, with its partial ``.tmp`` removed, instead of two retries
    and their tracebacks: retrying a full disk only fills it again."""
    from fairseq import checkpoint_utils

    if getattr(checkpoint_utils.torch_persistent_save, "names_files", False):
        return
    persistent_save, retried_save = checkpoint_utils.torch_persistent_save, checkpoint_utils._torch_persistent_save

    def once_if_full(obj, f):
        try:
            return torch.save(obj, f)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
        return retried_save(obj, f)

    def torch_persistent_save(obj, filename, async_write=False):
        try:
            return persistent_save(obj, filename, async_write)
        except OSError as exc:
            if os.path.exists(f"{filename}.tmp"):
                os.unlink(f"{filename}.tmp")
            raise InputFileError(f"{filename}: could not be written ({exc.strerror or exc}); the checkpoints "
                                 "saved before it are complete, and the next run resumes from the newest") from exc

    torch_persistent_save.names_files = True
    checkpoint_utils._torch_persistent_save = once_if_full
    checkpoint_utils.torch_persistent_save = torch_persistent_save
