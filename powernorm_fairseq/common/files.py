"""Reading a user's file only when it is one, and writing a file so that it
is either complete or absent."""

import os
import signal
import stat
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path


def check_regular_file(path, what: str = "file"):
    """Refuse, in one line naming ``path``, anything but a regular file (after
    links): a missing path, a directory, a FIFO (whose reader would wait for a
    writer for ever), a device or a socket. Every reader of a user's
    checkpoint, data or record file goes through here."""
    from .errors import InputFileError

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such {what}") from None
    except OSError as exc:
        raise InputFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(mode):
        raise InputFileError(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(mode):
        raise InputFileError(f"{path}: not a regular file (a FIFO, device or socket), not a {what}")


@contextmanager
def atomic_path(path, suffix: str = ""):
    """A temporary path beside ``path``: renamed onto ``path`` when the block
    succeeds, removed when it fails (an interrupt included). ``suffix`` keeps
    an extension that a writer reads the format from."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # the mode open() would give, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


GRACE = 10.0  # seconds a command has to end after SIGTERM before it is ended at once


def end_cleanly_on_sigterm():
    """Let SIGTERM (a scheduler's preemption, a recipe ended by one) end the
    command as Ctrl-C does, through its ``finally`` and ``except`` blocks, so
    that ``atomic_path`` removes its temporary file; Python's default dies at
    once and leaves it. For console scripts only, never on import.

    Python ignores an exception raised in a ``__del__`` or a weakref callback,
    so a signal that lands in one would be lost and the command would go on:
    such a swallowed exit delivers the signal again, and ``GRACE`` seconds
    after the first signal the process ends at once whatever it is doing."""
    def stop(signum, _frame):
        if not stop.timer:
            stop.timer = threading.Timer(GRACE, os._exit, (128 + signum,))
            stop.timer.daemon = True
            stop.timer.start()
        raise SystemExit(128 + signum)

    def unraisable(hook):
        if stop.timer and isinstance(hook.exc_value, SystemExit):  # again once the hook has returned
            again = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
            again.daemon = True
            again.start()
        else:
            default(hook)

    stop.timer, default = None, sys.unraisablehook
    sys.unraisablehook = unraisable
    signal.signal(signal.SIGTERM, stop)


def tail(path, size=4096) -> str:
    """The end of a text file, or "" for anything else (a FIFO is never opened)."""
    try:
        if not Path(path).is_file():
            return ""
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def last_line(path) -> str:
    lines = [x.strip() for x in tail(path).splitlines() if x.strip()]
    return lines[-1] if lines else ""
