"""fairseq's checkpoint reading and writing, changed: refusals in one line,
atomic copies, exact resume and failed saves named (see ``patches``)."""

import errno
import os
import re
import shutil

import torch

from ..common.checkpoints import UNREADABLE, check_finite, of_the_plugin, weights_only_loads, why_unreadable
from ..common.errors import InputFileError
from ..common.files import atomic_path
from .base import installs_once


@installs_once
def name_unreadable_checkpoints():
    """fairseq's checkpoint reader (generate, interactive, validate, eval-lm,
    resume, --restore-file, --finetune-from-model, from_pretrained,
    load_model_ensemble_and_task) reads weights only, whatever the
    environment (``common.checkpoints.weights_only_loads``), with the
    one-line refusals of ``common.checkpoints.load``: a checkpoint that holds
    code, or is truncated or no checkpoint at all, is named in one line
    instead of a traceback that does not name it. A checkpoint of the
    plugin's models whose model entries hold NaN or inf is refused, naming the
    tensor, unless ``POWERNORM_ALLOW_NONFINITE=1`` (a post-mortem); a stock
    model's loads as fairseq loads it (fairseq's own test_lightconv_lm saves
    one)."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_checkpoint_to_cpu

    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        if "://" not in str(path) and not os.path.exists(path):
            raise InputFileError(f"{path}: no such checkpoint")
        try:
            with weights_only_loads():
                state = original(path, arg_overrides, load_on_all_ranks)
        except UNREADABLE as exc:
            if isinstance(exc, InputFileError):
                raise
            raise InputFileError(why_unreadable(path, exc)) from exc
        if of_the_plugin(state):  # a stock model's loads as fairseq loads it
            check_finite(path, state, os.environ.get("POWERNORM_ALLOW_NONFINITE", "0") == "1")
        return state

    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu


@installs_once
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

    original = PathManager.copy

    def copy(src_path, dst_path, overwrite=False):
        if "://" in str(src_path) or "://" in str(dst_path):
            return original(src_path, dst_path, overwrite)
        if os.path.exists(dst_path) and not overwrite:
            return False
        try:
            with atomic_path(dst_path) as tmp:  # removed again when the copy fails
                shutil.copyfile(src_path, tmp)
        except OSError as exc:
            raise InputFileError(f"{dst_path}: could not be written ({exc.strerror or exc}); {SAVED_BEFORE}") from exc
        return True

    PathManager.copy = staticmethod(copy)


@installs_once
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

    FairseqTask.get_batch_iterator = get_batch_iterator


SAVED_BEFORE = "the checkpoints saved before it are complete, and the next run resumes from the newest"


def write_failure(exc: BaseException, filename):
    """Why ``filename`` could not be written, when ``exc`` says that it could
    not (a full disk, a quota, a read-only file system), or None. torch.save
    reports a full disk as a RuntimeError of its zip writer, not an OSError."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, RuntimeError) and re.search(r"unexpected pos|failed writing|write failed", str(exc)):
        try:
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(filename))).free
        except OSError:
            free = None
        return "No space left on device" if free is not None and free < 2**20 else "the write failed"
    return None


@installs_once
def name_failed_saves():
    """A checkpoint fairseq cannot write (a full disk) ends the run in one line
    naming the file, with its partial ``.tmp`` removed, instead of two retries
    and their tracebacks: retrying a full disk only fills it again."""
    from fairseq import checkpoint_utils

    persistent_save, retried_save = checkpoint_utils.torch_persistent_save, checkpoint_utils._torch_persistent_save

    def once_if_full(obj, f):
        try:
            return torch.save(obj, f)
        except OSError as exc:  # a RuntimeError (torch's zip writer on a full disk) is not retried either
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
        return retried_save(obj, f)

    def torch_persistent_save(obj, filename, async_write=False):
        try:
            return persistent_save(obj, filename, async_write)
        except (OSError, RuntimeError) as exc:
            why = write_failure(exc, filename)
            if why is None:
                raise
            if os.path.exists(f"{filename}.tmp"):
                os.unlink(f"{filename}.tmp")
            raise InputFileError(f"{filename}: could not be written ({why}); {SAVED_BEFORE}") from exc

    checkpoint_utils._torch_persistent_save = once_if_full
    checkpoint_utils.torch_persistent_save = torch_persistent_save
