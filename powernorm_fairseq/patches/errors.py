"""Bad input ends a command with one line naming the flag or file, not a traceback."""

import os
import re
import sys

from ..common.errors import PowerNormConfigError
from .base import installs_once


def _config_error(exc):
    """The PowerNormConfigError behind ``exc``, also when fairseq re-raised it
    as another exception (as it does when a checkpoint fails to load)."""
    while exc is not None:
        if isinstance(exc, PowerNormConfigError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _input_error(exc):
    """A message for mistakes in what a user gave a command, or None.

    This plugin's own errors; with :func:`name_fairseq_input_errors` also a
    missing file (a data directory without its dictionary, a wrong --path),
    and fairseq's refusal of a sentence longer than
    --max-source/target-positions, which already names the flag that skips
    such sentences.
    """
    error = _config_error(exc)
    if error is not None:
        return str(error)
    missing = re.match(r"Model file not found: (.+)", str(exc)) if isinstance(exc, OSError) else None
    if missing:  # generate, interactive, eval-lm: before any model code runs
        return f"--path {missing[1]}: no such checkpoint"
    if not name_fairseq_input_errors.installed:
        return None
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"no such file: {exc.filename}"
    if any(fragment in str(exc) for fragment in FAIRSEQ_INPUT_ERRORS):
        return " ".join(str(exc).split())
    return None


#: fairseq's own messages about its input, printed as one line
FAIRSEQ_INPUT_ERRORS = (
    "skip this example with --skip-invalid-size-inputs-valid-test",  # a sentence over --max-*-positions
    "Could not infer language pair",  # a data directory without dict.*.txt
)


def _excepthook(kind, value, traceback, _previous=sys.excepthook):
    prog = os.path.basename(sys.argv[0])
    if issubclass(kind, KeyboardInterrupt):
        print(f"{prog}: interrupted; checkpoints saved before the interrupt are complete "
              "(written to a temporary file and renamed)", file=sys.stderr)
        return
    message = _input_error(value)
    if message is not None:
        print(f"{prog}: error: {message}", file=sys.stderr)
    else:
        _previous(kind, value, traceback)


def _one_line_usage_error(self, message):
    """argparse's error without the usage block before it (fairseq's is about
    190 lines, which bury the one line that says what is wrong); ``--help``
    still prints the usage."""
    if message.startswith("unrecognized arguments:"):
        message += _unrecognized_hint(self, message.split(":", 1)[1].split())
    self.exit(2, f"{self.prog}: error: {message}\n")


def _unrecognized_hint(parser, words):
    """Why flags were not recognised: a plugin flag given with a stock
    architecture, or a misspelling of a flag the parser has."""
    import difflib

    from ..models.options import norm_fields

    flags = [w.split("=")[0] for w in words if w.startswith("--")]
    ours = {"--" + f.name.replace("_", "-") for f in norm_fields()}
    plugin = [f for f in flags if f in ours or f.replace("--no-", "--", 1) in ours]
    if plugin:
        from fairseq.models import ARCH_MODEL_REGISTRY

        archs = sorted(a for a in ARCH_MODEL_REGISTRY if a.startswith("powernorm_"))
        return (f" ({', '.join(plugin)}: a flag of the plugin's architectures, which --arch must name: "
                f"{', '.join(archs)})")
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    close = [(f, difflib.get_close_matches(f, known, n=1, cutoff=0.75)) for f in flags]
    said = [f"{f}: did you mean {match[0]}?" for f, match in close if match]
    return f" ({'; '.join(said)})" if said else ""


@installs_once
def one_line_usage_errors():
    """A bad flag value or an unknown flag ends a command in argparse's one
    error line, without the usage block (fairseq's and this plugin's parsers)."""
    import argparse

    argparse.ArgumentParser.error = _one_line_usage_error


@installs_once
def name_fairseq_input_errors():
    """fairseq's errors about a user's input (see :func:`_input_error`) in one line too."""


@installs_once
def install_excepthook():
    """Print :class:`PowerNormConfigError` as one line; leave the rest alone."""
    sys.excepthook = _excepthook
