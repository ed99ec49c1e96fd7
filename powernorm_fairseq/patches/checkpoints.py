"""fairseq's checkpoint reading and writing, changed: refusals in one line,
atomic copies, exact resume and failed saves named (see ``patches``)."""

import errno
import functools
import io
import os
import re
import shutil
import sys

import torch

from ..common.checkpoints import UNREADABLE, allow_fairseq_checkpoints, check_finite, of_the_plugin, why_unreadable
from ..common.errors import InputFileError
from ..common.files import atomic_path, check_regular_file
from .base import installs_once


def fairseq_roots():
    """The directories of the installed fairseq and fairseq_cli packages."""
    import fairseq
    import fairseq_cli

    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (fairseq, fairseq_cli))


def file_name(f) -> str:
    """What a refusal names: the path, or the name of an open file."""
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else str(getattr(f, "name", f))


@installs_once
def weights_only_in_fairseq():
    """Every ``torch.load`` that fairseq's own code makes (any file of the
    installed fairseq or fairseq_cli: its checkpoint readers, --ema-seed-model,
    the hub, models' and datasets' loaders, and those added later) reads
    weights only, with fairseq's configuration type allowed. That holds
    whatever the call passes (``weights_only=False``, a ``pickle_module``)
    and under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, which torch honours only
    where a call leaves ``weights_only`` out. A file that holds code is
    refused in one line naming it. Every caller outside fairseq is loaded
    as torch loads it. An in-memory buffer (``io.BytesIO``) that fairseq
    loads is what one distributed worker sends another (``broadcast_object``:
    the checkpoint state the first worker read weights only, fairseq's
    ``DictConfig`` in it, when a run of several workers resumes): unpickled
    as torch's own ``broadcast_object_list`` unpickles, unless the call says
    otherwise. ``tests/test_loaders.py`` lists every loading call in fairseq's
    source and checks it is reached here or out of a user's reach."""
    original = torch.serialization.load
    roots = fairseq_roots()

    @functools.wraps(original)
    def load(f, map_location=None, pickle_module=None, **kwargs):
        if not sys._getframe(1).f_code.co_filename.startswith(roots):
            return original(f, map_location, pickle_module, **kwargs)
        if isinstance(f, io.BytesIO):  # another worker's object, never a user's file
            return original(f, map_location, pickle_module, **{"weights_only": False, **kwargs})
        allow_fairseq_checkpoints()
        try:
            return original(f, map_location, **{**kwargs, "weights_only": True})
        except UNREADABLE as exc:
            if isinstance(exc, InputFileError):
                raise
            raise InputFileError(why_unreadable(file_name(f), exc)) from exc

    torch.load = torch.serialization.load = load


#: what the plugin's models check in a checkpoint of theirs before it is rebuilt, each called with
#: (path, state, overrides): models/settings.py adds its check (the models import the patches, not these them)
REBUILD_CHECKS = []


@installs_once
def name_unreadable_checkpoints():
    """fairseq's checkpoint reader (generate, interactive, validate, eval-lm,
    resume, --restore-file, --finetune-from-model, from_pretrained,
    load_model_ensemble_and_task), read weights only by
    :func:`weights_only_in_fairseq`: a missing checkpoint is named in one
    line, and so is one whose model entries hold NaN or inf, for the plugin's
    models, naming the tensor, unless ``POWERNORM_ALLOW_NONFINITE=1`` (a
    post-mortem); a stock model's loads as fairseq loads it (fairseq's own
    test_lightconv_lm saves one). ``--ema-seed-model`` given a checkpoint
    without EMA weights is named in one line too."""
    from fairseq import checkpoint_utils

    original, ema = checkpoint_utils.load_checkpoint_to_cpu, checkpoint_utils.load_ema_from_checkpoint

    def read(path, arg_overrides, load_on_all_ranks):
        try:
            return original(path, arg_overrides, load_on_all_ranks)
        except UNREADABLE as exc:
            if isinstance(exc, InputFileError):
                raise
            raise InputFileError(why_unreadable(path, exc)) from exc

    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        if "://" not in str(path):
            check_regular_file(path, "checkpoint")
        state = read(path, None, load_on_all_ranks)
        if not of_the_plugin(state):  # a stock model's loads as fairseq loads it
            return read(path, arg_overrides, load_on_all_ranks) if arg_overrides else state
        check_finite(path, state, os.environ.get("POWERNORM_ALLOW_NONFINITE", "0") == "1")
        for check in REBUILD_CHECKS:  # before the overrides change the checkpoint's settings
            check(path, state, arg_overrides)
        if arg_overrides:  # as fairseq applies them
            if state.get("args") is not None:
                for name, value in arg_overrides.items():
                    setattr(state["args"], name, value)
            if state.get("cfg") is not None:
                checkpoint_utils.overwrite_args_by_name(state["cfg"], arg_overrides)
        return state

    def load_ema_from_checkpoint(fpath):
        try:
            return ema(fpath)
        except (KeyError, TypeError) as exc:
            raise InputFileError(f"--ema-seed-model {fpath}: holds no EMA weights (extra_state.ema); give a "
                                 "checkpoint saved with --store-ema") from exc

    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    checkpoint_utils.load_ema_from_checkpoint = load_ema_from_checkpoint


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


def interrupt_in(exc):
    """The Ctrl-C or SIGTERM (``end_cleanly_on_sigterm``'s SystemExit) that
    torch's zip writer turned into a RuntimeError when it landed in a write
    to a Python file, as fairseq's saves are; or None."""
    cause = exc.__context__
    while cause is not None and isinstance(cause, Exception):
        cause = cause.__context__
    return cause


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
        except RuntimeError as exc:
            stop = interrupt_in(exc)
            if stop is not None:  # nor an interrupt, which is no write failure
                raise stop from None
            raise
        return retried_save(obj, f)

    def torch_persistent_save(obj, filename, async_write=False):
        try:
            return persistent_save(obj, filename, async_write)
        except (KeyboardInterrupt, SystemExit):
            if os.path.exists(f"{filename}.tmp"):
                os.unlink(f"{filename}.tmp")
            raise
        except (OSError, RuntimeError) as exc:
            why = write_failure(exc, filename)
            if why is None:
                raise
            if os.path.exists(f"{filename}.tmp"):
                os.unlink(f"{filename}.tmp")
            raise InputFileError(f"{filename}: could not be written ({why}); {SAVED_BEFORE}") from exc

    checkpoint_utils._torch_persistent_save = once_if_full
    checkpoint_utils.torch_persistent_save = torch_persistent_save
