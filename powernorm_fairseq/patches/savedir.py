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
* **Resume.** When ``checkpoint_last.pt`` is missing or unreadable but the
  directory holds complete checkpoints, the newest readable one becomes
  ``checkpoint_last.pt`` again (an atomic copy), so the run resumes from it,
  and the log says which. A run resumed at ``--max-update`` ends there (fairseq
  would train one update past it).
"""

import atexit
import errno
import fcntl
import logging
import os
import re
import shutil
import zipfile
from pathlib import Path

from ..common.errors import InputFileError
from ..common.files import atomic_path
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
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            lock.close()
            raise
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


def readable(path: Path) -> bool:
    """Whether ``path`` looks like a complete checkpoint: torch's zip format
    ends with a central directory that a truncated file lacks."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def recover_last(save_dir) -> str:
    """Make ``checkpoint_last.pt`` the newest complete checkpoint when it is
    missing or unreadable; the name of the one it was copied from, or ''."""
    last = Path(save_dir) / "checkpoint_last.pt"
    if last.exists() and readable(last):
        return ""
    candidates = [p for p in Path(save_dir).glob("checkpoint*.pt")
                  if CHECKPOINT.fullmatch(p.name) and p.name != last.name]
    for path in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        if readable(path):
            with atomic_path(last) as tmp:
                shutil.copyfile(path, tmp)
            logger.warning("%s is %s: resuming from %s, the newest complete checkpoint",
                           last, "unreadable" if last.exists() else "missing", path.name)
            return path.name
    return ""


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
        verify(save_dir)  # fairseq creates it before it reads the data
        if created:  # a run that stops before writing anything leaves no empty directory behind
            atexit.register(_remove_if_empty, save_dir)

    def load_checkpoint(cfg, trainer, **passthrough_args):
        if trainer.is_data_parallel_master and os.path.isdir(cfg.save_dir):
            hold(cfg.save_dir)
            clean_debris(cfg.save_dir)
            if cfg.restore_file == "checkpoint_last.pt":
                recover_last(cfg.save_dir)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every worker sees the recovered checkpoint_last.pt
        loaded = load(cfg, trainer, **passthrough_args)
        done, limit = trainer.get_num_updates(), trainer.cfg.optimization.max_update
        if 0 < limit <= done:  # fairseq would train one more update before it checks
            logger.info("the checkpoint has %d updates, --max-update is %d: nothing left to train", done, limit)
            raise SystemExit(0)
        return loaded

    checkpoint_utils.load_checkpoint = load_checkpoint
    checkpoint_utils.verify_checkpoint_directory = verify_checkpoint_directory


def _remove_if_empty(directory):
    try:
        os.rmdir(directory)
    except OSError:  # not empty (the run wrote something), or gone
        pass
