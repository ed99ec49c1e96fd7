"""Bad input ends a command with one line naming the flag or file, not a traceback."""

import os
import re
import sys

from ..common.errors import InputFileError, PowerNormConfigError, TrainingDiverged
from ..common.flags import did_you_mean
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
    if not (name_fairseq_input_errors.installed or _runs_the_plugins_model(sys.argv[1:])):
        return None
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"no such file: {exc.filename}"
    split = re.fullmatch(r"Dataset not found: (\S+) \((.*)\)", str(exc)) if isinstance(exc, OSError) else None
    if split:  # a data directory binarized without one of the splits a run reads
        return (f"{split[2]}: no binarized '{split[1]}' split (fairseq-preprocess --{split[1]}pref makes it; "
                f"--train-subset/--valid-subset pick another)")
    if any(fragment in str(exc) for fragment in FAIRSEQ_INPUT_ERRORS):
        return " ".join(str(exc).split())
    return None


def _runs_the_plugins_model(argv):
    """Whether a command that failed before building a model (fairseq-eval-lm
    sets its task up first) was given one of this plugin's: ``--arch`` names
    it, or ``--path`` its checkpoint. Read at the failure only."""
    from ..common.checkpoints import load, of_the_plugin

    for flag, value in zip(argv, argv[1:]):
        if flag == "--arch" and value.startswith("powernorm_"):
            return True
        if flag == "--path":
            try:
                return of_the_plugin(load(value.split(os.pathsep)[0]))
            except InputFileError:  # missing or unreadable: the user's input is wrong either way
                return True
            except Exception:  # fairseq's own error stands
                return False
    return False


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
    message = str(value) if isinstance(value, TrainingDiverged) else _input_error(value)
    if message is not None:
        print(f"{prog}: error: {message}", file=sys.stderr)
    else:
        _previous(kind, value, traceback)


def _one_line_usage_error(self, message):
    """argparse's error without the usage block before it (fairseq's is about
    190 lines, which bury the one line that says what is wrong); ``--help``
    still prints the usage."""
    self.exit(2, f"{self.prog}: error: {usage_message(self, message)}\n")


def usage_message(parser, message):
    """argparse's ``message`` of a fairseq parser, with why its flags were not recognised: a plugin
    flag given with a stock architecture, or a misspelling of a flag the parser has."""
    if not message.startswith("unrecognized arguments:"):
        return message
    flags = [w.split("=")[0] for w in message.split(":", 1)[1].split() if w.startswith("--")]
    archs, ours = _plugin_flags()
    plugin = [f for f in flags if f in ours or f.replace("--no-", "--", 1) in ours]
    if plugin:
        return (f"{message} ({', '.join(plugin)}: a flag of the plugin's architectures, which --arch must name: "
                f"{', '.join(archs)})")
    return message + did_you_mean(parser, flags)


@installs_once
def one_line_usage_errors():
    """A bad flag value or an unknown flag ends a fairseq command in argparse's
    one error line, without the usage block. Only the parsers of a fairseq
    command (``prog`` fairseq-train, fairseq-generate, ...: fairseq builds
    several per command, from sys.argv[0]) take it; a user's own parsers,
    pytest's and hydra's keep argparse's usage line. The plugin's console
    scripts have their own (``common.flags.ArgumentParser``)."""
    import argparse

    stock = argparse.ArgumentParser.error

    def error(self, message):
        if not str(self.prog).startswith("fairseq"):
            return stock(self, message)
        return _one_line_usage_error(self, message)

    argparse.ArgumentParser.error = error


@installs_once
def name_fairseq_input_errors():
    """fairseq's errors about a user's input (see :func:`_input_error`) in one line too."""


@installs_once
def install_excepthook():
    """Print :class:`PowerNormConfigError` as one line; leave the rest alone."""
    sys.excepthook = _excepthook


@installs_once
def skip_overlong_interactive_lines():
    """fairseq-interactive ends at a line longer than the model takes (rc 1,
    the lines after it never translated). Here such a line gets one line on
    stderr and is skipped, as fairseq's --skip-invalid-size-inputs-valid-test
    skips it, and the next lines are translated."""
    interactive = sys.modules.get("fairseq_cli.interactive")
    if interactive is None:  # not fairseq-interactive
        return
    from omegaconf import open_dict

    make_batches = interactive.make_batches

    def checked_make_batches(lines, cfg, task, max_positions, encode_fn):
        sources = [line.split("\t")[0] if cfg.generation.constraints else line for line in lines]
        _, lengths = task.get_interactive_tokens_and_lengths(sources, encode_fn)
        limit = max_positions[0] if isinstance(max_positions, (tuple, list)) else max_positions
        for source, length in zip(sources, lengths):
            if limit is not None and length > limit:
                shown = source if len(source) <= 40 else source[:40] + "..."
                print(f"fairseq-interactive: skipped a line of {length} tokens, more than the model takes "
                      f"({limit}): {shown!r}", file=sys.stderr, flush=True)
        with open_dict(cfg):
            skip = cfg.dataset.skip_invalid_size_inputs_valid_test
            cfg.dataset.skip_invalid_size_inputs_valid_test = True
        try:
            yield from make_batches(lines, cfg, task, max_positions, encode_fn)
        finally:
            with open_dict(cfg):
                cfg.dataset.skip_invalid_size_inputs_valid_test = skip

    interactive.make_batches = checked_make_batches


def _plugin_flags():
    """The plugin's architectures, and the flags their models add to the
    parser beyond those of the fairseq model each extends, read from parsers
    that the models fill."""
    import argparse

    from fairseq.models import ARCH_MODEL_REGISTRY

    def options(model):
        p = argparse.ArgumentParser(add_help=False)
        model.add_args(p)
        return set(p._option_string_actions)

    archs = sorted(a for a in ARCH_MODEL_REGISTRY if a.startswith("powernorm_"))
    flags = set()
    for model in {ARCH_MODEL_REGISTRY[a] for a in archs}:
        stock = next(b for b in model.__mro__[1:] if hasattr(b, "add_args")
                     and not b.__module__.startswith("powernorm_fairseq"))
        flags |= options(model) - options(stock)
    return archs, flags
