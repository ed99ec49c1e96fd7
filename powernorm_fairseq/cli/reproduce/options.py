"""The command's flags, and every check made before anything is written or submitted."""

import os
import subprocess
from pathlib import Path

from ...common.flags import ArgumentParser, at_least
from .. import slurm
from . import jobs, rows
from .runs import ReproduceError, code_version, data_digest, registry


def parser():
    p = ArgumentParser(prog="reproduce.sh", description="A table of the PowerNorm paper (or another config "
                       "family) with one command: every row x seed trained with train.sh and scored with "
                       "evaluate.sh, here or on a SLURM cluster, then the table (docs/reproduce.md).")
    p.add_argument("--table", required=True, choices=rows.TABLES, help="the config family: configs/<table>-*.sh")
    p.add_argument("--rows", nargs="+", metavar="ROW", help="configs by their suffix, the baseline first "
                   "(default: every row, the LayerNorm ones first)")
    p.add_argument("--seeds", nargs="+", type=at_least(1, "--seeds"), default=[1, 2, 3], metavar="N",
                   help="positive integers (default: 1 2 3)")
    p.add_argument("--out", help="runs/, table.md, table.json, the figures (default: runs/reproduce-<table>)")
    p.add_argument("--data", help="binarized data (default: data-bin/<dataset>/bin, as train.sh)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="here, one run after another (the GPUs this machine has, or the CPU), or on SLURM")
    p.add_argument("--dry-run", action="store_true", help="print every run's commands (and job scripts), and "
                   "write or submit nothing")
    s = p.add_argument_group("--launcher slurm")
    s.add_argument("--nodes", type=at_least(1, "--nodes"), metavar="N", help="nodes per training job (default: 1)")
    s.add_argument("--gpus-per-node", type=at_least(0, "--gpus-per-node"), metavar="G",
                   help="GPUs per node (default: 0, CPU nodes)")
    s.add_argument("--tasks-per-node", type=at_least(1, "--tasks-per-node"), metavar="T",
                   help="tasks per node, a fairseq worker each (default: one per GPU; 1 on CPU nodes); divides G")
    s.add_argument("--partition", help="the jobs' partition (default: the cluster's)")
    s.add_argument("--timeout-min", type=at_least(2, "--timeout-min"), metavar="M", help="a job's time limit "
                   "(default: 240); a training that reaches it requeues and resumes from its checkpoint")
    s.add_argument("--mem-per-node", type=at_least(1, "--mem-per-node"), metavar="GB",
                   help="memory per node (default: the cluster's)")
    s.add_argument("--max-parallel", type=at_least(1, "--max-parallel"), metavar="K",
                   help="training jobs pending or running at once (default: no limit)")
    s.add_argument("--no-wait", action="store_true", default=None, help="submit and return; the same command "
                   "later collects")
    p.usage = ("reproduce.sh --table TABLE [--rows ROW...] [--seeds N...] [--out DIR] [--data DIR] "
               "[--launcher local|slurm] [SLURM flags] [--dry-run] [-- FAIRSEQ-TRAIN FLAGS...]")
    p.epilog = "After --: more fairseq-train flags, given to every run (and part of its settings)."
    return p


def parse_args(p, argv):
    """Our flags, and fairseq-train's after ``--`` (an unknown flag before it is refused)."""
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = p.parse_args(ours)
    args.fairseq = theirs
    return args


def check(args, p):
    """Every refusal, in one line, before anything is written or submitted (``p.error``, or ReproduceError)."""
    known = rows.names(args.table)
    for name in args.rows or []:
        if name not in known:
            p.error(f"--rows: {name!r} is not a row of --table {args.table}; choose from {', '.join(known)}")
    if args.rows and len(set(args.rows)) != len(args.rows) or len(set(args.seeds)) != len(args.seeds):
        p.error("--rows and --seeds: a value listed twice")
    args.rows = [rows.row(args.table, name) for name in args.rows or known]
    _check_launcher(args, p)
    args.out = Path(args.out or f"runs/reproduce-{args.table}").resolve()
    _check_out(args, p)
    _check_data(args, p)
    os.environ.pop("POWERNORM_REGISTRY", None)
    os.environ["POWERNORM_REGISTRY"] = registry()  # every script this command starts, jobs too, reads it here
    args.code_version, args.data_digest = code_version(), data_digest(args.data)
    _check_fairseq_flags(args, p)


def _check_launcher(args, p):
    if not slurm.check_flags(args, p, jobs.FLAGS):
        return
    if args.tasks_per_node is None:
        args.tasks_per_node = args.gpus_per_node or 1
    if args.gpus_per_node and args.gpus_per_node % args.tasks_per_node:
        p.error(f"--tasks-per-node {args.tasks_per_node} does not divide --gpus-per-node {args.gpus_per_node}: "
                "each task's worker(s) take an equal share of a node's GPUs")
    if not args.dry_run:
        slurm.check_tools(p)


def _check_out(args, p):
    out = args.out
    if out.exists() and not out.is_dir():
        p.error(f"--out {out}: is a file, not a directory; give another --out")
    existing = next(d for d in [out, *out.parents] if d.exists())
    if not args.dry_run and not _writable(existing):
        p.error(f"--out {out}: cannot be written ({existing} is read-only or not ours); give another --out")


def _writable(directory):
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _check_data(args, p):
    datasets = {row.dataset for row in args.rows}
    args.data = Path(args.data or f"data-bin/{sorted(datasets)[0]}/bin").resolve()
    dictionary = "dict.txt" if args.rows[0].lm else "dict.en.txt"
    test = "test.bin" if args.rows[0].lm else "test.*.bin"
    if not (args.data / dictionary).is_file() or not list(args.data.glob(test)):
        p.error(f"--data {args.data}: no binarized data with a test set (no {dictionary} or {test}); prepare it "
                "with data-prep/ first, or pass --data")


class _FairseqUsage(Exception):
    pass


def _check_fairseq_flags(args, p):
    """Each row's training command, as train.sh builds it, through fairseq-train's own parser and the
    plugin's model checks: a typo after ``--`` is one line here, not a failed job later."""
    import argparse as stock
    import shlex

    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ...common.errors import PowerNormConfigError
    from ...models.options import check_args
    from .runs import train_command

    def error(self, message):
        raise _FairseqUsage(message)

    before = stock.ArgumentParser.error
    stock.ArgumentParser.error = error
    try:
        for row in args.rows:
            command = train_command(args, row, args.seeds[0], 0)
            cut = command.index("--")
            dry = subprocess.run(command[:cut] + ["--dry-run"] + command[cut:], capture_output=True, text=True,
                                 cwd=rows.ROOT)
            if dry.returncode:
                p.error(f"row {row.name}: {dry.stderr.strip().splitlines()[-1]}")
            argv = shlex.split(dry.stdout)[1:]  # fairseq-train's arguments
            try:
                parsed = options.parse_args_and_arch(options.get_training_parser(), argv)
                check_args(parsed, tuple(ARCH_MODEL_REGISTRY[parsed.arch].NORM_FLAGS))
            except _FairseqUsage as err:
                raise ReproduceError(f"fairseq-train (the flags after --): {err}") from None
            except PowerNormConfigError as err:
                raise ReproduceError(f"row {row.name}: {err}") from None
    finally:
        stock.ArgumentParser.error = before
