"""Bad flags end a command with one line naming the flag, not a traceback."""

import os
import sys


class PowerNormConfigError(ValueError):
    """A flag value or combination this plugin cannot honour."""


def _config_error(exc):
    """The PowerNormConfigError behind ``exc``, also when fairseq re-raised it
    as another exception (as it does when a checkpoint fails to load)."""
    while exc is not None:
        if isinstance(exc, PowerNormConfigError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _excepthook(kind, value, traceback, _previous=sys.excepthook):
    error = _config_error(value)
    if error is not None:
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
    else:
        _previous(kind, value, traceback)


def install_excepthook():
    """Print :class:`PowerNormConfigError` as one line; leave the rest alone."""
    if sys.excepthook is not _excepthook:
        sys.excepthook = _excepthook
