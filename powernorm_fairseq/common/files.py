"""Writing a file so that it is either complete or absent."""

import os
import signal
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


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


def end_cleanly_on_sigterm():
    """Let SIGTERM (a scheduler's preemption, a recipe ended by one) end the
    command as Ctrl-C does, through its ``finally`` and ``except`` blocks, so
    that ``atomic_path`` removes its temporary file; Python's default dies at
    once and leaves it. For console scripts only, never on import."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
