"""norm-study.sh: the grid's unfinished cells run, then the report."""

import shlex
import sys
from pathlib import Path

from ...common.files import atomic_path
from ..launcher import heartbeat, quiet, run
from ..layout import Out
from . import launchers
from .figures import figures
from .grid import METRIC, StudyError, cells
from .options import check, parse_args, parser
from .out import finished, same_settings, writable_out
from .report import fmt, report


def main(argv=None):
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(p, argv)
    quiet(args.verbose)  # before fairseq is imported, whose modules configure the root logger at DEBUG

    def kept():
        rest = "the same command resumes the rest" if args.launcher == "local" else \
            "the cells on the cluster go on, and the same command waits for them again"
        return f"the finished cells are kept, and {rest}"

    def body():
        check(args, p)
        study(args, argv, p)
    run(p, args, body, (StudyError,), kept)


def study(args, argv, p):
    grid = cells(args)
    if args.cell:
        grid = [c for c in grid if c["name"] == args.cell]
        if not grid:
            p.error(f"--cell {args.cell}: not a cell of this grid")
    writable_out(args, p)
    same_settings(args, p)

    if args.print_commands:
        rest, skip = [], 0
        for a in argv:  # the same command, one cell each
            if skip:
                skip -= 1
            elif a in ("--print-commands",):
                continue
            elif a in ("--jobs", "--cell"):
                skip = 1
            else:
                rest.append(a)
        script = Path(__file__).resolve().parents[3] / "scripts" / "norm-study.sh"
        done = finished(args, grid)
        todo = [c for c in grid if c["name"] not in done]
        with atomic_path(args.out / "commands.sh") as tmp:
            Path(tmp).write_text("".join(
                shlex.join(["bash", str(script), *rest_with_cell(rest, c["name"])]) + "\n" for c in todo))
        print(f"norm-study: {len(todo)} command(s), one per unfinished cell: {args.out / 'commands.sh'}; "
              "run them anywhere that sees OUT, then this command again without --print-commands to collect",
              file=sys.stderr)
        return
    results = finished(args, grid)
    todo = [c for c in grid if c["name"] not in results]
    at_once = args.jobs if args.launcher == "local" else min(args.max_parallel or len(todo), len(todo)) or 1
    where = f"{args.jobs} at once" if args.launcher == "local" else f"on SLURM, at most {at_once} at once"
    print(f"norm-study: {len(grid)} cells, {len(results)} finished, {len(todo)} to run ({where})", file=sys.stderr)
    busy, failed = [], []
    out = Out(args.out)

    def training():  # the cells under way: a log, no result yet
        return {c["name"]: log for c in todo if c["name"] not in results
                and (log := out.cell(c["name"]) / "train.log").exists() and not log.with_name("result.json").exists()}

    with heartbeat("norm-study", training):
        _run(args, grid, todo, results, busy, failed, at_once)
    if args.launcher == "slurm" and args.no_wait:
        print("norm-study: --no-wait: the same command, run again, waits for the cells and writes the report",
              file=sys.stderr)
    if not args.cell:
        collect(args)
    if failed:
        p.exit(1, f"norm-study: {len(failed)} cell(s) ended without a result on the cluster; each line above says "
               "whether a rerun of the same command can finish it\n")


def _run(args, grid, todo, results, busy, failed, at_once):
    """Run ``todo``, saying each cell's outcome as it ends."""
    for done, (cell, result) in enumerate(launchers.run_all(args, todo), 1):
        if result is None:
            print(f"norm-study: {cell['name']}: running in another process, skipped", file=sys.stderr)
            continue
        if isinstance(result, str):  # a job that ended without a result
            print(f"norm-study: {cell['name']}: {result}", file=sys.stderr)
            failed.append(cell["name"])
            continue
        results[cell["name"]] = result
        busy.append(result["seconds"])
        left = len(todo) - done
        eta = sum(busy) / len(busy) * left / at_once
        state = "converged" if result["converged"] else result["status"] if result["status"] != "finished" \
            else "not converged"
        print(f"norm-study: [{len(results)}/{len(grid)}] {cell['name']}: {state}, loss "
              f"{fmt(result['initial_loss'])} -> {fmt(result['final_loss'])}, {METRIC[args.task][1]} "
              f"{fmt(result['metric'], METRIC[args.task][2])} ({result['seconds']:.0f} s); {left} left, "
              f"about {eta / 60:.1f} min", file=sys.stderr)


def collect(args):
    """study.md, study.json and the figures, from every result on disk."""
    full = cells(args)
    from filelock import FileLock

    with FileLock(args.out / ".report.lock", preserve_lock_file=True):  # one report at a time, each from
        # every result on disk when it starts
        results = finished(args, full)
        try:
            figures(args, full, results)
            report(args, full, results)
        except OSError as err:
            raise StudyError(f"{err.filename or args.out}: could not be written ({err.strerror or err}); every "
                             "finished cell is kept: rerun the command to write the report") from None
    pending = len(full) - len(results)
    print(f"norm-study: {args.out / 'study.md'}" + (f" ({pending} cells pending)" if pending else ""),
          file=sys.stderr)


def rest_with_cell(rest, name):
    """The command's arguments with ``--cell name`` before any ``--`` (fairseq's flags)."""
    if "--" in rest:
        i = rest.index("--")
        return rest[:i] + ["--cell", name] + rest[i:]
    return rest + ["--cell", name]
