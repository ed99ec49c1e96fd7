"""``--launcher slurm``: the cells as one SLURM job array, through submitit
and the plugin's SLURM layer (:mod:`..slurm`).

``OUT/jobs.json`` maps each submitted cell to its job id. Before submitting,
a run asks the cluster which of those jobs are pending or running: it never
submits such a cell again, nor a finished one (``result.json``), and it
resubmits a cell whose job ended without a result (failed, cancelled, out of
memory). A job that reaches its time limit or is pre-empted requeues itself
and resumes from the cell's ``checkpoint_last.pt`` (:class:`Cell`). The run
then waits, and yields each cell as its job ends.
"""

import sys
from pathlib import Path

from ...common.errors import PowerNormConfigError
from ...common.files import atomic_path, end_cleanly_on_sigterm, last_line, tail
from .. import slurm
from .cell import add_seconds, quiet, run_cell
from .grid import StudyError
from .out import finished

#: the flags that only the SLURM launcher takes, and their defaults
FLAGS = {"partition": None, "gpus_per_cell": 0, "cpus_per_cell": None, "mem_per_cell": None, "timeout_min": 240,
         "max_parallel": None}


class Cell(slurm.Resumable):
    """One cell as a job, requeued and resumed from its last checkpoint when
    pre-empted or near its time limit (:class:`..slurm.Resumable`). SIGTERM
    (``scancel``) ends the cell: a rerun resubmits it."""

    def __call__(self, args, cell):
        self.started(Path(args.out, "cells", cell["name"], "checkpoint_last.pt"), args.timeout_min)
        end_cleanly_on_sigterm()  # scancel's SIGTERM ends the cell now (submitit would let it run to SIGKILL)
        quiet(args.verbose)
        failure = Path(args.out, "cells", cell["name"], FAILURE)
        failure.unlink(missing_ok=True)
        try:
            result = run_cell(args, cell, args.verbose)
        except Exception as err:  # why, as plain text for the waiting run: it never unpickles submitit's record
            kind = "input" if isinstance(err, (PowerNormConfigError, StudyError)) else "error"
            text = " ".join(str(err).split()) or type(err).__name__
            failure.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(failure) as tmp:
                Path(tmp).write_text(f"{kind}\n{text[:2000]}\n")
            raise
        if result is None:
            raise StudyError(f"cell {cell['name']}: held by another process on {args.out}")
        return result

    def checkpoint(self, args, cell):
        if not self.requeue(f"cell {cell['name']}"):
            return None
        add_seconds(Path(args.out, "cells", cell["name"]), self.seconds())  # result.json counts all jobs
        return super().checkpoint(args, cell)


#: a job's plain-text record of why its cell ended without a result: "input" (a rerun fails the same way)
#: or "error", then the error's line
FAILURE = "failure.txt"


def run(args, todo):
    """(cell, result) as each job ends; (cell, why) for a job that ended without a result."""
    slurm.private(Path(args.out, "slurm"))
    with slurm.locked(args.out):
        jobs = slurm.read_jobs(args.out, steps=False)
        live = slurm.live(Path(args.out, "slurm"))
        waiting = {c["name"]: jobs[c["name"]] for c in todo if jobs.get(c["name"]) in live}
        submit = [c for c in todo if c["name"] not in waiting]
        for cell in submit:
            if cell["name"] in jobs:
                print(f"norm-study: {cell['name']}: job {jobs[cell['name']]} ended without a result; resubmitted",
                      file=sys.stderr)
        new = _submit(args, submit)
        if new:
            jobs.update(new)
            slurm.write_jobs(args.out, jobs)
    print(f"norm-study: {len(waiting)} cell(s) already pending or running on the cluster, {len(new)} submitted"
          + (f" as job array {next(iter(new.values())).split('_')[0]}" if new else "")
          + f"; their logs: {Path(args.out, 'slurm')}", file=sys.stderr)
    yield from _wait(args, {c["name"]: c for c in todo}, {**waiting, **new})


def _submit(args, todo):
    """{cell name: job id} of the cells submitted, as one array."""
    params = dict(job_name="norm-study", time=args.timeout_min, cpus_per_task=args.cpus_per_cell,
                  array_parallelism=args.max_parallel or len(todo))
    params.update({k: v for k, v in (("partition", args.partition), ("gpus_per_node", args.gpus_per_cell or None),
                                     ("mem", f"{args.mem_per_cell}GB" if args.mem_per_cell else None)) if v})
    ids = slurm.submit(Path(args.out, "slurm"), params, [(Cell(), (args, cell)) for cell in todo], "the cells")
    return dict(zip([cell["name"] for cell in todo], ids))


def _wait(args, cells, jobs):
    """Yield each cell as its job ends (its result as soon as result.json is written)."""
    wait = slurm.polls()
    while jobs:
        live = slurm.live(Path(args.out, "slurm"))
        ended = False
        done = finished(args, [cells[name] for name in jobs])
        for name, job in list(jobs.items()):
            if name in done:
                yield cells[name], done[name]
            elif job not in live:
                yield cells[name], _why(args, cells[name], job)
            else:
                continue
            del jobs[name]
            ended = True
        if jobs:
            wait(ended)


def _why(args, cell, job_id):
    """Why a job ended without a result, in one line: its state, its last
    error (the cell's plain-text record, or the last line of the job's log;
    never submitit's pickle, which this process does not load), whether a
    rerun can help, and its log."""
    log = slurm.log(Path(args.out, "slurm"), job_id)
    kind, last = "error", ""
    record = tail(Path(args.out, "cells", cell["name"], FAILURE)).splitlines()
    if len(record) >= 2:
        kind, last = record[0], record[-1]
    else:
        last = last_line(log)
    again = "a rerun fails the same way until what it names is fixed" if kind == "input" \
        else "the same command resubmits it"
    return f"job {job_id} ended without a result ({slurm.state(job_id)}{': ' + last if last else ''}); {again}. " \
           f"Log: {log}"


def check(args, p):
    """The launcher's flags: with ``--launcher slurm`` only, and what they imply."""
    if not slurm.check_flags(args, p, FLAGS):
        return
    for flag, bad in (("--jobs", args.jobs is not None), ("--print-commands", args.print_commands)):
        if bad:
            p.error(f"{flag}: the local launcher's; --launcher slurm submits every cell as a job "
                    "(--max-parallel: how many run at once)")
    slurm.check_tools(p)
    args.cpus_per_cell = args.cpus_per_cell or max(1, args.gpus_per_cell)
    args.threads = args.threads or args.cpus_per_cell
