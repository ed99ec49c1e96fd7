"""``--launcher slurm``: each run's training is one SLURM job of ``--nodes`` x
``--tasks-per-node`` tasks, a fairseq worker per task, and its scoring a job
that depends on it (``afterok``), through the one launcher's algorithm
(:class:`..launcher.Jobs`: OUT's lock, ``OUT/jobs.json``, the queue, the wait).

Each worker's rank and the rendezvous come from SLURM's environment: fairseq's
own SLURM start (``--distributed-port``) where it serves, a task per GPU or a
task per node; the same variables passed explicitly where it cannot (CPU
tasks, which its start divides by the GPU count; several tasks of several
GPUs each on a node). The first task runs ``train.sh`` (its log, its
command); the others run the fairseq-train command ``train.sh --dry-run``
prints for them, each logging to ``worker-<rank>.log`` in the run's directory.
"""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import submitit

from ...common.files import end_cleanly_on_sigterm, last_line
from .. import slurm
from ..launcher import Jobs, heartbeat, resources, task_name
from ..layout import Out
from . import runs
from .runs import directory, name, scored, trained

class Train(slurm.Resumable):
    """A run's training, in each task of its job; requeued and resumed from
    its last checkpoint when pre-empted or near its time limit."""

    def __call__(self, job):
        self.started(Path(job["run"], "checkpoint_last.pt"), job["timeout_min"])
        end_cleanly_on_sigterm()  # scancel's SIGTERM ends the training now
        flags, env = worker(job, dict(os.environ))
        command = job["command"] + flags
        rank = int(env.get("SLURM_PROCID", "0"))
        if rank == 0:
            why = runs.call(command, "training", env)
        else:
            # SLURM's warning reaches every process of the job, its workers too; the first task requeues it
            warned = []
            signal.signal(signal.SIGUSR2, lambda *_: warned.append(True))
            cut = command.index("--")
            dry = subprocess.run(command[:cut] + ["--dry-run"] + command[cut:], capture_output=True, text=True,
                                 env=env, cwd=runs.ROOT)
            with open(Path(job["run"], f"worker-{rank}.log"), "a") as log:
                why = runs.call(shlex.split(dry.stdout), "training", env, log) if dry.returncode == 0 \
                    else f"train.sh --dry-run failed: {dry.stderr.strip()}"
            if why and warned:  # the worker ended with the warning: the requeue ends this task
                time.sleep(300)
        if why:
            if rank == 0:  # the cause, where the launcher reads it (srun's own last line names none)
                runs.failed(job["run"], why)
            raise RuntimeError(why)

    def checkpoint(self, job):
        return super().checkpoint(job) if self.requeue(f"run {job['name']}") else None


class Score(submitit.helpers.Checkpointable):
    """A run's scoring; a pre-empted one is requeued and starts again."""

    def __call__(self, job):
        end_cleanly_on_sigterm()
        why = runs.call(job["command"], "scoring")
        if why:
            runs.failed(job["run"], why)
            raise RuntimeError(why)


def worker(job, env, hosts=None):
    """The distributed flags of this task's fairseq worker(s), and their environment (``hosts``: the job's
    nodes, asked of scontrol when not given)."""
    if job["world"] == 1:
        return [], env
    port = 20000 + int(env["SLURM_JOB_ID"]) % 40000  # the same in every task of the job, and each requeue
    per_task = job["gpus_per_task"]
    if per_task and (per_task == 1 or job["tasks_per_node"] == 1):
        return ["--distributed-port", str(port)], env  # fairseq's SLURM start: rank, device and rendezvous
    hosts = hosts or subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                                    capture_output=True, text=True, check=True).stdout.split()
    flags = ["--distributed-init-method", f"tcp://{hosts[0]}:{port}",
             "--distributed-rank", str(int(env["SLURM_PROCID"]) * max(per_task, 1))]
    if not per_task:  # a CPU worker per task, over gloo (fairseq's DDP asks for a device; its legacy one does not)
        return flags + ["--distributed-no-spawn", "--device-id", "0", "--distributed-backend", "gloo",
                        "--ddp-backend", "legacy_ddp"], env
    # several tasks of several GPUs each on a node: this task's GPUs, fairseq spawning a worker on each
    local = int(env["SLURM_LOCALID"])
    visible = env.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(job["gpus_per_node"])))).split(",")
    return flags, {**env, "CUDA_VISIBLE_DEVICES": ",".join(visible[local * per_task:(local + 1) * per_task])}


def shape(args):
    """(workers in all, GPUs per task) of a training job."""
    per_task = args.gpus_per_node // args.tasks_per_node
    return args.nodes * args.tasks_per_node * max(per_task, 1), per_task


def train_job(args, row, seed):
    world, per_task = shape(args)
    run = directory(args, row, seed)
    params = dict(job_name=f"reproduce-{args.table}", nodes=args.nodes, ntasks_per_node=args.tasks_per_node,
                  **resources(args))
    if args.gpus_per_node:
        params["gpus_per_node"] = args.gpus_per_node
    job = dict(name=name(row, seed), run=str(run), timeout_min=args.timeout_min, world=world, gpus_per_task=per_task,
               tasks_per_node=args.tasks_per_node, gpus_per_node=args.gpus_per_node,
               command=runs.train_command(args, row, seed, per_task, world))
    return params, Train(), job


def score_job(args, row, seed, after=None):
    params = dict(job_name=f"reproduce-{args.table}-{name(row, seed)}-score", nodes=1, ntasks_per_node=1,
                  **resources(args))
    if args.gpus_per_node:
        params["gpus_per_node"] = 1
    if after:
        params["dependency"] = f"afterok:{after}"
    job = dict(name=name(row, seed), run=str(directory(args, row, seed)),
               command=runs.score_command(args, row, seed, args.gpus_per_node > 0))
    return params, Score(), job


def dry_run(args, todo):
    """Every job's script and command, and the fairseq-train command of each training's workers (its
    batch, update frequency and distributed flags), submitting nothing."""
    folder = Out(args.out).slurm
    world, per_task = shape(args)
    flags, _ = worker({"world": world, "gpus_per_task": per_task, "tasks_per_node": args.tasks_per_node,
                       "gpus_per_node": args.gpus_per_node},
                      {"SLURM_JOB_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, hosts=["FIRST_NODE"])
    placeholders = {"--distributed-rank": "RANK", "--distributed-port": "PORT"}
    flags = [placeholders.get(before, word.replace(":20000", ":PORT"))
             for before, word in zip([None, *flags], flags)]
    each = " " + shlex.join(flags) if flags else ""
    for row, seed in todo:
        for params, fn, job in (train_job(args, row, seed), score_job(args, row, seed, after="TRAINING_JOB_ID")):
            training = isinstance(fn, Train)
            runs_this = f"# whose workers run (with SLURM's rank and first node):\n" \
                        f"{runs.fairseq_command(args, row, seed, per_task, world)}{each}\n" if training else ""
            if training:  # submitted as one array, each of its tasks named as here (Jobs.submit)
                params = {**params, "job_name": task_name(params["job_name"], job["name"])}
            print(f"# {job['name']}, {'training' if training else 'scoring'}\n"
                  f"{slurm.script(folder, params)}\n# each task runs:\n"
                  f"{shlex.join(job['command'])}\n{runs_this}")


def run(args, todo):
    """Submit what is neither running nor finished (the trainings as one job
    array, ``--max-parallel`` of them at once; each scoring after its
    training), then, unless --no-wait, wait; (row, seed) of the runs that
    ended without their score."""
    jobs = Jobs(args.out, steps=True, prog="reproduce")
    waiting, train, score = 0, [], []  # runs to train; (run, the training it waits for) to score
    with jobs.submitting():
        for row, seed in todo:
            key = name(row, seed)
            ids = jobs.ids.get(key, {})
            if ids.get("train") in jobs.live and not Path(directory(args, row, seed), runs.SETTINGS).exists():
                print(f"reproduce: {key}: its directory was removed while job {ids['train']} trained it; the job "
                      "is cancelled", file=sys.stderr)
                jobs.cancel([ids["train"], ids.get("score")], wait=True)
            if ids.get("train") not in jobs.live:
                runs.start_afresh(args, row, seed)
            done = trained(directory(args, row, seed))
            if done or ids.get("train") in jobs.live:
                if ids.get("score") in jobs.live:
                    waiting += 1
                else:  # trained (a scoring job that ended without its score), or waiting for its training
                    score.append(((row, seed), None if done else ids["train"]))
                continue
            if "train" in ids:
                print(f"reproduce: {key}: job {ids['train']} ended without finishing its training; resubmitted",
                      file=sys.stderr)
            if ids.get("score") in jobs.live:
                jobs.cancel([ids["score"]])  # waiting on a training that will never succeed
            train.append((row, seed))
        recorded = [runs.record(args, row, seed) for row, seed in train + [r for r, _ in score]]
        if train:
            made = [train_job(args, row, seed) for row, seed in train]
            params = {**made[0][0], "array_parallelism": args.max_parallel or len(train)}  # the same for each
            try:
                ids = jobs.submit(params, [(fn, (job,)) for _, fn, job in made], "the trainings",
                                  [name(row, seed) for row, seed in train], step="train")
            except slurm.SlurmError:
                for path in recorded:  # a refused submission leaves no run behind
                    if path:
                        path.unlink(missing_ok=True)
                        _remove_if_empty(path.parent)
                raise
            score += [((row, seed), job_id) for (row, seed), job_id in zip(train, ids)]
        for (row, seed), after in score:
            params, fn, job = score_job(args, row, seed, after)
            jobs.submit(params, [(fn, (job,))], f"{job['name']}'s scoring", [name(row, seed)], step="score")
    jobs.said(f"{waiting} run(s) already pending or running on the cluster, {len(train)} training(s) and "
              f"{len(score)} scoring(s) submitted")
    if args.no_wait:
        return []
    return _wait(args, jobs, todo)


def _remove_if_empty(directory):
    try:
        directory.rmdir()
    except OSError:
        pass


def _wait(args, jobs, todo):
    """(row, seed) of the runs that ended without their score, once every run of ``todo`` has ended."""
    failures = []

    def ended(key, run):
        row, seed = run
        run_dir, ids, live = directory(args, row, seed), jobs.ids[key], jobs.live
        done = trained(run_dir)
        if ids.get("train") in live and not Path(run_dir, runs.SETTINGS).exists():  # removed meanwhile
            jobs.cancel([ids["train"], ids.get("score")], wait=True)
            runs.failed(run_dir, f"its directory was removed while job {ids['train']} trained it; the job was "
                                 "cancelled, and the same command trains the run again from scratch")
            print(f"reproduce: {key}: its directory was removed while it trained; job {ids['train']} cancelled; "
                  "the same command trains it again from scratch", file=sys.stderr)
            return "failed"
        if done and scored(row, run_dir):
            print(f"reproduce: {key}: scored", file=sys.stderr)
            return "scored"
        if ids.get("train") not in live and not done:
            if ids["score"] in live:
                jobs.cancel([ids["score"]])  # a failed training never runs its scoring
            _failed(jobs, run_dir, "training", ids["train"], Path(run_dir, "train.log"))
            return "failed"
        if ids["score"] not in live and done:
            _failed(jobs, run_dir, "scoring", ids["score"], None)
            return "failed"
        return None

    waiting = {name(r, s): (r, s) for r, s in todo}

    def training():  # the runs still pending whose training has begun and not ended
        return {key: log for key, (r, s) in list(waiting.items())
                if (log := Path(directory(args, r, s), "train.log")).exists() and not trained(log.parent)}

    with heartbeat("reproduce", training):
        for key, outcome in jobs.wait(waiting, ended):
            if outcome == "failed":
                failures.append(key)
    return [(row, seed) for row, seed in todo if name(row, seed) in failures]


def _failed(jobs, run_dir, what, job_id, log):
    """Record and say why a run's job ended without its result: the cause its task wrote (failure.txt,
    removed when the run was submitted), else the last line of its log that is not SLURM's own."""
    last = jobs.cause(job_id, last_line(Path(run_dir, runs.FAILURE)) or (last_line(log) if log else ""))
    why = f"{what} job {job_id} ended ({slurm.state(job_id)}){': ' + last if last else ''}"
    runs.failed(run_dir, why)
    print(f"reproduce: {Path(run_dir).name}: {why}; the same command resubmits it", file=sys.stderr)
