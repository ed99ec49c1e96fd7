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

import pytest

from support import BIN, ROOT, TINY, stand_ins
from test_recipes import recipe

pytestmark = pytest.mark.slow
#: the smallest runs that show each property: three epochs (evaluate.sh averages the last three), then a score
FAIRSEQ = [*TINY, "--max-epoch", "3", "--warmup-updates", "4", "--max-tokens", "600", "--num-workers", "0",
           "--tensorboard-logdir", ""]
GRID = ["--table", "quickstart", "--rows", "ln", "pn", "--seeds", "1", "2"]


def environment(*path):
    return {**os.environ, "PATH": ":".join(map(str, [*path, BIN, os.environ["PATH"]])), "PYTHONWARNINGS": "ignore"}


def table_values(out):
    """{(row, seed): BLEU} of OUT/table.json's scored runs."""
    table = json.loads((out / "table.json").read_text())
    return {(r["row"], int(seed)): run["BLEU"] for r in table["rows"] for seed, run in r["runs"].items()
            if run["state"] == "scored"}


def test_a_local_table_resumes_after_ctrl_c_and_equals_the_recipes_by_hand(toy_data, tmp_path):
    out = tmp_path / "out"
    command = ["bash", "scripts/reproduce.sh", *GRID, "--data", str(toy_data), "--out", str(out), "--",
               *FAIRSEQ]
    env = environment(stand_ins())
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
    assert re.search(r"^\| ln \|  \| [\d.]+ \| [\d.]+ \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \| \(baseline\) \|",
                     md, re.M), md
    pn = re.search(r"^\| pn \|  \| [\d.]+ \| [\d.]+ \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \| ([-+][\d.]+) \[", md,
                   re.M)
    assert pn and abs(float(pn[1]) - (values["pn", 1] + values["pn", 2] - values["ln", 1] - values["ln", 2]) / 2) \
        < 0.006, md
    assert "sacreBLEU signature: `nrefs:1|case:mixed" in md and "| − ln [95% CI] | verdict |" in md
    assert (out / "metric.png").stat().st_size > 0 and (out / "valid_loss.png").stat().st_size > 0

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
    changed = subprocess.run([*command[:-1], "4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert changed.returncode == 2 and changed.stderr.strip().splitlines()[-1] == (
        f"reproduce.sh: error: {out}/runs/ln-seed1 was started with another fairseq-train flags (--tensorboard-logdir "
        "'', now --tensorboard-logdir 4); give another --out, or remove the run's directory to start it again"), \
        changed.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name not in
            ("table.md", "table.json", "metric.png", "valid_loss.png")} == \
        {p: t for p, t in before.items() if p.name not in ("table.md", "table.json", "metric.png", "valid_loss.png")}


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
            (["--table", "iwslt15"], "argument --table: invalid choice: 'iwslt15' (choose from 'iwslt14', 'wmt14', "
                                     "'twt', 'lm-ptb', 'lm-wikitext103', 'quickstart')"),
            (["--rows", "ln", "bn"], "--rows: 'bn' is not a row of --table quickstart; choose from ln, pn"),
            (["--seeds", "1", "0"], "argument --seeds: --seeds must be >= 1, got 0"),
            (["--seeds", "x"], "argument --seeds: invalid parse value: 'x'"),
            (["--launcher", "slurm", "--nodes", "0"], "argument --nodes: --nodes must be >= 1, got 0"),
            (["--launcher", "slurm", "--gpus-per-node", "4", "--tasks-per-node", "3"],
             "--tasks-per-node 3 does not divide --gpus-per-node 4"),
            (["--partition", "gpu"], "--partition: a --launcher slurm flag; add --launcher slurm, or leave it out"),
            (["--no-wait"], "--no-wait: a --launcher slurm flag"),
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
