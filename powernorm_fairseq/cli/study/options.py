"""The command's flags, and every check made before anything is written."""

import argparse
import os
from pathlib import Path

from ...common.flags import ArgumentParser, at_least, fraction, positive
from ..layout import Out
from .cell import parse
from .grid import (DEFAULTS, TASKS, WIDTHS, StudyError, cells, check_data, check_names, check_width, constant_loss,
                   train_argv, width)
from ..launcher import add_flags, parse_args  # noqa: F401 (parse_args: the command's)
from .slurm import check as slurm_check


def parser():
    from ...norms.placement import PLACEMENTS

    p = ArgumentParser(prog="norm-study.sh", description="A grid of training runs over learning rate, depth, "
                       "width, norm, init and seed, with its convergence tables and figures (docs/study.md).")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--data", required=True, help="binarized data (data-prep/)")
    p.add_argument("--out", required=True, help="the study's directory: cells/, study.md, study.json, figures")
    p.add_argument("--lrs", nargs="+", type=positive, metavar="LR")
    p.add_argument("--depths", nargs="+", type=at_least(1, "--depths"), metavar="N", help="layers (per side)")
    p.add_argument("--widths", nargs="+", type=width, metavar="W",
                   help=f"{', '.join(f'{k} ({v})' for k, v in WIDTHS.items())} or an embedding size; "
                        "the feed-forward is 4x, a head per 64 channels")
    p.add_argument("--norms", nargs="+", metavar="KIND", help="--norm-type kinds; the first is the baseline "
                   "of the paired differences")
    p.add_argument("--inits", nargs="+", metavar="INIT", help="--init schemes")
    p.add_argument("--optimizer", choices=("sgd", "adam"))
    p.add_argument("--placement", choices=PLACEMENTS, help="every cell's --norm-placement")
    p.add_argument("--placements", nargs="+", choices=PLACEMENTS, metavar="P", help="--norm-placement as an "
                   "axis of the grid, like --norms (the first is the baseline of a second paired difference); "
                   "rezero's cells take --norm-type none")
    p.add_argument("--qk-norms", nargs="+", metavar="KIND", help="--qk-norm as an axis: per-token kinds, or none "
                   "(default: none)")
    p.add_argument("--switches", nargs="+", metavar="FLAG", help="an axis of the model's on/off flags, each a "
                   f"column beside its norm: none or {', '.join(model_switches())} (default: none)")
    p.add_argument("--warmup-updates", type=at_least(0, "--warmup-updates"), metavar="N",
                   help="linear warmup, then inverse square root (0: a fixed learning rate)")
    p.add_argument("--max-epochs", type=at_least(1, "--max-epochs"), metavar="N")
    p.add_argument("--max-update", type=at_least(1, "--max-update"), metavar="N", help="instead of --max-epochs")
    p.add_argument("--batch-size", type=at_least(1, "--batch-size"), default=32, help="sentences (classification)")
    p.add_argument("--max-tokens", type=at_least(1, "--max-tokens"), default=2048)
    p.add_argument("--log-interval", type=at_least(1, "--log-interval"), default=10, help="updates per loss point")
    p.add_argument("--converged-fraction", type=fraction("--converged-fraction"), default=0.5, metavar="F")
    p.add_argument("--landscape", action="store_true", help="Lipschitz constant and smoothness of each cell's "
                   "final loss (powernorm-analyze --landscape)")
    p.add_argument("--jobs", type=at_least(1, "--jobs"), help="cells at once, in processes here (default: 1)")
    p.add_argument("--threads", type=at_least(1, "--threads"), help="torch threads per cell (default: cores / jobs; "
                   "on SLURM, --cpus-per-task)")
    p.add_argument("--print-commands", action="store_true", help="write OUT/commands.sh, one command per "
                   "unfinished cell (for a scheduler), and exit; a later run collects the cells")
    p.add_argument("--cell", metavar="NAME", help="run this cell only (what --print-commands writes)")
    p.add_argument("--verbose", action="store_true", help="fairseq's log on the console too")
    add_flags(p, seeds=[1], unit="cell")
    p.usage = "norm-study.sh [options] [-- FAIRSEQ-TRAIN FLAGS...]"
    p.epilog = "After --: more fairseq-train flags, given to every cell."
    return p


def model_switches():
    """The plugin models' on/off flags that change what a model computes (NormConfig's store_true
    function settings), as ``--switches`` takes them."""
    from ...models.options import FUNCTION, norm_fields

    return [f.name.replace("_", "-") for f in norm_fields() if f.metadata["argparse"].get("action") == "store_true"
            and f.metadata["role"] == FUNCTION]


def check(args, p):
    from ...models.options import init_scheme
    from ...norms import NORM_TYPES

    from ...norms.qk_norm import QK_KINDS

    if args.placement and args.placements:
        p.error("--placement and --placements: give one (--placements P... makes the placement an axis)")
    args.placement_axis = bool(args.placements)
    for key, value in DEFAULTS[args.task].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.placements = args.placements or [args.placement]
    args.placement = "per cell" if args.placement_axis else args.placement  # settings.json: one, or the grid's
    args.qk_norms = args.qk_norms or ["none"]
    args.switches = args.switches or ["none"]
    for switch in args.switches:
        if switch not in ("none", *model_switches()):
            p.error(f"--switches: {switch!r} is not an on/off flag of the models; choose from none, "
                    f"{', '.join(model_switches())}")
    for kind in args.qk_norms:
        if kind not in QK_KINDS + ("none",):
            p.error(f"--qk-norms: {kind!r} cannot normalise a head's queries and keys; choose from "
                    f"{', '.join(QK_KINDS)}, none")
    args.lrs = [float(x) for x in args.lrs]
    args.widths = [width(str(w)) for w in args.widths]
    for norm in args.norms:
        if norm not in NORM_TYPES:
            p.error(f"--norms: unknown kind {norm!r}; choose from {', '.join(NORM_TYPES)}")
    try:
        args.inits = [init_scheme(i) for i in args.inits]
    except argparse.ArgumentTypeError as err:
        p.error(str(err).replace("--init", "--inits"))
    for key in ("lrs", "depths", "widths", "norms", "inits", "seeds", "placements", "qk_norms", "switches"):
        values = getattr(args, key)
        if len(set(values)) != len(values):
            p.error(f"--{key.replace('_', '-')} lists a value twice: {' '.join(map(str, values))}")
    slurm_check(args, p)
    args.jobs = args.jobs or 1
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    args.data_as_given = args.data  # what the report names: no path of this machine beyond the user's own
    args.data = Path(args.data).resolve()
    args.out = Path(args.out).resolve()
    for w in args.widths:
        check_width(w)
    check_data(args)
    args.majority_loss = constant_loss(args)
    check_names(cells(args))
    check_fairseq_args(args)


class _FairseqUsage(Exception):
    pass


def check_fairseq_args(args):
    """Every cell's fairseq-train command, parsed by fairseq's own parser (a
    typo after ``--`` or a combination the plugin refuses is one line, before
    anything is written), once per kind of cell; and a run that saves its
    last checkpoint every epoch, which the study's results and resumes read."""
    import argparse as stock

    from ...common.errors import PowerNormConfigError
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ...models.options import check_args

    def error(self, message):
        from ...patches.errors import usage_message

        raise _FairseqUsage(usage_message(self, message))

    seen, error_before = set(), stock.ArgumentParser.error
    stock.ArgumentParser.error = error
    try:
        for cell in cells(args):
            kind = (cell["depth"], cell["width"], cell["norm"], cell["init"], cell["placement"], cell["qk"],
                    cell["switch"])
            if kind in seen:
                continue
            seen.add(kind)
            try:
                parsed = parse(train_argv(args, cell, Out(args.out).cell(cell["name"])))
                # the model's own refusals, before any cell trains, over the sides the model has
                check_args(parsed, tuple(ARCH_MODEL_REGISTRY[parsed.arch].NORM_FLAGS))
            except _FairseqUsage as err:
                raise StudyError(f"fairseq-train (the flags after --): {err}") from None
            except PowerNormConfigError as err:
                raise StudyError(f"cell {cell['name']}: {err}") from None
            for flag, bad in (("--no-save", parsed.no_save), ("--no-last-checkpoints", parsed.no_last_checkpoints),
                              (f"--save-interval {parsed.save_interval}", parsed.save_interval != 1)):
                if bad:
                    raise StudyError(f"after --: {flag}: a cell's result and its resume are read from the "
                                     "checkpoint_last.pt saved at the end of every epoch; leave it out")
    finally:
        stock.ArgumentParser.error = error_before
