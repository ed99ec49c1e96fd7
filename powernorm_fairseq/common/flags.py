"""Argument types shared by the plugin's flags and its console scripts."""

import argparse
import math


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

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")
