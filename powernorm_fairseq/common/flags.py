"""Argument types shared by the plugin's flags and its console scripts."""

import argparse
import difflib
import math
import sys


def at_least(minimum: int, flag: str = None):
    """An integer >= ``minimum``; the error names ``flag`` when given."""
    def parse(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag + ' ' if flag else ''}must be >= {minimum}, got {text}")
        return value

    return parse


def positive(text):
    """A finite float > 0."""
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def fraction(flag: str):
    """A float in (0, 1); the error names ``flag``."""
    def parse(text):
        value = float(text)
        if not 0.0 < value < 1.0:
            raise argparse.ArgumentTypeError(f"{flag} must be in (0, 1), got {text}")
        return value

    return parse


class ArgumentParser(argparse.ArgumentParser):
    """The plugin's console scripts' parser: a usage error is one line
    (``prog: error: ...``), without the usage block; ``--help`` prints it. A
    flag is taken only as spelled in full (no prefix matching: ``--lr`` is not
    ``--lrs``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        self._unknown = unknown_options(self, argv)  # a typo is named, even where it hides a required flag
        return super().parse_known_args(argv, namespace)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {nearest(self, message, getattr(self, '_unknown', ()))}\n")


def unknown_options(parser, argv) -> list:
    """The options of ``argv`` (before a ``--``) that ``parser`` does not have."""
    found = []
    for word in argv:
        if word == "--":
            break
        if word.startswith("--") and word.split("=", 1)[0] not in parser._option_string_actions:
            found.append(word.split("=", 1)[0])
    return found


def nearest(parser, message: str, unknown=()) -> str:
    """argparse's ``message``, naming the option of ``parser`` nearest an unknown one ("did you mean
    --table?"), where the message is that an option is unknown or a required one missing."""
    if not message.startswith(("unrecognized arguments:", "the following arguments are required:")):
        return message
    unknown = list(unknown) or [w.split("=", 1)[0] for w in message.split(":", 1)[1].split() if w.startswith("--")]
    if not unknown:
        return message
    known = [option for option in parser._option_string_actions if option.startswith("--")]
    close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
    hint = f"{unknown[0]}: no such option" + (f"; did you mean {close[0]}?" if close else "")
    return hint if message.startswith("unrecognized") else f"{message} ({hint})"
