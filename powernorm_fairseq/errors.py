"""Bad flags end a command with one line naming the flag, not a traceback."""

import os
import sys


class PowerNormConfigError(ValueError):
    """A flag value or combination this plugin cannot honour."""


def _excepthook(kind, value, traceback, _previous=sys.excepthook):
    if isinstance(value, PowerNormConfigError):
        print(f"{os.path.basename(sys.argv[0])}: error: {value}", file=sys.stderr)
    else:
        _previous(kind, value, traceback)


def install_excepthook():
    """Print :class:`PowerNormConfigError` as one line; leave the rest alone."""
    if sys.excepthook is not _excepthook:
        sys.excepthook = _excepthook
