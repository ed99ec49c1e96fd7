"""One training per ``--save-dir``, started clean and resumed from what is complete.

* **Lock.** A training holds an exclusive lock on its save directory for its
  whole life (``flock`` on ``.powernorm-train.lock``, which names the holder's
  pid). A second training on the same directory stops in one line that names
  the directory and that process, instead of both writing the same files. The
  kernel drops the lock when its holder dies, so a lock left by a killed run
  never blocks the next one.
* **Debris.** A kill or a full disk can leave partial files: fairseq's
  ``checkpoint*.pt.tmp`` and the hidden ``.checkpoint*.pt.*`` of this plugin's
  atomic copies. With the lock held (no other training writes there), they
  are removed at start, and the log says which.
* **Resume.** A run resumes from the newest complete checkpoint in the
  directory by its saved update count, not from ``checkpoint_last.pt`` alone
  (unless ``checkpoint_last.pt`` is complete and newer on disk than every
  checkpoint with more updates: fairseq's rollback, an earlier checkpoint
  copied over it, which a kill cannot produce; then the run goes on from it
  and the checkpoints with more updates are renamed ``*.abandoned-<time>``)
  (a kill or a full disk during the copies that follow a save leaves
  ``checkpoint_last.pt`` older than the file just saved). Completeness is
  judged per format: a zip checkpoint by its central directory and pickle, a
  legacy (non-zip) one by loading it. A ``checkpoint_last.pt`` that is not
  complete is never overwritten: it is renamed aside,
  ``checkpoint_last.pt.<why>-<time>``. The log says which file the run
  resumed from and why. A run resumed at ``--max-update`` ends there
  (fairseq would train one update past it).
"""

import atexit
import errno
import logging
import os
import re
import stat
import time
import zipfile
from pathlib import Path

from ..common.errors import InputFileError
from ..common.files import check_regular_file
from .base import installs_once

logger = logging.getLogger(__name__)

LOCK_NAME = ".powernorm-train.lock"
DEBRIS = re.compile(r"checkpoint.*\.pt\.tmp|\.checkpoint.*\.pt\..+")
CHECKPOINT = re.compile(r"checkpoint(\d+|_\d+_\d+|_best|_last)\.pt")
_held = {}  # realpath of a save directory -> the open file whose lock this process holds


def hold(save_dir) -> None:
    """Take the save directory's lock for the rest of this process's life."""
    key = os.path.realpath(save_dir)
    if key in _held:
        return
    path = os.path.join(save_dir, LOCK_NAME)
    try:  # never through a link: a link there would have the lock overwrite the file it points to
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputFileError(f"--save-dir {save_dir}: {LOCK_NAME} is a symbolic link; the lock is written "
                                 "to a regular file only: remove the link") from None
        if exc.errno == errno.EISDIR:
            raise InputFileError(f"--save-dir {save_dir}: {LOCK_NAME} is not a regular file; remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputFileError(f"--save-dir {save_dir}: {LOCK_NAME} is not a regular file; remove it")
    from filelock import lock_descriptor

    lock = os.fdopen(fd, "a+")
    try:
        held = lock_descriptor(fd, blocking=False)
    except OSError:
        lock.close()
        raise
    if not held:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise InputFileError(
            f"--save-dir {save_dir}: in use by another training (pid {holder}); "
            "wait for it to end, or pass another --save-dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _held[key] = lock


def clean_debris(save_dir) -> list:
    """Remove the partial files an interrupted run left; their names."""
    removed = []
    for path in sorted(Path(save_dir).iterdir()):
        if path.is_file() and DEBRIS.fullmatch(path.name):
            path.unlink()
            removed.append(path.name)
    if removed:
        logger.info("removed %d partial file(s) an interrupted run left in %s: %s",
                    len(removed), save_dir, ", ".join(removed))
    return removed


def saved_updates(path: Path):
    """``(updates, None)`` of a complete checkpoint, or ``(None, why)``: why
    it is not one (``incomplete``: truncated or not a checkpoint; ``refused``:
    it holds what the weights-only loader does not read)."""
    import torch

    from ..common import checkpoints
    from ..common.checkpoints import UNREADABLE, allow_fairseq_checkpoints, refused

    allow_fairseq_checkpoints()
    try:
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
        if zipped:  # the zip format: a truncated file lacks its central directory
            with zipfile.ZipFile(path) as archive:
                if not any(name.endswith("data.pkl") for name in archive.namelist()):
                    return None, "incomplete"
        # the zip format's tensors are mapped, not read; the legacy format is judged by a whole load
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except OSError:
        return None, "unreadable"
    except UNREADABLE as exc:  # zipfile.BadZipFile among them
        return None, "refused" if refused(exc) else "incomplete"
    updates = checkpoints.updates(state) if isinstance(state, dict) else -1
    return (updates, None) if updates >= 0 else (None, "incomplete")


def newest_complete(save_dir, set_aside: bool):
    """The checkpoint to resume from: the complete one with the most saved
    updates, with a sentence saying why, or
    (None, why). With ``set_aside``, a ``checkpoint_last.pt`` that is not
    complete is renamed aside, never overwritten (by the master worker only)."""
    last = Path(save_dir) / "checkpoint_last.pt"
    found, said = {}, ""
    for path in Path(save_dir).glob("checkpoint*.pt"):
        if not CHECKPOINT.fullmatch(path.name):
            continue
        check_regular_file(path, "checkpoint")  # a FIFO would hold the run for ever; not ours to move aside
        updates, why = saved_updates(path)
        if updates is not None:
            found[path] = updates
        elif path == last:
            said = f"checkpoint_last.pt is {why}"
            if set_aside:
                aside = last.with_name(f"{last.name}.{why}-{time.strftime('%Y%m%dT%H%M%S')}")
                os.replace(last, aside)
                said += f" (kept as {aside.name})"
    if not found:
        return None, said
    # on a tie: checkpoint_last.pt, then a numbered checkpoint, then checkpoint_best.pt, by name
    newest = max(found, key=lambda p: (found[p], p == last, p.name != "checkpoint_best.pt", p.name))
    if last in found and found[last] < found[newest] and last.stat().st_mtime > newest.stat().st_mtime:
        # newer on disk than every checkpoint with more updates: put there on purpose (fairseq's
        # rollback: an earlier checkpoint copied over it); a kill leaves it older, never newer
        later = sorted(p for p in found if found[p] > found[last])
        why = (f"checkpoint_last.pt ({found[last]} updates) is newer on disk than {newest.name} "
               f"({found[newest]} updates): it was put there on purpose, so the run goes on from it")
        if set_aside:  # the abandoned branch's states: never chosen again, never deleted
            stamp = time.strftime("%Y%m%dT%H%M%S")
            for path in later:
                os.replace(path, path.with_name(f"{path.name}.abandoned-{stamp}"))
            why += f"; the {len(later)} checkpoint(s) with more updates are kept as *.abandoned-{stamp}"
        return last, why
    if newest == last:
        return last, f"checkpoint_last.pt ({found[last]} updates) is the newest complete checkpoint"
    if not said:
        said = (f"checkpoint_last.pt has {found[last]} updates" if last in found
                else "checkpoint_last.pt is missing")
    return newest, f"{newest.name} ({found[newest]} updates) is the newest complete checkpoint; {said}"


@installs_once
def guard_training_runs():
    """Install the lock, the clean start and the recovery into fairseq-train
    (see the module doc), where the trainer first reads the save directory:
    after the flags, the data and the model were found good, so a run that
    stops on those writes nothing."""
    import torch.distributed as dist
    from fairseq import checkpoint_utils

    load, verify = checkpoint_utils.load_checkpoint, checkpoint_utils.verify_checkpoint_directory

    def verify_checkpoint_directory(save_dir):
        created = not os.path.exists(save_dir)
        if os.path.exists(save_dir) and not os.path.isdir(save_dir):
            raise InputFileError(f"--save-dir {save_dir}: is a file, not a directory; pass another --save-dir")
        try:
            verify(save_dir)  # fairseq creates it, and writes a file to try it, before it reads the data
        except OSError as exc:
            raise InputFileError(f"--save-dir {save_dir}: cannot be written ({exc.strerror or exc}); "
                                 "pass a writable --save-dir") from None
        if created:  # a run that stops before writing anything leaves no empty directory behind
            atexit.register(_remove_if_empty, save_dir)

    def load_checkpoint(cfg, trainer, **passthrough_args):
        if not _runs_the_plugins_model(trainer):  # a stock model trains as fairseq trains it
            return load(cfg, trainer, **passthrough_args)
        master = trainer.is_data_parallel_master
        if cfg.restore_file != "checkpoint_last.pt":  # fairseq would train from scratch, and say nothing
            _check_given(cfg.restore_file, "--restore-file")
        finetune = getattr(cfg, "finetune_from_model", None)
        if finetune:  # fairseq raises a traceback
            _check_given(finetune, "--finetune-from-model")
        resuming = cfg.restore_file == "checkpoint_last.pt" and os.path.isdir(cfg.save_dir)
        chosen, why = None, ""
        if master and os.path.isdir(cfg.save_dir):
            hold(cfg.save_dir)
            clean_debris(cfg.save_dir)
            if resuming:
                chosen, why = newest_complete(cfg.save_dir, set_aside=True)
                if chosen is not None:
                    logger.info("resuming from %s: %s", chosen, why)
                elif why:
                    logger.warning("%s, and no complete checkpoint is left: training from the start", why)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every worker sees the directory as the master left it
            if resuming and not master:
                chosen, _ = newest_complete(cfg.save_dir, set_aside=False)
        if chosen is None or chosen.name == "checkpoint_last.pt":
            loaded = load(cfg, trainer, **passthrough_args)
        else:  # fairseq reads --restore-file as given when it is not the default
            with _writable(cfg):
                cfg.restore_file = str(chosen)
            try:
                loaded = load(cfg, trainer, **passthrough_args)
            finally:
                with _writable(cfg):
                    cfg.restore_file = "checkpoint_last.pt"
        done, limit = trainer.get_num_updates(), trainer.cfg.optimization.max_update
        if 0 < limit <= done:  # fairseq would train one more update before it checks
            logger.info("the checkpoint has %d updates, --max-update is %d: nothing left to train", done, limit)
            raise SystemExit(0)
        return loaded

    checkpoint_utils.load_checkpoint = load_checkpoint
    checkpoint_utils.verify_checkpoint_directory = verify_checkpoint_directory


def _check_given(path, flag):
    try:
        check_regular_file(path, "checkpoint")
    except InputFileError as err:
        raise InputFileError(f"{flag} {err}") from None


def _runs_the_plugins_model(trainer) -> bool:
    """Whether the trainer's model is one of the plugin's, or derives from one
    (read from its classes: the models import this package, not it them)."""
    model = getattr(trainer, "model", None)
    classes = type(getattr(model, "module", model)).__mro__
    return any(c.__module__.startswith("powernorm_fairseq.models.") for c in classes)


def _writable(cfg):
    from contextlib import nullcontext

    from omegaconf import OmegaConf, open_dict

    return open_dict(cfg) if OmegaConf.is_config(cfg) else nullcontext()


def _remove_if_empty(directory):
    """At exit, the save directory this run made, if it holds nothing but its lock
    (a run refused after taking it: a bad --restore-file, other norms)."""
    try:
        if os.listdir(directory) == [LOCK_NAME]:
            os.unlink(os.path.join(directory, LOCK_NAME))
        os.rmdir(directory)
    except OSError:  # not empty (the run wrote something), or gone
        pass
