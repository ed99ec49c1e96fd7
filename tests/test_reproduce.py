"""scripts/reproduce.sh with the local launcher: a table of tiny runs on the
toy corpus, interrupted and resumed, equal to train.sh + evaluate.sh by hand,
refusing a changed setting and every bad input in one line (the SLURM
launcher: test_slurm.py)."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support import BIN, ROOT, TINY, refused_in_process, stand_ins
from test_recipes import recipe
from powernorm_fairseq.cli.reproduce.rows import TABLES

pytestmark = pytest.mark.slow
#: the smallest runs that show each property: three epochs (evaluate.sh averages the last three), then a score
FAIRSEQ = [*TINY, "--max-epoch", "3", "--warmup-updates", "4", "--max-tokens", "512", "--num-workers", "0",
           "--tensorboard-logdir", ""]
GRID = ["--table", "quickstart", "--rows", "ln", "pn", "--seeds", "1", "2"]


def environment(*path):
    return {**os.environ, "PATH": ":".join(map(str, [*path, BIN, os.environ["PATH"]])), "PYTHONWARNINGS": "ignore"}


def table_values(out):
    """{(row, seed): BLEU} of OUT/table.json's scored runs."""
    table = json.loads((out / "table.json").read_text())
    return {(r["row"], int(seed)): run["BLEU"] for r in table["rows"] for seed, run in r["runs"].items()
            if run["state"] == "scored"}


def test_a_local_table_resumes_after_ctrl_c_and_equals_the_recipes_by_hand(toy_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    command = ["bash", "scripts/reproduce.sh", *GRID, "--data", str(toy_data), "--out", str(out), "--",
               *FAIRSEQ]
    env = environment(stand_ins(modules=False))  # the command itself: in the group the Ctrl-C reaches
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    deadline = time.time() + 300
    while not (out / "runs" / "ln-seed2" / "checkpoint1.pt").exists():  # the second run, mid-training
        assert time.time() < deadline and first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: the terminal's whole process group
    _, console = first.communicate(timeout=120)
    assert first.returncode == 130, console[-3000:]
    assert console.rstrip().endswith("reproduce.sh: interrupted; what finished is kept, and the same command "
                                     "resumes the rest")
    assert (out / "runs" / "ln-seed1" / "bleu-test.json").exists()
    assert not (out / "runs" / "ln-seed2" / "bleu-test.json").exists() and not (out / "table.md").exists()

    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reproduce: quickstart: 4 runs, 1 scored, 3 to run (here)" in proc.stderr
    log = (out / "runs" / "ln-seed2" / "train.log").read_text()
    assert re.search(r"Loaded checkpoint \S+ \(epoch \d @ [1-9]\d* updates\)", log)
    values = table_values(out)
    assert sorted(values) == [("ln", 1), ("ln", 2), ("pn", 1), ("pn", 2)]
    md = (out / "table.md").read_text()
    assert re.search(r"^\| ln \| [\d.]+ \| [\d.]+ \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \| \(baseline\) \|",
                     md, re.M), md  # no paper column: the quickstart's rows have no paper numbers
    pn = re.search(r"^\| pn \| [\d.]+ \| [\d.]+ \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \| ([-+][\d.]+) \[", md, re.M)
    assert pn and abs(float(pn[1]) - (values["pn", 1] + values["pn", 2] - values["ln", 1] - values["ln", 2]) / 2) \
        < 0.006, md
    assert "sacreBLEU signature: `nrefs:1|case:mixed" in md and "| − ln [95% CI] | verdict |" in md
    assert "-0.00" not in md and "| paper |" not in md
    # MT's own test: sacreBLEU's paired bootstrap of each seed's translations against the baseline's
    assert re.search(r"\| s1 [-+][\d.]+ \(p [\d.]+\); s2 [-+][\d.]+ \(p [\d.]+\) \|$", md, re.M), md
    assert "Paired bootstrap signature: `nrefs:1|bs:1000|seed:12345|case:lc|eff:no|tok:none" in md
    saved = json.loads((out / "table.json").read_text())
    tests = saved["rows"][1]["paired bootstrap"]
    assert sorted(tests) == ["1", "2"] and all(0 <= t["p"] <= 1 for t in tests.values())
    # the intervals are of the unrounded scores
    assert saved["rows"][0]["mean"]["mean"] == (values["ln", 1] + values["ln", 2]) / 2
    # --report writes the same table again from OUT alone; the figures as drawn
    drawn = report_figures(out, monkeypatch, capsys)
    assert (out / "table.md").read_text() == md
    metric, losses = drawn["metric.png"], drawn["valid_loss.png"]
    assert [t.get_text() for t in metric.axes[0].get_legend().get_texts()] == ["a seed's run",
                                                                              "mean, 95% CI over seeds"]
    seeds_drawn = [(x, y) for line in metric.axes[0].lines if line.get_marker() == "o"
                   for x, y in zip(line.get_xdata(), line.get_ydata())]
    assert len(seeds_drawn) == 4 and len({x for x, _ in seeds_drawn}) == 4  # jittered: none hides another
    assert [t.get_text() for t in losses.axes[0].get_legend().get_texts()] == ["ln", "pn", "seed 1", "seed 2"]
    assert all(float(x).is_integer() for x in losses.axes[0].get_xticks())
    styles = {(line.get_color(), line.get_linestyle()) for line in losses.axes[0].lines}
    assert len(styles) == 4  # each run its own: a colour per row, a line style per seed

    # pn, seed 2 by hand, as a user would run it: the same BLEU
    by_hand = tmp_path / "by-hand"
    recipe("scripts/train.sh", "--config", "configs/quickstart-pn.sh", "--seed", "2", "--data", toy_data,
           "--save-dir", by_hand, "--gpus", "0", "--", *FAIRSEQ)
    recipe("scripts/evaluate.sh", "--dataset", "quickstart", "--data", toy_data, "--save-dir", by_hand, "--cpu")
    assert json.loads((by_hand / "bleu-test.json").read_text())["bleu"][0] == values["pn", 2]

    # the same command again trains and scores nothing; a changed flag is refused before anything is written
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "4 runs, 4 scored, 0 to run" in again.stderr, again.stderr[-3000:]
    from powernorm_fairseq.cli import reproduce

    code, error = refused_in_process(reproduce.main, [*command[2:-1], "4"], env, capsys)
    assert code == 2 and error[-1] == (
        f"reproduce.sh: error: {out}/runs/ln-seed1 was started with another fairseq-train flags (--tensorboard-logdir "
        "'', now --tensorboard-logdir 4); give another --out, or remove the run's directory to start it again"), \
        error[-20:]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name not in
            ("table.md", "table.json", "metric.png", "valid_loss.png")} == \
        {p: t for p, t in before.items() if p.name not in ("table.md", "table.json", "metric.png", "valid_loss.png")}
    # the batch and the averaging, recorded per run and stated by the table
    record = json.loads((out / "runs" / "pn-seed2" / "run.json").read_text())
    assert (record["tokens per update"], record["world size"], record["averaged checkpoints"]) == (2048, 1, 3)
    assert "Batch per update: 2,048 tokens (world size 1); the last 3 epoch checkpoints averaged." in md

    # an unreadable score counts as not scored: the rerun scores the run again; a scoring that fails anyway
    # names its real cause in the console, failure.txt and the table
    (out / "runs" / "ln-seed1" / "bleu-test.json").write_text("{")
    (out / "runs" / "pn-seed1" / "checkpoint2.pt").unlink()
    (out / "runs" / "pn-seed1" / "bleu-test.json").unlink()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    cause = f"{out}/runs/pn-seed1 has 2 epoch checkpoints, 3 requested"
    assert proc.returncode == 1 and "4 runs, 2 scored, 2 to run" in proc.stderr and cause in proc.stderr, \
        proc.stderr[-3000:]
    assert table_values(out)["ln", 1] == values["ln", 1]
    assert cause in (out / "runs" / "pn-seed1" / "failure.txt").read_text()
    assert re.search(rf"^- pn, seed 1: scoring failed \(exit status \d+\): .*{re.escape(cause)}",
                     (out / "table.md").read_text(), re.M)
    table = json.loads((out / "table.json").read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert table["rows"][1]["runs"]["1"]["state"] == "failed"


def report_figures(out, monkeypatch, capsys):
    """``reproduce.sh --out OUT --report`` in this process: {file name: the figure as drawn}."""
    from powernorm_fairseq.cli import plots, reproduce

    drawn = {}
    save = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, plt: drawn.setdefault(Path(path).name, fig)
                        and save(fig, path, plt))
    reproduce.main(["--out", str(out), "--report"])
    capsys.readouterr()
    return drawn


def test_a_diverged_run_says_so_with_its_update(toy_data, tmp_path):
    """fairseq's NaN detector works on today's torch: the table says the gradients were NaN/Inf, and at
    which update (not torch's StopIteration); one seed's table.json is strict JSON."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/reproduce.sh", "--table", "quickstart", "--rows", "ln", "--seeds", "1",
                           "--data", str(toy_data), "--out", str(out), "--", *FAIRSEQ, "--lr", "1e6"], cwd=ROOT,
                          env=environment(stand_ins()), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    why = (out / "runs" / "ln-seed1" / "failure.txt").read_text()
    assert re.search(r"training failed \(exit status \d+\): fairseq-train: error: the training diverged at update "
                     r"\d+: gradients are Nan/Inf", why), why
    assert "StopIteration" not in why and "the training diverged at update" in (out / "table.md").read_text()
    log = (out / "runs" / "ln-seed1" / "train.log").read_text()
    assert re.search(r"\| WARNING \| fairseq\.nan_detector \| (NaN|Inf) detected in output of \S+", log), log[-3000:]
    assert log.startswith("train.sh: quickstart, encoder ln, decoder ln, pre-norm, seed 1, world size 1, 1 worker(s) "
                          "x 512 tokens x update-freq 4 = 2048 tokens per update -> ")
    table = json.loads((out / "table.json").read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert table["rows"][0]["mean"] is None  # one seed, no score: strict JSON, no NaN


def test_bad_input_is_one_line_before_anything_is_written(toy_data, tmp_path, capsys, monkeypatch):
    from powernorm_fairseq.cli import reproduce

    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("")
    monkeypatch.setenv("PATH", environment(stand_ins())["PATH"])
    monkeypatch.delenv("POWERNORM_REGISTRY", raising=False)  # main() sets it for the scripts it starts
    base = ["--table", "quickstart", "--data", str(toy_data), "--out", str(out)]
    for flags, message in (
            (["--table", "iwslt15"], "argument --table: invalid choice: 'iwslt15' (choose from "
                                     + ", ".join(map(repr, TABLES)) + ")"),
            (["--rows", "ln", "bn"], "--rows: 'bn' is not a row of --table quickstart; choose from ln, pn"),
            (["--seeds", "1", "0"], "argument --seeds: --seeds must be from 1 to 4294967295, got 0"),
            (["--seeds", "4294967296"], "argument --seeds: --seeds must be from 1 to 4294967295, got 4294967296"),
            (["--average", "0"], "argument --average: --average must be >= 1, got 0"),
            # flags after -- that would make a run another experiment than its row, each with its option
            (["--", "--seed", "7"], "-- --seed: refused after --, as it would make the runs another experiment "
                                    "than their rows: the runs' seeds are reproduce.sh's --seeds"),
            (["--", "--seed=7"], "-- --seed: refused after --"),
            (["--", "--save-dir", "x"], "-- --save-dir: refused after --, as it would make the runs another "
                                        "experiment than their rows: each run's directory is "
                                        "OUT/runs/<row>-seed<N>: give --out"),
            (["--", "--norm-type", "ln"], "-- --norm-type: refused after --, as it would make the runs another "
                                          "experiment than their rows: the row sets it (configs/quickstart-ln.sh)"),
            (["--", "--encoder-norm-ff", "bn"], "-- --encoder-norm-ff: refused after --"),
            (["--", "--norm-placement", "post"], "-- --norm-placement: refused after --"),
            (["--", "--distributed-world-size", "2"], "-- --distributed-world-size: refused after --, as it would "
                                                      "make the runs another experiment than their rows: the "
                                                      "workers are the launcher's"),
            (["--", "--norm-sync", "none"], "-- --norm-sync: refused after --"),
            (["--", "--keep-last-epochs", "2"], "give reproduce.sh --average N"),
            (["--", "--update-freq", "2"], "row ln: train.sh: error: --update-freq after --: give it as this "
                                           "script's --update-freq N, which keeps the row's 2048 tokens per update"),
            (["--", "--max-epoch", "2"], "row ln: -- --max-epoch 2 leaves 2 epoch checkpoint(s), and the run "
                                         "averages 3; give reproduce.sh --average N with N at most that"),
            (["--", "--max-update", "3"], "row ln: -- --max-update 3 allows at most 1 epoch checkpoint(s) of "
                                          "5,193 training tokens at 2,048 tokens per update, and the run averages 3"),
            (["--", "--no-epoch-checkpoints"], "leave no epoch checkpoint to average (3 averaged)"),
            (["--seeds", "x"], "argument --seeds: invalid seed value: 'x'"),
            (["--launcher", "slurm", "--nodes", "0"], "argument --nodes: --nodes must be >= 1, got 0"),
            (["--launcher", "slurm", "--gpus-per-node", "4", "--tasks-per-node", "3"],
             "--tasks-per-node 3 does not divide --gpus-per-node 4"),
            (["--partition", "gpu"], "--partition: a --launcher slurm flag; add --launcher slurm, or leave it out"),
            (["--no-wait"], "--no-wait: a --launcher slurm flag"),
            (["--account", "A"], "--account: a --launcher slurm flag"),
            (["--seed", "1"], "unrecognized arguments: --seed 1 (--seed: did you mean --seeds?)"),  # train.sh's
            (["--", "--max-epochs", "1"], "fairseq-train (the flags after --): unrecognized arguments: --max-epochs 1 "
                                          "(--max-epochs: did you mean --max-epoch?)"),
            (["--launcher", "slurm", "--sbatch", "job-name=x"], "argument --sbatch: job-name: set by the launcher"),
            (["--launcher", "slurm", "--sbatch", "ntasks=8"], "argument --sbatch: ntasks: would shape the jobs "
                                                               "otherwise than the runs' world size; use --nodes"),
            (["--launcher", "slurm", "--sbatch", "gres=gpu:4"], "argument --sbatch: gres: would shape the jobs"),
            (["--launcher", "slurm", "--sbatch", "partition=x"], "argument --sbatch: partition: set by the launcher; "
                                                                 "use --partition"),
            (["--launcher", "slurm", "--sbatch", "Mail Type=END"], "argument --sbatch: 'Mail Type=END': not "
                                                                   "KEY=VALUE with an sbatch option's long name"),
            (["--launcher", "slurm"], "--launcher slurm: no sbatch here; run this on a machine of the cluster, "
                                      "or use --launcher local"),
            (["--out", str(a_file)], f"--out {a_file}: is a file, not a directory"),
            (["--out", "/proc/reproduce"], "--out /proc/reproduce: cannot be written"),
            (["--data", str(empty)], f"--data {empty}: no binarized data with a test set (no dict.en.txt"),
            (["--", "--max-epoch", "3", "--no-such-flag"],
             "fairseq-train (the flags after --): unrecognized arguments: --no-such-flag"),
            (["--", "--norm-placement", "sideways"], "fairseq-train (the flags after --): argument --norm-placement: "
                                                     "invalid choice: 'sideways'")):
        with monkeypatch.context() as patch:
            if "slurm" in flags and "--nodes" not in flags and "--gpus-per-node" not in flags:
                patch.setenv("PATH", str(tmp_path))  # no SLURM client here
            with pytest.raises(SystemExit) as end:
                reproduce.main([*base, *flags])  # (a flag given twice: the last wins)
        error = capsys.readouterr().err.strip().splitlines()
        assert end.value.code == 2 and len(error) == 1 and message in error[0], (flags, error)
        assert error[0].startswith("reproduce.sh: error: ") and not out.exists()


def test_dry_runs_print_each_job_and_run_and_write_nothing(toy_data, lm_data, tmp_path, capsys, monkeypatch):
    from powernorm_fairseq.cli import reproduce

    out = tmp_path / "out"
    monkeypatch.setenv("PATH", environment(stand_ins())["PATH"])
    monkeypatch.delenv("POWERNORM_REGISTRY", raising=False)
    reproduce.main([*GRID, "--data", str(toy_data), "--out", str(out), "--launcher", "slurm", "--tasks-per-node", "2",
                    "--partition", "p", "--account", "A", "--qos", "Q", "--constraint", "a100|h100", "--exclude",
                    "n[1-2]", "--sbatch", "mail-type=END", "--sbatch", "exclusive", "--dry-run", "--", *FAIRSEQ])
    printed = capsys.readouterr().out
    assert printed.count("#SBATCH --ntasks-per-node=2\n") == 4 and printed.count("#SBATCH --partition=p\n") == 8
    # the cluster's own options in every job script, and a name per job: its table, row and seed
    for line in ("--account=A", "--qos=Q", "--constraint='a100|h100'", "--exclude='n[1-2]'", "--mail-type=END",
                 "--exclusive"):
        assert printed.count(f"#SBATCH {line}\n") == 8, line
    names = re.findall(r"^#SBATCH --job-name=(\S+)$", printed, re.M)
    assert len(names) == len(set(names)) == 8 and "reproduce-quickstart-pn-seed2" in names, names
    assert "reproduce-quickstart-pn-seed2-score" in names
    assert printed.count("#SBATCH --dependency=afterok:TRAINING_JOB_ID\n") == 4
    assert re.search(r"scripts/train\.sh --config \S+/configs/quickstart-pn\.sh --seed 2 --data \S+ --save-dir "
                     rf"{out}/runs/pn-seed2 --gpus 0 --world-size 2 -- ", printed), printed
    # each training's fairseq-train command: the row's batch over the 2 workers, their distributed flags
    assert printed.count("# whose workers run (with SLURM's rank and first node):\nfairseq-train ") == 4
    assert len(re.findall(r" --max-tokens 512 --update-freq 2 .* --distributed-world-size 2 --norm-sync batch .*"
                          r" --distributed-init-method tcp://FIRST_NODE:PORT --distributed-rank RANK ", printed)) == 4
    # no prepared data needed to plan a table; here, each run's fairseq-train command too
    reproduce.main(["--table", "quickstart", "--rows", "pn", "--seeds", "3", "--data", str(tmp_path / "none"),
                    "--out", str(out), "--dry-run", "--", "--max-epoch", "4"])
    printed = capsys.readouterr().out
    assert re.search(r"# which runs:\nfairseq-train \S+/none .* --max-tokens 2048 --update-freq 1 --seed 3 "
                     r"--keep-last-epochs 3 ", printed), printed
    assert "evaluate.sh --dataset quickstart" in printed and " --average 3 --cpu" in printed
    # a language model's table: its training and perplexity scripts
    reproduce.main(["--table", "lm-ptb", "--rows", "ln", "--seeds", "1", "--data", str(lm_data), "--out", str(out),
                    "--dry-run", "--", "--max-update", "2"])
    printed = capsys.readouterr().out
    assert "scripts/train-lm.sh --config" in printed and "configs/lm-ptb-ln.sh" in printed
    assert re.search(r"scripts/evaluate-lm\.sh --dataset ptb --data \S+ --save-dir \S+/runs/ln-seed1 --cpu", printed)
    assert not out.exists()


def test_each_worker_finds_its_rank_where_fairseq_s_slurm_start_does_and_where_it_cannot(monkeypatch):
    """The variables a task's worker is given, from SLURM's environment: on GPU nodes with a task per
    GPU, or one per node, fairseq's own start (checked here against fairseq's code); else explicit."""
    import subprocess as sp

    import torch
    from fairseq.dataclass.configs import DistributedTrainingConfig
    from fairseq.distributed import utils as fairseq_distributed
    from omegaconf import OmegaConf

    from powernorm_fairseq.cli.reproduce import jobs

    hosts = sp.CompletedProcess([], 0, "n1\nn2\n", "")
    monkeypatch.setattr(jobs.subprocess, "run", lambda *a, **k: hosts)
    monkeypatch.setattr(fairseq_distributed.subprocess, "check_output", lambda *a, **k: b"n1\nn2\n")
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    port = str(20000 + 77)

    def job(gpus, tasks):
        per_task = gpus // tasks
        return dict(world=2 * tasks * max(per_task, 1), gpus_per_task=per_task, tasks_per_node=tasks,
                    gpus_per_node=gpus)

    def fairseq_start(spec, tasks, procid, localid):
        """What fairseq's SLURM start makes of the task's flags and environment."""
        flags, _ = jobs.worker(spec, {**env, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid)})
        assert flags == ["--distributed-port", port]
        cfg = OmegaConf.structured(DistributedTrainingConfig(  # as fairseq-train holds it
            distributed_world_size=spec["world"], distributed_port=int(port), tpu=False))  # (tpu: of the whole)
        with monkeypatch.context() as patch:
            for key, value in {**env, "SLURM_NTASKS_PER_NODE": str(tasks), "SLURM_PROCID": str(procid),
                               "SLURM_LOCALID": str(localid)}.items():
                patch.setenv(key, value)
            patch.setattr(torch.cuda, "device_count", lambda: spec["gpus_per_node"])
            patch.setattr(torch.cuda, "set_device", devices.append)
            fairseq_distributed.infer_init_method(cfg)
        return cfg

    devices = []

    cfg = fairseq_start(job(8, 8), 8, procid=9, localid=1)  # a task per GPU: worker 9 on the second node's GPU 1
    assert (cfg.distributed_rank, cfg.device_id, cfg.distributed_world_size, cfg.distributed_no_spawn) == \
        (9, 1, 16, True) and cfg.distributed_init_method == f"tcp://n1:{port}" and devices == [1]
    cfg = fairseq_start(job(8, 1), 1, procid=1, localid=0)  # a task per node: fairseq spawns 8 workers from rank 8
    assert (cfg.distributed_rank, cfg.distributed_world_size, cfg.distributed_num_procs) == (8, 16, 8)
    # CPU tasks: one gloo worker each, rank from SLURM_PROCID
    flags, _ = jobs.worker(job(0, 2), {**env, "SLURM_PROCID": "3", "SLURM_LOCALID": "1"})
    assert flags == ["--distributed-init-method", f"tcp://n1:{port}", "--distributed-rank", "3",
                     "--distributed-no-spawn", "--device-id", "0", "--distributed-backend", "gloo",
                     "--ddp-backend", "legacy_ddp"]
    # 2 tasks of 4 GPUs each a node: this task's GPUs, fairseq spawning a worker on each from rank 4 x PROCID
    flags, task_env = jobs.worker(job(8, 2), {**env, "SLURM_PROCID": "3", "SLURM_LOCALID": "1"})
    assert flags == ["--distributed-init-method", f"tcp://n1:{port}", "--distributed-rank", "12"]
    assert task_env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert jobs.worker(dict(world=1), env) == ([], env)


def test_a_job_that_timed_out_without_a_new_checkpoint_is_not_requeued(tmp_path, capsys, monkeypatch):
    from powernorm_fairseq.cli import slurm

    checkpoint = tmp_path / "checkpoint_last.pt"
    checkpoint.write_bytes(b"1")

    class Job(slurm.Resumable):
        def __call__(self):
            pass

    job = Job()
    now = [1000.0]
    monkeypatch.setattr(slurm.time, "time", lambda: now[0])
    job.started(checkpoint, timeout_min=10)
    now[0] += 60  # a pre-emption a minute in
    assert job.requeue("run x")
    now[0] += 8 * 60  # the time limit's warning, no checkpoint saved since the job started
    assert not job.requeue("run x")
    assert capsys.readouterr().err.strip() == "run x: no checkpoint saved in the 10 minutes this job had; not " \
                                              "requeued (give a longer --timeout-min)"
    os.utime(checkpoint, ns=(1, checkpoint.stat().st_mtime_ns + 10 ** 9))  # one saved meanwhile
    assert job.requeue("run x")
    # a limit that leaves no time for a checkpoint before the warning (90 s before it): a time-out, never
    # taken for a pre-emption and requeued for ever
    short = Job()
    short.started(checkpoint, timeout_min=2)
    now[0] += 30
    assert not short.requeue("run y")
    assert "run y: no checkpoint saved in the 2 minutes this job had; not requeued" in capsys.readouterr().err
