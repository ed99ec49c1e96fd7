"""SLURM through submitit, for every launcher of the plugin (the study's
cells, the paper's runs): submission, the jobs' state, the requeue of a
pre-empted job, and ``OUT/jobs.json``.

A launcher keeps its job ids in ``OUT/jobs.json`` and submitit's job scripts,
pickles and logs in ``OUT/slurm/``. Before submitting, it asks the cluster
(:func:`live`) which of its jobs are pending or running, and submits only what
is neither running nor finished, under :func:`locked` so that two reruns never
submit the same work twice. A job that reaches its time limit or is
pre-empted gets submitit's signal, requeues itself and resumes from its
checkpoint (:class:`Resumable`).
"""

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from ..common.files import atomic_path
from .layout import Out

#: what a launcher needs of SLURM's client on this machine
TOOLS = ("sbatch", "squeue", "scontrol", "scancel", "srun")
#: seconds between two looks at the queue: the first, and the most it grows to while nothing changes
#: (``POWERNORM_SLURM_POLL`` seconds, if set: a cluster whose jobs are short, or this project's tests)
POLL = (2.0, 30.0)
WARNED = 90 + 60  # submitit's warning comes 90 s before the time limit (--signal=USR2@90); a minute's slack


class SlurmError(ValueError):
    """What the cluster refused, or a launcher's state it cannot use; one line."""


class Resumable(submitit.helpers.Checkpointable):
    """A job that resumes from ``checkpoint`` (its ``checkpoint_last.pt``) when
    requeued. SLURM signals a job 90 s before its time limit (submitit's
    ``--signal=USR2@90``), and a pre-empting scheduler may too: submitit then
    calls :meth:`checkpoint` in the job's first task, which requeues the job
    with the same arguments. A job that timed out without saving a checkpoint
    since it started ends instead of requeuing for ever."""

    def started(self, checkpoint, timeout_min):
        self._started, self._checkpoint, self._timeout_min = time.time(), Path(checkpoint), timeout_min
        self._mark = _mark(self._checkpoint)

    def requeue(self, name) -> bool:
        """Whether to requeue; says why not, naming the job ``name``. A signal in the job's last
        ``WARNED`` seconds is its time limit's warning (however short the limit), else a pre-emption."""
        timed_out = time.time() - self._started >= self._timeout_min * 60 - WARNED
        if timed_out and _mark(self._checkpoint) == self._mark:
            print(f"{name}: no checkpoint saved in the {self._timeout_min} minutes this job had; not requeued "
                  "(give a longer --timeout-min)", file=sys.stderr)
            return False
        return True

    def seconds(self):
        return time.time() - self._started


def _mark(path):
    return path.stat().st_mtime_ns if path.exists() else None


def check_tools(p):
    """``p.error`` in one line where this machine has no SLURM client."""
    missing = next((tool for tool in TOOLS if not shutil.which(tool)), None)
    if missing:
        p.error(f"--launcher slurm: no {missing} here; run this on a machine of the cluster, or use "
                "--launcher local")


def submit(folder, params, calls, what):
    """Submit each ``(function, args)`` of ``calls`` as a job with submitit's
    SLURM ``params`` (one job array when ``params`` has ``array_parallelism``);
    their job ids. What sbatch refuses raises one line naming ``what``, and
    leaves nothing behind in ``folder``."""
    if not calls:
        return []
    # requeues after a time limit: as many as it takes, while the job saves checkpoints (Resumable)
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=1000)
    executor.update_parameters(**params, comment=owner(folder))
    made = not executor.folder.exists()
    executor.folder.mkdir(parents=True, exist_ok=True)
    os.chmod(executor.folder, executor.folder.stat().st_mode & ~0o022)  # its pickles run in the jobs: ours alone
    before = set(executor.folder.iterdir())
    # what submitit writes here, and (SLURM passes sbatch's umask on) what the jobs write: no one else's to change
    umask = os.umask(0o022)
    os.umask(umask | 0o022)
    try:
        with redirect_stderr(io.StringIO()):  # submitit prints sbatch's refusal; we say it once
            if "array_parallelism" in params:
                with executor.batch():
                    jobs = [executor.submit(fn, *args) for fn, args in calls]
            else:
                jobs = [executor.submit(fn, *args) for fn, args in calls]
    except (FailedJobError, FailedSubmissionError, subprocess.SubprocessError, OSError) as err:
        for path in set(executor.folder.iterdir()) - before:  # the refused submission's script and pickles
            path.unlink()
        if made and not any(executor.folder.iterdir()):
            executor.folder.rmdir()
        lines = [x for x in str(err).splitlines() if "error" in x.lower()] or str(err).splitlines() or [""]
        why = lines[-1].strip().removeprefix("sbatch: error: ")
        raise SlurmError(f"--launcher slurm: sbatch refused {what}: {why}") from None
    finally:
        os.umask(umask)
    return [job.job_id for job in jobs]


def script(folder, params):
    """The job script :func:`submit` would give sbatch for ``params`` (submitit's own text), submitting nothing."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    return _make_sbatch_string(command=command, folder=folder, comment=owner(folder), **params)


def owner(folder):
    """The comment every job of a launcher's OUT/slurm carries: its jobs, and no copy's (``cp -a OUT``
    keeps jobs.json, whose ids name the original's jobs)."""
    import hashlib

    return "powernorm:" + hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:16]


def queue(folder):
    """{job id: (state, reason)} of this user's pending and running jobs submitted from ``folder`` (an
    OUT/slurm), array tasks one by one; a job of another folder, a copy's original included, is not there."""
    try:
        out = subprocess.run(["squeue", "--me", "--array", "--noheader", "--format", "%i|%T|%k|%r"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmError(f"--launcher slurm: squeue did not answer ({err}); is this a machine of the cluster?") \
            from None
    if out.returncode:
        raise SlurmError(f"--launcher slurm: squeue: {out.stderr.strip() or out.returncode}")
    mine = owner(folder)
    jobs = (line.split("|", 3) for line in out.stdout.splitlines() if line.count("|") >= 3)
    return {job: (state, reason) for job, state, comment, reason in jobs if comment == mine}


def live(folder):
    """{job id: state} of :func:`queue`."""
    return {job: state for job, (state, _) in queue(folder).items()}


#: why a pending job waits, when it can never start (squeue's reason)
NEVER = ("PartitionNodeLimit", "PartitionConfig", "PartitionTimeLimit", "ReqNodeNotAvail", "BadConstraints",
         "InvalidAccount", "InvalidQOS", "PartitionDown", "PartitionInactive", "AssocMaxJobsLimit")


def pending(folder, said):
    """Say once, per job and reason, why a job of ``folder`` is pending where SLURM gives a reason beyond
    waiting its turn; ``said``: the (job, reason) pairs said so far."""
    for job, (state, reason) in queue(folder).items():
        if state == "PENDING" and reason not in ("None", "Priority", "Dependency", "BeginTime", "Resources",
                                                  "JobArrayTaskLimit", "") and (job, reason) not in said:
            said.add((job, reason))
            never = " (it can never start as it is: cancel it, and give other SLURM flags)" if reason in NEVER else ""
            print(f"slurm: job {job} pending: {reason}{never}", file=sys.stderr)


def check_partition(p, partition, nodes):
    """``p.error`` in one line where the partition (the cluster's default: None) has fewer nodes than a job
    asks for: SLURM would keep it pending for ever."""
    try:
        out = subprocess.run(["sinfo", "--noheader", "--format", "%P|%D"], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return  # the submission says what is wrong
    if out.returncode:
        return  # the submission says what is wrong
    sizes = {}
    for line in out.stdout.split():
        name, count = line.split("|")
        default = name.endswith("*")
        name = name.rstrip("*")
        sizes[name] = sizes.get(name, 0) + int(count)
        if default:
            sizes[None] = name
    name = partition or sizes.get(None)
    if name in sizes and sizes[name] < nodes:
        p.error(f"--nodes {nodes}: partition {name} has {sizes[name]} node(s); a job of {nodes} would pend for ever")


def state(job_id):
    """A job's state as ``scontrol`` has it (COMPLETED, FAILED, CANCELLED, ...), or "ended" once forgotten."""
    out = subprocess.run(["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True)
    return next((w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("JobState=")), "ended")


def cancel(job_id):
    subprocess.run(["scancel", job_id], capture_output=True)


def rename(job_id, name):
    """Give a task of a job array a name of its own (what squeue shows; the array's tasks share one):
    None, or why scontrol refused."""
    done = subprocess.run(["scontrol", "update", f"JobId={job_id}", f"JobName={name}"], capture_output=True,
                          text=True, timeout=60)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["refused"])[-1]


def log(folder, job_id):
    """The stderr log submitit keeps for the job (its first task)."""
    return submitit.SlurmJob(folder=folder, job_id=job_id).paths.stderr


def cause(path):
    """The last line of a job's log that is not srun's or slurmstepd's (which say only that a task
    failed), else the last line; "" without a log."""
    from ..common.files import tail

    lines = [line.strip() for line in tail(path, 65536).splitlines() if line.strip()]
    ours = [line for line in lines if not line.startswith(("srun:", "slurmstepd:"))]
    return (ours or lines or [""])[-1]


def private(folder):
    """Refuse an OUT/slurm that another user can write: submitit runs its
    ``*_submitted.pkl`` inside the jobs, so what is there is code."""
    code = [p for p in folder.iterdir() if p.suffix in (".pkl", ".sh")] if folder.is_dir() else []
    for path in [folder] * folder.is_dir() + code:
        owner, st = path.lstat().st_uid, path.stat()  # a link: its own owner, its target's mode
        if owner != os.getuid() or st.st_uid != os.getuid() or st.st_mode & 0o022:
            who = "another user's" if os.getuid() not in (owner, st.st_uid) or owner != st.st_uid \
                else f"writable by others (mode {st.st_mode & 0o777:o})"
            raise SlurmError(f"{path}: {who}: submitit runs what OUT/slurm holds inside the jobs, so it must be "
                             f"yours alone (chmod go-w), or give another --out")


def _job_ids(value):
    return isinstance(value, str) or isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def read_jobs(out, steps):
    """``OUT/jobs.json``: {name: job id} (``steps`` False: the study's), or {name: {step: job id}}
    (``steps`` True: a table's); {} before the first submission. Another shape is one line."""
    path = Out(out).jobs
    if not path.exists():
        return {}
    try:
        jobs = json.loads(path.read_text()) if path.is_file() else None
        if isinstance(jobs, dict) and all(isinstance(k, str) and _job_ids(v) and isinstance(v, dict) == steps
                                          for k, v in jobs.items()):
            return jobs
    except (OSError, ValueError):
        pass
    raise SlurmError(f"{path}: not the job list this launcher writes (another command's, or corrupt?); its jobs "
                     "may still run: check squeue, then remove the file and rerun (finished work is kept), or give "
                     "another --out")


def write_jobs(out, jobs):
    with atomic_path(Out(out).jobs) as tmp:
        Path(tmp).write_text(json.dumps(jobs, indent=1))


@contextmanager
def locked(out):
    """One submission at a time per OUT: two runs would both find work
    unsubmitted. The lock is OUT itself (``filelock``'s lock of a descriptor), so that nothing is left
    behind."""
    from filelock import lock_descriptor

    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        lock_descriptor(fd)
        yield
    finally:
        os.close(fd)


def polls():
    """Sleep between looks at the queue, longer while nothing changes: ``delay = polls(); delay(changed)``."""
    given = os.environ.get("POWERNORM_SLURM_POLL", "").strip()
    try:
        most = float(given) if given else POLL[1]
    except ValueError:
        most = float("nan")
    if not most >= 1:  # NaN too
        raise SlurmError(f"POWERNORM_SLURM_POLL={given}: the most seconds between two looks at the queue, >= 1")
    first = min(POLL[0], most)
    state = {"delay": first}

    def wait(changed):
        state["delay"] = first if changed else min(most, state["delay"] * 1.5)
        time.sleep(state["delay"])
    return wait
