"""The one launcher of the study (``norm-study.sh``) and the tables
(``reproduce.sh``): their shared flags, declared once with one vocabulary
(SLURM's own: nodes, GPUs per node, tasks per node, CPUs per task), one
``--seeds`` rule, one ``--`` split, one console error handler, the layout of
OUT, and the SLURM algorithm both run (:class:`Jobs`).

OUT's layout (``layout.Out``): ``jobs.json`` (the job ids on the cluster),
``slurm/`` (submitit's scripts, pickles and logs), and each command's own
work: the study's ``cells/<name>/``, a table's ``runs/<row>-seed<N>/``.
"""

import argparse
import logging
import re
import signal
import sys
from contextlib import contextmanager

from ..common.errors import PowerNormConfigError
from ..common.files import end_cleanly_on_sigterm
from ..common.flags import at_least
from . import slurm
from .layout import Out

MAX_SEED = 2 ** 32 - 1  # numpy's and fairseq's seeds are 32-bit


def seed(text):
    """``--seeds``' one rule, for every command: an integer from 1 to ``MAX_SEED``."""
    value = int(text)
    if not 1 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"--seeds must be from 1 to {MAX_SEED}, got {text}")
    return value


#: the SLURM flags of every launcher and their defaults (None: worked out from the others)
SLURM_FLAGS = {"partition": None, "account": None, "qos": None, "constraint": None, "exclude": None, "nodes": 1,
               "gpus_per_node": 0, "tasks_per_node": None, "cpus_per_task": None, "mem_per_node": None,
               "timeout_min": 240, "max_parallel": None, "sbatch": [], "no_wait": False}
#: sbatch's options the launcher sets itself (submitit's, or a flag above): ``--sbatch`` refuses them
OWN_SBATCH = frozenset(("job-name", "partition", "account", "qos", "constraint", "exclude", "nodes",
                        "ntasks-per-node", "gpus-per-node", "cpus-per-task", "mem", "time", "array", "dependency",
                        "output", "error", "open-mode", "signal", "comment"))
#: sbatch's options that would shape a job otherwise than the world size its runs are given (their workers'
#: ranks, GPUs and the batch per update come from the flags above): ``--sbatch`` refuses them too
SHAPE_SBATCH = frozenset(("ntasks", "ntasks-per-core", "ntasks-per-socket", "ntasks-per-gpu", "gres", "gpus",
                          "gpus-per-task", "gpus-per-socket", "cpus-per-gpu", "mem-per-cpu", "mem-per-gpu"))
#: flags of earlier versions of the study, and the one that replaced each
RENAMED = {"--gpus-per-cell": "--gpus-per-node", "--cpus-per-cell": "--cpus-per-task",
           "--mem-per-cell": "--mem-per-node"}


class _Renamed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: now {RENAMED[option_string]} (one vocabulary for norm-study.sh and "
                     "reproduce.sh: SLURM's own)")


def sbatch_option(text):
    """``--sbatch KEY=VALUE`` (or ``KEY`` alone, a switch such as ``exclusive``): (key, value or True)."""
    key, _, value = text.partition("=")
    key = key.strip().removeprefix("--")
    if not re.fullmatch(r"[a-z][a-z0-9-]*", key):
        raise argparse.ArgumentTypeError(f"{text!r}: not KEY=VALUE with an sbatch option's long name as KEY "
                                         "(e.g. mail-type=END)")
    if key in SHAPE_SBATCH:
        raise argparse.ArgumentTypeError(f"{key}: would shape the jobs otherwise than the runs' world size; use "
                                         "--nodes, --tasks-per-node, --gpus-per-node, --cpus-per-task, --mem-per-node")
    if key in OWN_SBATCH:
        flag = f"--{key}" if key.replace("-", "_") in SLURM_FLAGS else None  # one of the group's own
        raise argparse.ArgumentTypeError(f"{key}: set by the launcher" + (f"; use {flag}" if flag else
                                                                          " from its own flags"))
    return key, value if "=" in text else True


def add_flags(p, seeds, unit):
    """``--seeds`` (default ``seeds``), ``--launcher`` and the SLURM group, on parser ``p``; ``unit``: what
    one job runs, in the help ("cell", "training")."""
    p.add_argument("--seeds", nargs="+", type=seed, default=seeds, metavar="N",
                   help=f"integers from 1 to {MAX_SEED} (default: {' '.join(map(str, seeds))})")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help=f"where each {unit} runs: here, or as a SLURM job (submitit; the flags below)")
    s = p.add_argument_group("--launcher slurm")
    s.add_argument("--partition", help="the jobs' partition (default: the cluster's)")
    s.add_argument("--account", help="the account the jobs are charged to (sbatch --account; default: yours)")
    s.add_argument("--qos", help="the jobs' quality of service (sbatch --qos; default: the account's)")
    s.add_argument("--constraint", metavar="FEATURES", help="node features the jobs need (sbatch --constraint, "
                   "e.g. 'a100|h100')")
    s.add_argument("--exclude", metavar="NODES", help="nodes the jobs must not run on (sbatch --exclude)")
    s.add_argument("--nodes", type=at_least(1, "--nodes"), metavar="N", help=f"nodes per {unit} (default: 1)")
    s.add_argument("--gpus-per-node", type=at_least(0, "--gpus-per-node"), metavar="G",
                   help="GPUs per node (default: 0, CPU nodes); several train data-parallel, with --norm-sync batch")
    s.add_argument("--tasks-per-node", type=at_least(1, "--tasks-per-node"), metavar="T",
                   help="tasks per node, a fairseq worker each (default: one per GPU; 1 on CPU nodes); divides G")
    s.add_argument("--cpus-per-task", type=at_least(1, "--cpus-per-task"), metavar="C",
                   help="CPUs per task (default: 1, or one per GPU of the task)")
    s.add_argument("--mem-per-node", type=at_least(1, "--mem-per-node"), metavar="GB",
                   help="memory per node (default: the cluster's)")
    s.add_argument("--timeout-min", type=at_least(2, "--timeout-min"), metavar="M", help="a job's time limit, at "
                   "least 2 (SLURM warns a job 90 s before it) (default: 240); a job that reaches it requeues "
                   "itself and resumes from its checkpoint")
    s.add_argument("--max-parallel", type=at_least(1, "--max-parallel"), metavar="K",
                   help=f"{unit} jobs pending or running at once (default: no limit)")
    s.add_argument("--sbatch", action="append", type=sbatch_option, metavar="KEY=VALUE",
                   help="any other sbatch option, in every job script (repeatable; e.g. mail-type=END, "
                   "reservation=R, exclusive); one the flags above or the launcher set is refused")
    s.add_argument("--no-wait", action="store_true", default=None, help="submit and return; the same command "
                   "later collects")
    for old in RENAMED:
        p.add_argument(old, action=_Renamed, help=argparse.SUPPRESS)


def check_flags(args, p, one_node=False):
    """The SLURM flags: refused in one line without ``--launcher slurm``, their defaults set with it, and
    the cluster's client asked for (unless ``args.dry_run``); ``one_node``: a job is one task on one node
    (the study's cells). Whether it is SLURM."""
    given = [key for key in SLURM_FLAGS if getattr(args, key) is not None]
    if args.launcher != "slurm":
        if given:
            p.error(f"--{given[0].replace('_', '-')}: a --launcher slurm flag; add --launcher slurm, or leave it out")
        return False
    for key, default in SLURM_FLAGS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if one_node and (args.nodes, args.tasks_per_node or 1) != (1, 1):
        p.error("--nodes and --tasks-per-node: a cell is one task on one node (its GPUs train it data-parallel); "
                "leave them out")
    args.tasks_per_node = args.tasks_per_node or (1 if one_node else args.gpus_per_node or 1)
    if args.gpus_per_node % args.tasks_per_node:
        p.error(f"--tasks-per-node {args.tasks_per_node} does not divide --gpus-per-node {args.gpus_per_node}: "
                "each task's worker(s) take an equal share of a node's GPUs")
    args.cpus_per_task = args.cpus_per_task or max(1, args.gpus_per_node // args.tasks_per_node)
    if not getattr(args, "dry_run", False):
        slurm.check_tools(p)
        slurm.check_partition(p, args.partition, args.nodes)
    return True


def resources(args):
    """The sbatch parameters every job of a launcher shares (submitit's names)."""
    params = dict(time=args.timeout_min, cpus_per_task=args.cpus_per_task)
    params.update({k: v for k, v in (("partition", args.partition), ("account", args.account), ("qos", args.qos),
                                     ("constraint", args.constraint), ("exclude", args.exclude),
                                     ("mem", f"{args.mem_per_node}GB" if args.mem_per_node else None)) if v})
    if args.sbatch:
        params["additional_parameters"] = dict(args.sbatch)
    return params


@contextmanager
def heartbeat(prog, logs):
    """While the body runs, every ``progress.HEARTBEAT`` seconds a line per training under way:
    ``logs()`` gives {name: its train.log}, and each line says where its newest records put it."""
    import threading

    from .progress import HEARTBEAT, where

    stop, read = threading.Event(), {}  # each log read on from where the last beat stopped

    def beat():
        while not stop.wait(HEARTBEAT):
            for name, path in logs().items():
                line = where(path, read)
                if line:
                    print(f"{prog}: {name}: {line}", file=sys.stderr, flush=True)

    threading.Thread(target=beat, daemon=True).start()
    try:
        yield
    finally:
        stop.set()


def task_name(array, name):
    """The name a task of job array ``array`` is given in the queue: the array's and what it runs."""
    return f"{array}-{name}"


def parse_args(p, argv):
    """The command's flags, and fairseq-train's after ``--`` (``args.fairseq``): an unknown flag before it
    is refused, never taken for fairseq's."""
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = p.parse_args(ours)
    args.fairseq = theirs
    return args


def quiet(verbose):
    """fairseq's log format on the console: its INFO lines with ``verbose``,
    else warnings only; each run's own log holds everything."""
    import warnings

    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO if verbose else logging.WARNING,
                        stream=sys.stderr, force=True)
    # fairseq's --eval-tokenized-bleu scores tokenized text on purpose; sacreBLEU warns of it all the same
    logging.getLogger("sacrebleu").setLevel(logging.ERROR)
    if not verbose:
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)


def run(p, args, body, errors, kept):
    """``body()`` under the one console handler of the launchers: Ctrl-C, SIGTERM and SIGHUP end it with
    one closing line (``kept()``: what is kept, and how the same command goes on), an error of ``errors``
    (or the plugin's and the cluster's) with ``prog: error: ...``."""
    end_cleanly_on_sigterm()
    try:
        body()
    except KeyboardInterrupt:
        p.exit(130, f"{p.prog}: interrupted; {kept()}\n")
    except SystemExit as end:  # SIGTERM or SIGHUP (end_cleanly_on_sigterm): the same closing line as Ctrl-C
        if end.code in (128 + signal.SIGTERM, 128 + signal.SIGHUP):
            p.exit(end.code, f"{p.prog}: terminated; {kept()}\n")
        raise
    except (*errors, slurm.SlurmError, PowerNormConfigError) as err:
        p.error(str(err))


class Jobs:
    """The SLURM algorithm of every launcher: under OUT's lock, read the job
    ids (``jobs.json``) and ask the queue which of them are live; the caller
    decides what to submit (never what is live or finished, again what ended
    without its result), :meth:`submit` writes each id at once; then
    :meth:`wait` polls the queue, saying why a job pends where SLURM gives a
    reason beyond its turn, and hands each piece of work back as it ends.
    ``steps``: jobs.json maps a name to {step: id} (a table's train and score
    jobs) rather than to one id (the study's cells)."""

    def __init__(self, out, steps, prog):
        self.out, self.steps, self.prog = Out(out), steps, prog
        self.ids, self.live = {}, {}

    @contextmanager
    def submitting(self):
        """OUT's lock held, ``ids`` read and ``live`` asked of the queue."""
        slurm.private(self.out.slurm)
        with slurm.locked(self.out.root):
            self.ids = slurm.read_jobs(self.out.root, steps=self.steps)
            self.look()
            yield self

    def look(self):
        """{job id: state} of OUT's pending and running jobs, asked anew."""
        self.live = slurm.live(self.out.slurm)
        return self.live

    def submit(self, params, calls, what, names, step=None):
        """Submit ``calls`` (``params`` with ``array_parallelism``: one job array), one per name of
        ``names``, and record their ids (under ``step``) at once: an interrupted submission loses none."""
        ids = slurm.submit(self.out.slurm, params, calls, what)
        for name, job_id in zip(names, ids):
            if step is None:
                self.ids[name] = job_id
            else:
                self.ids.setdefault(name, {})[step] = job_id
        if ids:
            slurm.write_jobs(self.out.root, self.ids)
        if "array_parallelism" in params:  # each task named for what it runs, so that squeue tells them apart
            for name, job_id in zip(names, ids):
                why = slurm.rename(job_id, task_name(params["job_name"], name))
                if why:
                    print(f"{self.prog}: job {job_id} keeps the array's name {params['job_name']} (scontrol: "
                          f"{why})", file=sys.stderr)
        return ids

    def cancel(self, job_ids, wait=False):
        """Cancel the jobs; ``wait``: until the queue has none of them (a minute at most)."""
        import time

        job_ids = [j for j in job_ids if j]
        for job_id in job_ids:
            slurm.cancel(job_id)
        deadline = time.time() + 60
        while wait and set(job_ids) & set(self.look()) and time.time() < deadline:
            time.sleep(1)

    def said(self, what):
        """One line of what a run found live and submitted."""
        print(f"{self.prog}: {what}; their logs: {self.out.slurm}", file=sys.stderr)

    def wait(self, pending, ended):
        """Yield (name, outcome) as each of ``pending`` ({name: work}) ends: ``ended(name, work)`` gives its
        outcome once it has one, else None; the queue is asked anew before each round."""
        delay, said = slurm.polls(), set()
        while pending:
            slurm.pending(self.out.slurm, said)
            self.look()
            changed = False
            for name, work in list(pending.items()):
                outcome = ended(name, work)
                if outcome is None:
                    continue
                del pending[name]
                changed = True
                yield name, outcome
            if pending:
                delay(changed)

    def cause(self, job_id, record="", log=None):
        """Why a job ended without its result: the cause its task wrote (``record``), else the last line of
        ``log`` that is not SLURM's own, else of the job's log."""
        return record or (slurm.cause(log) if log else "") or slurm.cause(slurm.log(self.out.slurm, job_id))
