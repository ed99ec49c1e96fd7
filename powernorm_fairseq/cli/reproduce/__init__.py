"""A table of the PowerNorm paper with one command (``scripts/reproduce.sh``,
docs/reproduce.md): every row x seed of a config family trained with exactly
the command ``train.sh`` builds for it, scored by ``evaluate.sh`` (BLEU and
sacreBLEU) or ``evaluate-lm.sh`` (perplexity), and the table with intervals,
paired differences against the first row and the paper's numbers.

A rerun of the same command skips what is scored, resumes what was
interrupted from its checkpoints and never trains or scores a run twice; a
run started with other settings is refused (``runs``). The package, a job
per file: ``rows`` (the tables and their configs), ``runs`` (one run: its
commands, state and settings; the local launcher), ``jobs`` (the SLURM
launcher), ``table`` (table.md, table.json, the figures) and ``options``.
"""

import sys

from ..launcher import quiet, run
from .options import check, check_report, parse_args, parser
from .runs import ReproduceError, check_settings, directory, name, scored, trained


def main(argv=None):
    p = parser()
    args = parse_args(p, sys.argv[1:] if argv is None else argv)
    quiet(False)  # before fairseq is imported (the flags' check): its warnings only; each run's log has the rest

    def body():
        if args.report:
            from . import table

            check_report(args, p)
            path, text = table.write(args, args.rows, args.seeds)
            print(f"reproduce: {path}", file=sys.stderr)
            print(text)
            return
        check(args, p)
        reproduce(args, p)
    run(p, args, body, (ReproduceError,), lambda: _kept(args))


def _kept(args):
    rest = "the same command resumes the rest" if args.launcher == "local" else \
        "the jobs on the cluster go on, and the same command waits for them again"
    return f"what finished is kept, and {rest}"


def reproduce(args, p):
    from . import jobs, runs, table

    grid = [(row, seed) for row in args.rows for seed in args.seeds]
    if args.dry_run:
        if args.launcher == "slurm":
            jobs.dry_run(args, grid)
        else:
            import torch

            gpus = torch.cuda.device_count()
            for row, seed in grid:
                print(f"# {name(row, seed)}\n{shlex_join(runs.train_command(args, row, seed, gpus))}\n"
                      f"# which runs:\n{runs.fairseq_command(args, row, seed, gpus)}\n"
                      f"{shlex_join(runs.score_command(args, row, seed, gpus > 0))}\n")
        return
    check_settings(args, grid)
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [(row, seed) for row, seed in grid if not scored(row, directory(args, row, seed))]
    where = "here" if args.launcher == "local" else "on SLURM"
    print(f"reproduce: {args.table}: {len(grid)} runs, {len(grid) - len(todo)} scored, {len(todo)} to run "
          f"({where}); {args.out}", file=sys.stderr)
    if args.launcher == "local":
        steps = [(row, seed, "score" if trained(directory(args, row, seed)) else "train") for row, seed in todo]
        failures = runs.run_local(args, steps)
    else:
        failures = jobs.run(args, todo)
    path, text = table.write(args, args.rows, args.seeds)
    print(f"reproduce: {path}", file=sys.stderr)
    print(text)
    if failures:
        p.exit(1, f"{p.prog}: {len(failures)} run(s) ended without a score (see the table); the same command "
                  "runs them again\n")


def shlex_join(command):
    import shlex

    return shlex.join(map(str, command))
