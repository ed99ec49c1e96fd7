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


def non_negative(text):
    """A finite float >= 0."""
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
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
        if message.startswith("unrecognized arguments:"):
            message += did_you_mean(self, [w.split("=")[0] for w in message.split(":", 1)[1].split()
                                           if w.startswith("--")])
        elif getattr(self, "_unknown", None):  # a required flag missing, most likely for a typo
            message += did_you_mean(self, self._unknown) or f" ({self._unknown[0]}: no such option)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def unknown_options(parser, argv) -> list:
    """The options of ``argv`` (before a ``--``) that ``parser`` does not have."""
    return [word.split("=", 1)[0] for word in argv[:argv.index("--") if "--" in argv else len(argv)]
            if word.startswith("--") and word.split("=", 1)[0] not in parser._option_string_actions]


def did_you_mean(parser, flags) -> str:
    """" (--tabel: did you mean --table?)": each of ``flags`` near an option of ``parser``, or ""."""
    known = [option for option in parser._option_string_actions if option.startswith("--")]
    said = [f"{flag}: did you mean {match[0]}?" for flag in flags
            if (match := difflib.get_close_matches(flag, known, n=1, cutoff=0.75))]
    return f" ({'; '.join(said)})" if said else ""
