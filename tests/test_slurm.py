"""The SLURM launchers on a real one-node cluster (``support/slurm.py``):
the study's (``norm-study.sh --launcher slurm``: a job array) and the paper's
table (``reproduce.sh --launcher slurm``: a training job of two workers and a
scoring job after it, per run), each with a job cancelled and one pre-empted
mid-training, and reruns that resubmit only what ended without a result."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch

from support import BIN, ROOT, TINY, refused_in_process, slurm, stand_ins
from test_faults import malicious_checkpoint
from test_study import demo  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow
#: 2 placements x 2 norms; long enough (40 short epochs, a checkpoint each) to stop mid-training
GRID = ["--task", "classification", "--lrs", "0.1", "--depths", "1", "--widths", "32", "--norms", "ln", "pn",
        "--placements", "pre", "post", "--max-epochs", "40", "--log-interval", "20", "--launcher", "slurm",
        "--partition", "study", "--cpus-per-task", "1", "--mem-per-node", "1", "--max-parallel", "2",
        "--timeout-min", "10", "--sbatch", "mail-type=NONE"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    env = slurm.start(root)
    yield env
    slurm.stop(root)


def slurm_args(monkeypatch, argv):
    """The study's checked flags with ``--launcher slurm``, as on a machine of a cluster (its client on PATH)."""
    from powernorm_fairseq.cli import slurm as launcher
    from powernorm_fairseq.cli.study.options import check, parse_args, parser

    monkeypatch.setattr(launcher.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    p = parser()
    args = parse_args(p, ["--launcher", "slurm", *argv])
    check(args, p)
    return args


def test_the_queue_is_looked_at_every_2_s_and_less_often_while_nothing_changes(monkeypatch):
    """Up to every 30 s, or POWERNORM_SLURM_POLL seconds; a value that is not one is one line."""
    from powernorm_fairseq.cli import slurm as launcher

    slept = []
    monkeypatch.setattr(launcher.time, "sleep", slept.append)
    for cap, most in ((None, 30), ("5", 5), ("1", 1)):
        monkeypatch.delenv("POWERNORM_SLURM_POLL") if cap is None else monkeypatch.setenv("POWERNORM_SLURM_POLL", cap)
        slept.clear()
        delay = launcher.polls()
        for changed in [False] * 12 + [True]:
            delay(changed)
        assert slept[0] == min(3, most) and max(slept) == most and slept[-1] == min(2, most), (cap, slept)
    for bad in ("soon", "0.5", "nan"):
        monkeypatch.setenv("POWERNORM_SLURM_POLL", bad)
        with pytest.raises(launcher.SlurmError, match=f"POWERNORM_SLURM_POLL={bad}: the most seconds between"):
            launcher.polls()


def test_the_launcher_flags_are_checked_before_anything_is_written(demo, tmp_path, capsys,  # noqa: F811
                                                                   monkeypatch):
    from powernorm_fairseq.cli import study as norm_study
    from powernorm_fairseq.cli.study.grid import cells, train_argv
    from powernorm_fairseq.cli.study.out import settings

    from powernorm_fairseq.cli.launcher import SLURM_FLAGS
    from powernorm_fairseq.cli.reproduce.options import parser as table_parser
    from powernorm_fairseq.cli.study.options import parser

    # every flag of each command's slurm group is one the local launcher refuses and the slurm one defaults,
    # the same flags in both, with the same help and the same --seeds rule
    for p in (parser(), table_parser()):
        group = next(g for g in p._action_groups if g.title == "--launcher slurm")
        assert {a.dest for a in group._group_actions} == set(SLURM_FLAGS)
        seeds = p._option_string_actions["--seeds"]
        assert seeds.type.__name__ == "seed" and seeds.type.__module__ == "powernorm_fairseq.cli.launcher"
    out = tmp_path / "s"
    base = ["--task", "classification", "--lrs", "0.1", "--depths", "1", "--widths", "32", "--norms", "ln",
            "--max-update", "2", "--data", str(demo), "--out", str(out)]
    for flags, path, message in (
            (["--partition", "gpu"], None, "--partition: a --launcher slurm flag; add --launcher slurm"),
            (["--gpus-per-node", "2"], None, "--gpus-per-node: a --launcher slurm flag"),
            (["--gpus-per-cell", "2"], None, "--gpus-per-cell: now --gpus-per-node (one vocabulary"),
            (["--launcher", "slurm", "--nodes", "2"], None, "--nodes and --tasks-per-node: a cell is one task on one "
             "node"),
            (["--seeds", "0"], None, "--seeds must be from 1 to 4294967295, got 0"),
            (["--launcher", "slurm", "--jobs", "2"], None, "--jobs: the local launcher's; --launcher slurm submits"),
            (["--launcher", "slurm", "--print-commands"], None, "--print-commands: the local launcher's"),
            (["--launcher", "slurm"], str(tmp_path), "--launcher slurm: no sbatch here; run this on a machine "
             "of the cluster, or use --launcher local"),
            # SLURM warns a job 90 s before its limit: a 1-minute job would be warned at its start, and requeued
            (["--launcher", "slurm", "--timeout-min", "1"], None, "--timeout-min must be >= 2, got 1")):
        with monkeypatch.context() as patch:
            if path:
                patch.setenv("PATH", path)
            with pytest.raises(SystemExit) as end:
                norm_study.main([*base, *flags])
        error = capsys.readouterr().err.strip().splitlines()
        assert end.value.code == 2 and len(error) == 1 and message in error[0], error
        assert not out.exists()
    # what the launcher reads from OUT: a job list it cannot read, and an OUT/slurm others could plant code in
    from powernorm_fairseq.cli import slurm as launcher
    from powernorm_fairseq.cli.slurm import SlurmError

    out.mkdir()
    (out / "jobs.json").write_text('{"a": ')
    with pytest.raises(SlurmError, match=f"^{out}/jobs.json: not the job list this launcher writes"):
        launcher.read_jobs(out, steps=False)
    (out / "jobs.json").write_text('{"ln-seed1": "123"}')  # the study's list, where a table's is read: one line
    assert launcher.read_jobs(out, steps=False) == {"ln-seed1": "123"}
    with pytest.raises(SlurmError, match=f"^{out}/jobs.json: not the job list this launcher writes .another "
                                         "command's, or corrupt.."):
        launcher.read_jobs(out, steps=True)
    (out / "slurm").mkdir(mode=0o777)
    os.chmod(out / "slurm", 0o777)
    with pytest.raises(SlurmError, match=r"slurm: writable by others \(mode 777\): submitit runs what OUT/slurm holds"):
        launcher.private(out / "slurm")
    os.chmod(out / "slurm", 0o755)
    (out / "slurm" / "x_submitted.pkl").write_bytes(b"")
    os.chmod(out / "slurm" / "x_submitted.pkl", 0o666)
    with pytest.raises(SlurmError, match="x_submitted.pkl: writable by others"):
        launcher.private(out / "slurm")
    shutil.rmtree(out)
    # N > 1 GPUs: fairseq's data-parallel training in the cell, its batch statistics over every worker's batch
    args = slurm_args(monkeypatch, [*base, "--gpus-per-node", "2"])
    argv = train_argv(args, cells(args)[0], out)
    assert argv[argv.index("--distributed-world-size") + 1] == "2" and argv[argv.index("--norm-sync") + 1] == "batch"
    assert (args.cpus_per_task, args.threads, settings(args)["workers_per_cell"]) == (2, 2, 2)
    assert "--distributed-world-size" not in train_argv(args.__class__(**{**vars(args), "gpus_per_node": 1}),
                                                        cells(args)[0], out)


def until(what, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.2)  # each look runs squeue or scontrol: a process and a call to the controller
    raise AssertionError(f"timed out waiting for {what.__doc__}")


def squeue(env, *flags):
    return subprocess.run(["squeue", "--noheader", "--array", *flags], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def a_second_run_meanwhile(command, run):
    """What a second run of the same command, started while the first waits, says it submitted."""
    again = subprocess.Popen(command, stderr=subprocess.PIPE, **run)
    lines = []
    while not any("submitted" in line for line in lines):
        lines.append(again.stderr.readline())
        assert lines[-1], "".join(lines)
    again.send_signal(signal.SIGTERM)
    _, rest = again.communicate(timeout=60)
    a_second_run_meanwhile.rest = rest  # what it said after the SIGTERM
    return lines[-1]


def preempt(cluster, job):
    """SLURM's warning before a time limit (or a pre-emption) to a running job, which requeues itself;
    then the job may start again at once (SLURM holds a requeued job for 120 s)."""
    warning = subprocess.Popen(["scancel", "--signal", "USR2", job], env=cluster, stderr=subprocess.DEVNULL)

    def requeued():
        """the pre-empted job requeued"""
        show = subprocess.run(["scontrol", "show", "job", job], env=cluster, capture_output=True, text=True).stdout
        return "JobState=PENDING" in show and "Reason=BeginTime" in show

    until(requeued)
    warning.kill()  # (scancel goes on asking while the job requeues itself, "can not be altered now")
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster, check=True)


def test_a_study_runs_on_slurm_and_a_rerun_resubmits_only_what_ended_without_a_result(cluster, demo,  # noqa: F811
                                                                                         tmp_path, capsys):
    out = tmp_path / "study"
    command = ["bash", "scripts/norm-study.sh", *GRID, "--data", str(demo), "--out", str(out)]
    run = dict(cwd=ROOT, env={**cluster, "PATH": f"{stand_ins()}:{BIN}:{cluster['PATH']}", "POWERNORM_HEARTBEAT": "2"},
               text=True)
    first = subprocess.Popen(command, stderr=subprocess.PIPE, **run)

    def submitted():
        """the job array"""
        path = out / "jobs.json"
        return path.exists() and json.loads(path.read_text())

    jobs = until(submitted)
    assert len(jobs) == 4 and len({j.split("_")[0] for j in jobs.values()}) == 1  # one array, a task per cell
    script = next((out / "slurm").glob("*_submission.sh")).read_text()
    assert re.search(r"#SBATCH --array=0-3%2\n", script) and "#SBATCH --cpus-per-task=1\n" in script
    assert "#SBATCH --time=10\n" in script and "#SBATCH --signal=USR2@90\n" in script
    assert "#SBATCH --partition=study\n" in script and "#SBATCH --mem=1GB\n" in script
    assert "#SBATCH --mail-type=NONE\n" in script  # --sbatch: any other option of sbatch
    # each task named for its cell, so that squeue tells them apart
    assert until(lambda: {f"norm-study-{name}" for name in jobs} <= set(squeue(cluster, "--format", "%j")))

    # a second run meanwhile submits nothing: every cell is pending, running or finished
    line = a_second_run_meanwhile(command, run)
    assert re.search(r"(\d) cell\(s\) already pending or running on the cluster, 0 submitted;", line), line

    def training(*but):
        """a cell mid-training: a checkpoint saved, no result yet, its job running"""
        running = set(squeue(cluster, "--states", "RUNNING", "--format", "%i"))
        for name, job in jobs.items():
            cell = out / "cells" / name
            if name not in but and job in running and (cell / "checkpoint_last.pt").exists() \
                    and not (cell / "result.json").exists():
                return name

    cancelled = until(training)
    subprocess.run(["scancel", jobs[cancelled]], env=cluster, check=True)
    preempted = until(lambda: training(cancelled))  # SLURM's signal before a time limit or a pre-emption
    preempt(cluster, jobs[preempted])
    _, console = first.communicate(timeout=300)
    assert first.returncode == 1, console[-3000:]
    assert re.search(rf"{cancelled}: job {jobs[cancelled]} ended without a result \(CANCELLED[^\n]*\); the same "
                     "command resubmits it", console), console[-3000:]
    assert console.rstrip().endswith("1 cell(s) ended without a result on the cluster; each line above says "
                                     "whether a rerun of the same command can finish it")
    # while the cells train, where each is, from its log, at least every POWERNORM_HEARTBEAT seconds
    assert re.search(r"^norm-study: \S+: epoch \d+/40, update \d+", console, re.M), console[-3000:]
    # why a job ended is read from the cell's plain-text record, never from submitit's pickles in OUT/slurm
    from powernorm_fairseq.cli.study.slurm import FAILURE, _why
    marker = tmp_path / "marker"
    malicious_checkpoint(out / "slurm" / f"{jobs[cancelled]}_0_result.pkl", marker, "p4")
    (out / "cells" / cancelled / FAILURE).write_text("input\n--data: bad data\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", cluster["PATH"])
        mp.setenv("SLURM_CONF", cluster["SLURM_CONF"])
        said = _why(SimpleNamespace(out=out), {"name": cancelled}, jobs[cancelled])
    assert "(CANCELLED: --data: bad data); a rerun fails the same way until" in said and not marker.exists()
    assert "(1 cells pending)" in console and not (out / "cells" / cancelled / "result.json").exists()
    # the pre-empted cell requeued itself and resumed from its checkpoint in the same job: the job checkpointed
    # and started again under its own id (submitit's "Requeued job" line can lose its race with SLURM's requeue,
    # which ends the task it is written from)
    job_log = (out / "slurm" / f"{jobs[preempted]}_0_log.out").read_text()
    assert "Calling checkpoint method" in job_log, job_log
    assert job_log.count(f"Starting with JobEnvironment(job_id={jobs[preempted]},") == 2, job_log
    log = (out / "cells" / preempted / "train.log").read_text()
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ [1-9]\d* updates\)", log)
    earlier = float((out / "cells" / preempted / "earlier-seconds").read_text())  # the job before its requeue
    assert 0 < earlier < json.loads((out / "cells" / preempted / "result.json").read_text())["seconds"]

    # the rerun resubmits the cancelled cell only, which resumes from its checkpoint
    proc = subprocess.run(command, capture_output=True, **run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "norm-study: 4 cells, 3 finished, 1 to run" in proc.stderr
    assert f"{cancelled}: job {jobs[cancelled]} ended without a result; resubmitted" in proc.stderr
    assert "0 cell(s) already pending or running on the cluster, 1 submitted" in proc.stderr
    now = json.loads((out / "jobs.json").read_text())
    assert now[cancelled] != jobs[cancelled] and {k: v for k, v in now.items() if k != cancelled} == \
        {k: v for k, v in jobs.items() if k != cancelled}
    log = (out / "cells" / cancelled / "train.log").read_text()
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ [1-9]\d* updates\)", log)
    results = {p.parent.name: json.loads(p.read_text()) for p in (out / "cells").glob("*/result.json")}
    assert len(results) == 4 and len({r["updates"] for r in results.values()}) == 1  # the resumed ones too
    md = (out / "study.md").read_text()
    assert "pending" not in md and "## pre, depth 1" in md and "## post, depth 1" in md

    # a second rerun submits nothing, and the cluster has no job of the study
    scripts = sorted((out / "slurm").glob("*_submission.sh"))
    proc = subprocess.run(command, capture_output=True, **run)
    assert proc.returncode == 0 and "4 cells, 4 finished, 0 to run" in proc.stderr, proc.stderr[-3000:]
    assert "0 submitted" in proc.stderr and json.loads((out / "jobs.json").read_text()) == now
    assert sorted((out / "slurm").glob("*_submission.sh")) == scripts and squeue(cluster) == []

    # what the cluster refuses (a GPU on a node without one) is one line, and leaves no job script behind
    from powernorm_fairseq.cli.study import command as norm_study

    gpus = tmp_path / "gpus"
    code, error = refused_in_process(norm_study.main, [*command[2:-1], str(gpus), "--gpus-per-node", "1"],
                                     run["env"], capsys)
    assert code == 2 and error[-1].startswith("norm-study.sh: error: --launcher slurm: sbatch refused the cells: "), \
        error[-20:]
    assert not any("sbatch: error" in line for line in error[:-1]) and not (gpus / "slurm").exists()
    assert sorted(p.name for p in gpus.iterdir() if p.name.startswith(".")) == []  # no lock file either


def test_a_cell_of_two_workers_trains_in_the_processes_fairseq_spawns(demo, tmp_path, monkeypatch):  # noqa: F811
    """What ``--gpus-per-node 2`` runs inside a cell: fairseq's call_main spawns a process per GPU, each
    through cell._main. Here on the CPU (gloo, two GPUs counted): the cell's log, the end-of-run record of
    its checkpoint and its result come from the spawned workers, whose statistics are synchronised."""
    from powernorm_fairseq.cli.study.cell import run_cell
    from powernorm_fairseq.cli.study.grid import cells

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # what call_main spawns by
    args = slurm_args(monkeypatch, ["--task", "classification", "--lrs", "0.1", "--depths", "1", "--widths", "32",
                                    "--norms", "pn", "--max-update", "6", "--log-interval", "2", "--data", str(demo),
                                    "--out", str(tmp_path), "--gpus-per-node", "2", "--", "--distributed-backend",
                                    "gloo", "--ddp-backend", "legacy_ddp"])
    result = run_cell(args, cells(args)[0])
    assert result["status"] == "finished" and result["updates"] == 6 and math.isfinite(result["final_loss"])
    log = (tmp_path / "cells" / cells(args)[0]["name"] / "train.log").read_text()
    assert log.count("training on 2 devices") == 1 and log.count("train_inner") == 3  # the first worker's lines
    saved = torch.load(tmp_path / "cells" / cells(args)[0]["name"] / "checkpoint_last.pt", weights_only=True)
    assert saved["cfg"]["model"].norm_sync == "batch"
    assert saved["cfg"]["distributed_training"]["distributed_world_size"] == 2


#: the paper's table on the cluster: each training 2 CPU workers (gloo, world size 2), each scoring a job after it
REPRODUCE = ["--table", "quickstart", "--rows", "ln", "pn", "--seeds", "1", "2", "--launcher", "slurm",
             "--tasks-per-node", "2", "--partition", "study", "--timeout-min", "10", "--max-parallel", "2"]


def test_a_table_reproduces_on_slurm_and_a_rerun_resubmits_only_the_cancelled_run(cluster, toy_data, tmp_path,
                                                                                   capsys):
    out = tmp_path / "table"
    fairseq = [*TINY, "--max-epoch", "5", "--warmup-updates", "4", "--max-tokens", "512", "--num-workers", "0",
           "--tensorboard-logdir", ""]
    command = ["bash", "scripts/reproduce.sh", *REPRODUCE, "--data", str(toy_data), "--out", str(out), "--",
               *fairseq]
    run = dict(cwd=ROOT, text=True, env={**cluster, "PATH": f"{stand_ins()}:{BIN}:{cluster['PATH']}",
                                         "PYTHONWARNINGS": "ignore", "POWERNORM_HEARTBEAT": "2"})
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **run)

    def submitted():
        """every run's training and scoring job"""
        path = out / "jobs.json"
        jobs = path.exists() and json.loads(path.read_text())
        return jobs if jobs and len(jobs) == 4 and all(len(ids) == 2 for ids in jobs.values()) else None

    jobs = until(submitted)
    # the trainings: one array, at most 2 at once, each job 1 node x 2 tasks; each scoring after its training
    assert len({ids["train"].split("_")[0] for ids in jobs.values()}) == 1
    for ids in jobs.values():
        train = (out / "slurm" / f"{ids['train'].split('_')[0]}_submission.sh").read_text()
        assert re.search(r"#SBATCH --array=0-3%2\n", train) and "#SBATCH --nodes=1\n" in train
        assert "#SBATCH --ntasks-per-node=2\n" in train
        assert "#SBATCH --partition=study\n" in train and "#SBATCH --time=10\n" in train
        assert "#SBATCH --signal=USR2@90\n" in train
        score = (out / "slurm" / f"{ids['score']}_submission.sh").read_text()
        assert f"#SBATCH --dependency=afterok:{ids['train']}\n" in score and "#SBATCH --ntasks-per-node=1\n" in score
    # each job named for its table, row and seed: the trainings' array tasks too
    named = {f"reproduce-quickstart-{name}{step}" for name in jobs for step in ("", "-score")}
    assert until(lambda: named <= set(squeue(cluster, "--format", "%j")))
    # a second run meanwhile submits nothing
    line = a_second_run_meanwhile(command, run)
    assert re.search(r"\d run\(s\) already pending or running on the cluster, 0 training\(s\) and 0 scoring\(s\) "
                     "submitted", line), line
    assert a_second_run_meanwhile.rest.strip().splitlines()[-1] == (  # a SIGTERM's closing line, as Ctrl-C's
        "reproduce.sh: terminated; what finished is kept, and the jobs on the cluster go on, and the same command "
        "waits for them again"), a_second_run_meanwhile.rest[-2000:]
    def training(*but):
        """a run mid-training: a checkpoint saved, not done, its job running"""
        running = set(squeue(cluster, "--states", "RUNNING", "--format", "%i"))
        for name, ids in jobs.items():
            save = out / "runs" / name
            if name not in but and ids["train"] in running and (save / "checkpoint_last.pt").exists() \
                    and "done training" not in (save / "train.log").read_text():
                return name

    cancelled = until(training)
    subprocess.run(["scancel", jobs[cancelled]["train"]], env=cluster, check=True)
    preempted = until(lambda: training(cancelled))  # SLURM's warning before a time limit, or a pre-emption
    preempt(cluster, jobs[preempted]["train"])
    _, console = first.communicate(timeout=400)
    assert first.returncode == 1, console[-3000:]
    assert re.search(rf"{cancelled}: training job {jobs[cancelled]['train']} ended \(CANCELLED\)[^\n]*; the same "
                     "command resubmits it", console), console[-3000:]
    # while the trainings run, where each is, from its log, at least every POWERNORM_HEARTBEAT seconds
    assert re.search(r"^reproduce: (ln|pn)-seed\d: epoch \d+/5, update \d+", console, re.M), console[-3000:]
    # the cancelled training's scoring never ran, and the table says so
    assert not (out / "runs" / cancelled / "bleu-test.json").exists()
    assert not list((out / "slurm").glob(f"{jobs[cancelled]['score']}_*_log.out"))
    row, seed = cancelled.rsplit("-seed", 1)
    assert re.search(rf"^- {row}, seed {seed}: training job {jobs[cancelled]['train']} ended \(CANCELLED",
                     (out / "table.md").read_text(), re.M)
    # the pre-empted one resumed from its checkpoint in the same job and ended where the others did
    log = (out / "runs" / preempted / "train.log").read_text()
    assert re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ [1-9]\d* updates\)", log), log[-2000:]

    # the rerun (--no-wait) resubmits the cancelled run only, and returns; the next run submits nothing, and collects
    cut = command.index("--")
    proc = subprocess.run([*command[:cut], "--no-wait", *command[cut:]], capture_output=True, **run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reproduce: quickstart: 4 runs, 3 scored, 1 to run (on SLURM)" in proc.stderr
    assert f"{cancelled}: job {jobs[cancelled]['train']} ended without finishing its training; resubmitted" \
        in proc.stderr and "0 run(s) already pending or running on the cluster, 1 training(s) and 1 scoring(s) " \
        "submitted" in proc.stderr
    assert re.search(rf"^\| {row} \|.* unfinished \|", (out / "table.md").read_text(), re.M)
    now = json.loads((out / "jobs.json").read_text())
    assert now[cancelled] != jobs[cancelled] and {k: v for k, v in now.items() if k != cancelled} == \
        {k: v for k, v in jobs.items() if k != cancelled}
    # a copy of OUT (cp -a), made while the original's resubmitted run trains: its command never takes the
    # original's jobs for its own, nor cancels them; its jobs, in a partition that is down, pend and say why
    from powernorm_fairseq.cli import slurm as launcher

    copy = tmp_path / "copy"
    shutil.copytree(out, copy, symlinks=True)
    held = [*command[:cut], "--out", str(copy), "--partition", "down", "--no-wait", *command[cut:]]
    proc = subprocess.run(held, capture_output=True, **run)
    assert proc.returncode == 0 and "0 run(s) already pending or running on the cluster, 1 training(s)" in \
        proc.stderr, proc.stderr[-3000:]
    ours = {i for ids in now.values() for i in ids.values()}
    copied = json.loads((copy / "jobs.json").read_text())
    theirs = {i for ids in copied.values() for i in ids.values()} - ours
    assert copied[cancelled]["train"] in theirs
    said, before = set(), os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster["SLURM_CONF"]
    try:
        launcher.pending(copy / "slurm", said)
    finally:
        os.environ.pop("SLURM_CONF") if before is None else os.environ.update(SLURM_CONF=before)
    assert (copied[cancelled]["train"], "PartitionDown") in said, said
    assert f"slurm: job {copied[cancelled]['train']} pending: PartitionDown (it can never start as it is" in \
        capsys.readouterr().err
    # a run's directory removed while its job trains (or waits): the job is cancelled, the run started afresh
    shutil.rmtree(copy / "runs" / cancelled)
    proc = subprocess.run(held, capture_output=True, **run)
    assert proc.returncode == 0 and f"reproduce: {cancelled}: its directory was removed while job " \
        f"{copied[cancelled]['train']} trained it; the job is cancelled" in proc.stderr, proc.stderr[-3000:]
    again = json.loads((copy / "jobs.json").read_text())
    assert again[cancelled]["train"] != copied[cancelled]["train"]
    assert (copy / "runs" / cancelled / "run.json").is_file()
    assert copied[cancelled]["train"] not in squeue(cluster, "--format", "%i")
    theirs |= {i for ids in again.values() for i in ids.values()} - ours
    subprocess.run(["scancel", *theirs], env=cluster, check=True)
    states = {i: subprocess.run(["scontrol", "--oneliner", "show", "job", i], env=cluster, capture_output=True,
                                text=True).stdout for i in ours}
    assert all("JobState=" in text and "JobState=CANCELLED" not in text for text in states.values()), states
    # a partition too small, and one sbatch refuses: one line, no run left behind
    from powernorm_fairseq.cli import reproduce

    code, error = refused_in_process(reproduce.main, [*command[2:cut], "--nodes", "2", *command[cut:]], run["env"],
                                     capsys)
    assert code == 2 and error[-1] == (
        "reproduce.sh: error: --nodes 2: partition study has 1 node(s); a job of 2 would pend for ever"), error
    code, error = refused_in_process(reproduce.main, [*command[2:cut], "--partition", "nosuch", "--out",
                                                      str(tmp_path / "refused"), *command[cut:]], run["env"], capsys)
    assert code == 2 and "sbatch refused the trainings" in error[-1], error[-20:]
    assert not list((tmp_path / "refused").rglob("run.json"))

    scripts = sorted((out / "slurm").glob("*_submission.sh"))
    proc = subprocess.run(command, capture_output=True, **run)
    assert proc.returncode == 0 and re.search(r"4 runs, [34] scored, [01] to run", proc.stderr), proc.stderr[-3000:]
    assert json.loads((out / "jobs.json").read_text()) == now and sorted((out / "slurm").glob("*_submission.sh")) \
        == scripts and squeue(cluster) == [] and "0 training(s) and 0 scoring(s) submitted" in proc.stderr

    # each training ran two workers, their norms' statistics synchronised, and stopped at the same update
    updates = set()
    for name in jobs:
        save = out / "runs" / name
        assert (save / "train.log").read_text().count("training on 2 devices") >= 1 and (save / "worker-1.log").exists()
        saved = torch.load(save / "checkpoint_last.pt", weights_only=True)
        assert saved["cfg"]["model"].norm_sync == "batch"
        assert saved["cfg"]["distributed_training"]["distributed_world_size"] == 2
        updates.add(saved["optimizer_history"][-1]["num_updates"])
    assert len(updates) == 1
    # the table: a BLEU per seed, mean and interval, pn - ln paired over the seeds and per seed by the
    # paired bootstrap; no paper column (the quickstart's rows have no paper numbers)
    md = (out / "table.md").read_text()
    assert re.search(r"^\| ln \| [\d.]+ \| [\d.]+ \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \| \(baseline\) \|",
                     md, re.M), md
    assert re.search(r"^\| pn \| [\d.]+ \| [\d.]+ \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \| [-+][\d.]+ "
                     r"\[[-+][\d.]+, [-+][\d.]+\] \| (no evidence of a difference|higher than ln|lower than ln) \| "
                     r"s1 [-+][\d.]+ \(p [\d.]+\); s2 [-+][\d.]+ \(p [\d.]+\) \|$", md, re.M), md
    assert "Runs without a score" not in md
    assert "Batch per update: 2,048 tokens (world size 2); the last 3 epoch checkpoints averaged." in md

    # two workers trained exactly the updates of one worker with the same row and flags
    alone = tmp_path / "alone"
    subprocess.run(["bash", "scripts/train.sh", "--config", "configs/quickstart-ln.sh", "--seed", "1", "--data",
                    str(toy_data), "--save-dir", str(alone), "--gpus", "0", "--", *fairseq], check=True,
                   capture_output=True, **run)
    saved = torch.load(alone / "checkpoint_last.pt", weights_only=True)
    assert [saved["optimizer_history"][-1]["num_updates"]] == list(updates)
    assert (alone / "train.log").read_text().startswith(
        "train.sh: quickstart, encoder ln, decoder ln, pre-norm, seed 1, world size 1, 1 worker(s) x 512 tokens x "
        "update-freq 4 = 2048 tokens per update")
    assert (out / "runs" / "ln-seed1" / "train.log").read_text().startswith(
        "train.sh: quickstart, encoder ln, decoder ln, pre-norm, seed 1, world size 2, 2 worker(s) x 512 tokens x "
        "update-freq 2 = 2048 tokens per update")
    assert json.loads((out / "runs" / "ln-seed1" / "run.json").read_text())["world size"] == 2

    # a scoring job that fails names its cause (not srun's last line): console, failure.txt, table
    (out / "runs" / "ln-seed2" / "checkpoint3.pt").unlink()
    (out / "runs" / "ln-seed2" / "bleu-test.json").unlink()
    proc = subprocess.run(command, capture_output=True, **run)
    cause = f"{out}/runs/ln-seed2 has 2 epoch checkpoints, 3 requested"
    assert proc.returncode == 1 and re.search(rf"ln-seed2: scoring job \d+ ended \(FAILED\): scoring failed .*"
                                              rf"{re.escape(cause)}", proc.stderr), proc.stderr[-3000:]
    assert cause in (out / "runs" / "ln-seed2" / "failure.txt").read_text() and cause in (out / "table.md").read_text()
