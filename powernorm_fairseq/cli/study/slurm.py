"""``--launcher slurm``: the cells as one SLURM job array, through submitit.

``OUT/jobs.json`` maps each submitted cell to its job id, and submitit keeps
its job scripts, pickles and logs in ``OUT/slurm/``. Before submitting, a run
asks the cluster (``squeue``) which of those jobs are pending or running: it
never submits such a cell again, nor a finished one (``result.json``), and it
resubmits a cell whose job ended without a result (failed, cancelled, out of
memory). A job that reaches its time limit or is pre-empted gets submitit's
signal, requeues itself and resumes from the cell's ``checkpoint_last.pt``
(:class:`Cell`). The run then waits, and yields each cell as its job ends.
"""

import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from ...common.errors import PowerNormConfigError
from ...common.files import atomic_path, end_cleanly_on_sigterm
from .cell import add_seconds, quiet, run_cell
from .grid import StudyError
from .out import finished

#: the flags that only the SLURM launcher takes, and their defaults
FLAGS = {"partition": None, "gpus_per_cell": 0, "cpus_per_cell": None, "mem_per_cell": None, "timeout_min": 240,
         "max_parallel": None}
POLL = (2.0, 30.0)  # seconds between two looks at the queue: the first, and the most it grows to


class Cell(submitit.helpers.Checkpointable):
    """One cell as a job. SLURM signals a job 90 s before its time limit
    (submitit's ``--signal=USR2@90``), and a pre-empting scheduler may too:
    submitit then calls :meth:`checkpoint`, requeues the job with the same
    cell, and the cell resumes from its last checkpoint. A job that timed out
    without saving one since it started ends instead of requeuing for ever.
    SIGTERM (``scancel``) ends the cell: a rerun resubmits it."""

    def __call__(self, args, cell):
        self.started = time.time()
        self.mark = _mark(args, cell)
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
        timed_out = time.time() - self.started >= 0.8 * args.timeout_min * 60  # else a pre-emption
        if timed_out and _mark(args, cell) == self.mark:
            print(f"cell {cell['name']}: no checkpoint saved in the {args.timeout_min} minutes this job had; "
                  "not requeued (give a longer --timeout-min)", file=sys.stderr)
            return None
        add_seconds(Path(args.out, "cells", cell["name"]), time.time() - self.started)  # result.json counts all jobs
        return super().checkpoint(args, cell)


#: a job's plain-text record of why its cell ended without a result: "input" (a rerun fails the same way)
#: or "error", then the error's line
FAILURE = "failure.txt"


def _mark(args, cell):
    path = Path(args.out, "cells", cell["name"], "checkpoint_last.pt")
    return path.stat().st_mtime_ns if path.exists() else None


def run(args, todo):
    """(cell, result) as each job ends; (cell, why) for a job that ended without a result."""
    _private(Path(args.out, "slurm"))
    with _locked(args.out):
        jobs = _read_jobs(args.out)
        live = _live()
        waiting = {c["name"]: jobs[c["name"]] for c in todo if jobs.get(c["name"]) in live}
        submit = [c for c in todo if c["name"] not in waiting]
        for cell in submit:
            if cell["name"] in jobs:
                print(f"norm-study: {cell['name']}: job {jobs[cell['name']]} ended without a result; resubmitted",
                      file=sys.stderr)
        new = _submit(args, submit)
        if new:
            jobs.update(new)
            with atomic_path(Path(args.out, "jobs.json")) as tmp:
                Path(tmp).write_text(json.dumps(jobs, indent=1))
    print(f"norm-study: {len(waiting)} cell(s) already pending or running on the cluster, {len(new)} submitted"
          + (f" as job array {next(iter(new.values())).split('_')[0]}" if new else "")
          + f"; their logs: {Path(args.out, 'slurm')}", file=sys.stderr)
    yield from _wait(args, {c["name"]: c for c in todo}, {**waiting, **new})


def _submit(args, todo):
    """{cell name: job id} of the cells submitted, as one array."""
    if not todo:
        return {}
    # requeues after a time limit: as many as it takes, while the cell saves checkpoints (Cell.checkpoint)
    executor = submitit.SlurmExecutor(folder=Path(args.out, "slurm"), max_num_timeout=1000)
    params = dict(job_name="norm-study", time=args.timeout_min, cpus_per_task=args.cpus_per_cell,
                  array_parallelism=args.max_parallel or len(todo))
    params.update({k: v for k, v in (("partition", args.partition), ("gpus_per_node", args.gpus_per_cell or None),
                                     ("mem", f"{args.mem_per_cell}GB" if args.mem_per_cell else None)) if v})
    executor.update_parameters(**params)
    made = not executor.folder.exists()
    executor.folder.mkdir(parents=True, exist_ok=True)
    os.chmod(executor.folder, executor.folder.stat().st_mode & ~0o022)  # its pickles run in the jobs: ours alone
    before = set(executor.folder.iterdir())
    # what submitit writes here, and (SLURM passes sbatch's umask on) what the jobs write: no one else's to change
    umask = os.umask(0o022)
    os.umask(umask | 0o022)
    try:
        with redirect_stderr(io.StringIO()), executor.batch():  # submitit prints sbatch's refusal; we say it once
            jobs = [executor.submit(Cell(), args, cell) for cell in todo]
    except (FailedJobError, FailedSubmissionError, subprocess.SubprocessError, OSError) as err:
        for path in set(executor.folder.iterdir()) - before:  # the refused submission's script and pickles
            path.unlink()
        if made and not any(executor.folder.iterdir()):
            executor.folder.rmdir()
        lines = [x for x in str(err).splitlines() if "error" in x.lower()] or str(err).splitlines() or [""]
        why = lines[-1].strip().removeprefix("sbatch: error: ")
        raise StudyError(f"--launcher slurm: sbatch refused the cells: {why}") from None
    finally:
        os.umask(umask)
    return {cell["name"]: job.job_id for cell, job in zip(todo, jobs)}


def _live():
    """{job id: state} of this user's pending and running jobs, array tasks one by one."""
    try:
        out = subprocess.run(["squeue", "--me", "--array", "--noheader", "--format", "%i|%T"], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise StudyError(f"--launcher slurm: squeue did not answer ({err}); is this a machine of the cluster?") \
            from None
    if out.returncode:
        raise StudyError(f"--launcher slurm: squeue: {out.stderr.strip() or out.returncode}")
    return dict(line.split("|", 1) for line in out.stdout.split())


def _wait(args, cells, jobs):
    """Yield each cell as its job ends (its result as soon as result.json is written)."""
    delay = POLL[0]
    while jobs:
        live = _live()
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
            delay = POLL[0] if ended else min(POLL[1], delay * 1.5)
            time.sleep(delay)


def _why(args, cell, job_id):
    """Why a job ended without a result, in one line: its state, its last
    error (the cell's plain-text record, or the last line of the job's log;
    never submitit's pickle, which this process does not load), whether a
    rerun can help, and its log."""
    job = submitit.SlurmJob(folder=Path(args.out, "slurm"), job_id=job_id)
    state = subprocess.run(["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True)
    state = next((w.split("=", 1)[1] for w in state.stdout.split() if w.startswith("JobState=")), "ended")
    kind, last = "error", ""
    record = _tail(Path(args.out, "cells", cell["name"], FAILURE)).splitlines()
    if len(record) >= 2:
        kind, last = record[0], record[-1]
    else:
        lines = [x.strip() for x in _tail(job.paths.stderr).splitlines() if x.strip()]
        last = lines[-1] if lines else ""
    again = "a rerun fails the same way until what it names is fixed" if kind == "input" \
        else "the same command resubmits it"
    return f"job {job_id} ended without a result ({state}{': ' + last if last else ''}); {again}. Log: " \
           f"{job.paths.stderr}"


def _tail(path, size=4096) -> str:
    """The end of a text file, or "" for anything else (a FIFO is never opened)."""
    try:
        if not Path(path).is_file():
            return ""
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _private(folder):
    """Refuse an OUT/slurm that another user can write: submitit runs its
    ``*_submitted.pkl`` inside the jobs, so what is there is code."""
    code = [p for p in folder.iterdir() if p.suffix in (".pkl", ".sh")] if folder.is_dir() else []
    for path in [folder] * folder.is_dir() + code:
        owner, st = path.lstat().st_uid, path.stat()  # a link: its own owner, its target's mode
        if owner != os.getuid() or st.st_uid != os.getuid() or st.st_mode & 0o022:
            who = "another user's" if os.getuid() not in (owner, st.st_uid) or owner != st.st_uid \
                else f"writable by others (mode {st.st_mode & 0o777:o})"
            raise StudyError(f"{path}: {who}: submitit runs what OUT/slurm holds inside the jobs, so it must be "
                             f"yours alone (chmod go-w), or give another --out")


def _read_jobs(out):
    path = Path(out, "jobs.json")
    if not path.exists():
        return {}
    try:
        jobs = json.loads(path.read_text()) if path.is_file() else None
        if isinstance(jobs, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in jobs.items()):
            return jobs
    except (OSError, ValueError):
        pass
    raise StudyError(f"{path}: not the job list this launcher writes (corrupt?); its jobs may still run: check "
                     "squeue, then remove the file and rerun (finished cells are kept)")


@contextmanager
def _locked(out):
    """One submission at a time per OUT: two runs would both find a cell
    unsubmitted. The lock is OUT itself, so that nothing is left behind."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def check(args, p):
    """The launcher's flags: with ``--launcher slurm`` only, and what they imply."""
    given = [k for k in FLAGS if getattr(args, k) is not None]
    if args.launcher == "local":
        if given:
            p.error(f"--{given[0].replace('_', '-')}: a --launcher slurm flag; add --launcher slurm, or leave it out")
        return
    for flag, bad in (("--jobs", args.jobs is not None), ("--print-commands", args.print_commands)):
        if bad:
            p.error(f"{flag}: the local launcher's; --launcher slurm submits every cell as a job "
                    "(--max-parallel: how many run at once)")
    missing = next((tool for tool in ("sbatch", "squeue", "scontrol", "srun") if not shutil.which(tool)), None)
    if missing:
        p.error(f"--launcher slurm: no {missing} here; run the study on a machine of the cluster, or use "
                "--launcher local")
    for key, default in FLAGS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    args.cpus_per_cell = args.cpus_per_cell or max(1, args.gpus_per_cell)
    args.threads = args.threads or args.cpus_per_cell
