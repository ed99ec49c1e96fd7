"""``--launcher slurm``: the cells as one SLURM job array, through the one
launcher's algorithm (:class:`..launcher.Jobs`) and the plugin's SLURM layer.

``OUT/jobs.json`` maps each submitted cell to its job id. A run never
submits a cell whose job is pending or running, nor a finished one
(``result.json``), and resubmits a cell whose job ended without a result
(failed, cancelled, out of memory). A job that reaches its time limit or is
pre-empted requeues itself and resumes from the cell's
``checkpoint_last.pt`` (:class:`Cell`). The run then waits (unless
``--no-wait``), and yields each cell as its job ends.
"""

import sys
from pathlib import Path

from ...common.errors import PowerNormConfigError
from ...common.files import atomic_path, end_cleanly_on_sigterm, tail
from ..layout import Out
from .. import slurm
from ..launcher import Jobs, quiet, resources
from .cell import add_seconds, run_cell
from .grid import StudyError
from .out import finished


class Cell(slurm.Resumable):
    """One cell as a job, requeued and resumed from its last checkpoint when
    pre-empted or near its time limit (:class:`..slurm.Resumable`). SIGTERM
    (``scancel``) ends the cell: a rerun resubmits it."""

    def __call__(self, args, cell):
        self.started(Path(Out(args.out).cell(cell["name"]), "checkpoint_last.pt"), args.timeout_min)
        end_cleanly_on_sigterm()  # scancel's SIGTERM ends the cell now (submitit would let it run to SIGKILL)
        quiet(args.verbose)
        failure = Path(Out(args.out).cell(cell["name"]), FAILURE)
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
        add_seconds(Out(args.out).cell(cell["name"]), self.seconds())  # result.json counts all jobs
        return super().checkpoint(args, cell)


#: a job's plain-text record of why its cell ended without a result: "input" (a rerun fails the same way)
#: or "error", then the error's line
FAILURE = "failure.txt"


def run(args, todo):
    """(cell, result) as each job ends; (cell, why) for a job that ended without a result."""
    jobs = Jobs(args.out, steps=False, prog="norm-study")
    with jobs.submitting():
        waiting = {c["name"] for c in todo if jobs.ids.get(c["name"]) in jobs.live}
        submit = [c for c in todo if c["name"] not in waiting]
        for cell in submit:
            if cell["name"] in jobs.ids:
                print(f"norm-study: {cell['name']}: job {jobs.ids[cell['name']]} ended without a result; "
                      "resubmitted", file=sys.stderr)
        params = dict(job_name="norm-study", **resources(args), array_parallelism=args.max_parallel or len(submit))
        if args.gpus_per_node:
            params["gpus_per_node"] = args.gpus_per_node
        new = jobs.submit(params, [(Cell(), (args, cell)) for cell in submit], "the cells",
                          [c["name"] for c in submit])
    jobs.said(f"{len(waiting)} cell(s) already pending or running on the cluster, {len(new)} submitted"
              + (f" as job array {new[0].split('_')[0]}" if new else ""))
    if args.no_wait:
        return
    cells = {c["name"]: c for c in todo}

    def ended(name, job_id):
        done = finished(args, [cells[name]])
        if name in done:
            return done[name]
        return _why(args, cells[name], job_id) if job_id not in jobs.live else None

    for name, outcome in jobs.wait({name: jobs.ids[name] for name in cells}, ended):
        yield cells[name], outcome


def _why(args, cell, job_id):
    """Why a job ended without a result, in one line: its state, its last
    error (the cell's plain-text record, or the last line of the job's log;
    never submitit's pickle, which this process does not load), whether a
    rerun can help, and its log."""
    jobs = Jobs(args.out, steps=False, prog="norm-study")
    record = tail(Path(Out(args.out).cell(cell["name"]), FAILURE)).splitlines()
    kind, last = (record[0], record[-1]) if len(record) >= 2 else ("error", jobs.cause(job_id))
    again = "a rerun fails the same way until what it names is fixed" if kind == "input" \
        else "the same command resubmits it"
    return f"job {job_id} ended without a result ({slurm.state(job_id)}{': ' + last if last else ''}); {again}. " \
           f"Log: {slurm.log(jobs.out.slurm, job_id)}"


def check(args, p):
    """The launcher's flags: with ``--launcher slurm`` only, and what they imply."""
    from ..launcher import check_flags

    if not check_flags(args, p, one_node=True):
        return
    for flag, bad in (("--jobs", args.jobs is not None), ("--print-commands", args.print_commands)):
        if bad:
            p.error(f"{flag}: the local launcher's; --launcher slurm submits every cell as a job "
                    "(--max-parallel: how many run at once)")
    args.threads = args.threads or args.cpus_per_task
