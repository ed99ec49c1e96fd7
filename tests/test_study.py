"""Sentence classification and the normalization study: the classifier,
--init, data-prep/prepare-phrasebank.sh and scripts/norm-study.sh end to end."""

import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from support import BIN, ROOT, build_model, once
from test_recipes import recipe
from powernorm_fairseq.norms import NORM_TYPES

pytestmark = pytest.mark.slow
LRS = ["1", "0.1"]
MORE = ["--", "--dropout", "0.1"]  # fairseq-train flags after --, named in the report
GRID = ["--task", "classification", "--lrs", *LRS, "--depths", "1", "--widths", "32", "--norms", "ln", "bn",
        "none", "--max-update", "8", "--log-interval", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The offline demo set, prepared by the recipe."""
    return once(tmp_path_factory, "sentiment-demo", lambda root: recipe(
        "data-prep/prepare-phrasebank.sh", "--demo", "300", "--out", root, "--bpe-size", "200")) / "bin"


@pytest.fixture(scope="module")
def study(demo, tmp_path_factory):
    """The test grid, run once per session (its console output kept beside it)."""
    def make(out):
        proc = recipe("scripts/norm-study.sh", *GRID, "--data", demo, "--out", out, "--landscape", *MORE)
        (out / "console.txt").write_text(proc.stderr)

    out = once(tmp_path_factory, "study", make)
    return out, subprocess.CompletedProcess([], 0, "", (out / "console.txt").read_text())


def classifier(demo, *flags):
    return build_model(demo, "--user-dir", ROOT / "powernorm_fairseq", "--task", "sentence_prediction",
                       "--criterion", "sentence_prediction", "--num-classes", "3", "--arch", "powernorm_classifier",
                       "--encoder-layers", "2", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
                       "--encoder-attention-heads", "2", "--cpu", *flags)


def test_the_demo_set_is_binarized_for_sentence_prediction_with_true_labels(demo):
    assert sorted(line.split()[0] for line in (demo / "label" / "dict.txt").read_text().splitlines()) == [
        "negative", "neutral", "positive"]
    for split in ("train", "valid"):
        assert (demo / "input0" / f"{split}.bin").exists() and (demo / "label" / f"{split}.bin").exists()
    raw = demo.parent / "raw"
    labels = (raw / "train.label").read_text().splitlines()
    for text, label in zip((raw / "train.txt").read_text().splitlines(), labels):
        up = re.search(r"\b(rose|increased|grew|climbed|went up)\b", text)
        down = re.search(r"\b(fell|decreased|dropped|declined|went down)\b", text)
        bad = re.search(r"\b(loss|costs)\b", text, re.I)
        if up or down:  # a direction: good metrics up or bad ones down are positive
            assert label == ("positive" if bool(up) != bool(bad) else "negative"), text
        else:
            assert label == "neutral", text


def test_phrasebank_format_encoding_and_malformed_lines(tmp_path):
    lines = [b"Operating profit rose to EUR 13.1 mn .@positive", b"The company is based in Espoo@Helsinki .@neutral",
             "Sales in Jyv\xe4skyl\xe4 fell .@negative".encode("iso-8859-1")] * 10 + [
        f"{w} .@{label}".encode() for w, label in (("Net sales rose", "positive"), ("Shares rose", "positive"),
                                                    ("The office is in Vantaa", "neutral"),
                                                    ("It makes paper", "neutral"), ("Sales fell", "negative"),
                                                    ("Profit fell", "negative"))]
    src = tmp_path / "Sentences_AllAgree.txt"
    src.write_bytes(b"\r\n".join(lines + [b"no label here"]) + b"\r\n")
    bad = recipe("data-prep/prepare-phrasebank.sh", "--src", src, "--out", tmp_path / "a", check=False)
    assert bad.returncode != 0
    assert f"1 malformed line(s) in {src} (phrasebank, iso-8859-1): {src}:37" in bad.stderr
    assert not (tmp_path / "a" / "bin").exists()
    ok = recipe("data-prep/prepare-phrasebank.sh", "--src", src, "--out", tmp_path / "b", "--skip-malformed",
                "--valid-fraction", "0.34", "--bpe-size", "20")
    assert "dropped 1 malformed line(s)" in ok.stderr and "27 exact duplicate(s)" in ok.stderr
    text = (tmp_path / "b" / "raw" / "train.txt").read_text(encoding="utf-8") + \
        (tmp_path / "b" / "raw" / "valid.txt").read_text(encoding="utf-8")
    assert "Sales in Jyväskylä fell ." in text and "The company is based in Espoo@Helsinki ." in text
    usage = recipe("data-prep/prepare-phrasebank.sh", "--demo", "10", "--valid-fraction", "1.5", check=False)
    assert usage.returncode != 0 and usage.stderr.strip().endswith("--valid-fraction must be a number in [0, 1), "
                                                                   "got '1.5'")


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_the_classifier_trains_with_every_norm(demo, placement):
    """One SGD step with each --norm-type lowers the loss of its batch a little, with finite gradients."""
    from fairseq.criterions.sentence_prediction import SentencePredictionConfig, SentencePredictionCriterion

    from support import sample

    for kind in NORM_TYPES:
        model, task = classifier(demo, "--norm-type", kind, "--norm-placement", placement, "--dropout", "0")
        criterion = SentencePredictionCriterion(SentencePredictionConfig(), task)
        batch = sample(task, 16)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss, size, _ = criterion(model, batch)
            loss = loss / size
            loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), kind
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (kind, placement, losses)


def test_mean_pooling_leaves_out_padding(demo):
    model, task = classifier(demo, "--norm-type", "ln")
    model.eval()
    batch = __import__("support").sample(task, 8)
    tokens = batch["net_input"]["src_tokens"]
    lengths = tokens.ne(task.source_dictionary.pad()).sum(1)
    short = int(lengths.argmin())
    alone = tokens[short][tokens[short].ne(task.source_dictionary.pad())].unsqueeze(0)  # its real tokens
    with torch.no_grad():
        together = model(tokens, features_only=True, classification_head_name="sentence_classification_head")[0]
        single = model(alone, features_only=True, classification_head_name="sentence_classification_head")[0]
    assert tokens.eq(task.source_dictionary.pad()).any()
    torch.testing.assert_close(together[short], single[0], rtol=1e-5, atol=1e-5)


def test_init_schemes(demo):
    model, _ = classifier(demo, "--init", "xavier-kaiming")
    layer = model.encoder.layers[0]
    d, d_ff = layer.fc1.in_features, layer.fc1.out_features
    bound = lambda w: w.abs().max().item()  # noqa: E731  uniform: the largest draw is near the bound
    assert bound(layer.fc1.weight) == pytest.approx(math.sqrt(6 / d), rel=0.1)  # Kaiming, fan-in d
    assert bound(layer.fc2.weight) == pytest.approx(math.sqrt(6 / d_ff), rel=0.1)
    assert bound(layer.self_attn.q_proj.weight) == pytest.approx(math.sqrt(6 / (2 * d)), rel=0.1)  # Xavier
    assert not layer.fc1.bias.any() and not model.encoder.embed_tokens.weight[1].any()  # bias 0, padding 0
    model, _ = classifier(demo, "--init", "uniform:100", "--norm-type", "ln")
    weights = [m.weight for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    assert all(w.abs().max() <= 100 for w in weights) and max(w.abs().max() for w in weights) > 90
    assert torch.equal(layer.self_attn_layer_norm.weight, torch.ones(d))  # the norms keep their start
    from powernorm_fairseq.common.errors import PowerNormConfigError

    with pytest.raises(SystemExit):
        classifier(demo, "--init", "uniform:-1")
    with pytest.raises(PowerNormConfigError, match="--small-init contradicts --init uniform:0.1"):
        classifier(demo, "--init", "uniform:0.1", "--small-init")


def cell_results(out):
    return {p.parent.name: json.loads(p.read_text()) for p in (out / "cells").glob("*/result.json")}


def test_the_study_writes_its_table_figures_and_landscape(study, demo, tmp_path, monkeypatch):
    import shutil

    out, proc = study
    results = cell_results(out)
    assert len(results) == 6 and "6 to run" in proc.stderr and "[6/6]" in proc.stderr
    md = (out / "study.md").read_text()
    assert "fairseq-train flags after `--` (over the dimensions below where they name them): `--dropout 0.1`." in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0] == "| lr | ln | bn | none |" and [row.split(" | ")[0] for row in table[1:]] == ["| 1", "| 0.1"]
    for name in ("init_grads.png", "loss.png", "landscape.png"):
        assert (out / name).stat().st_size > 10_000
    # the figures as drawn, by the same command again (it trains nothing): one legend each, beside the
    # panels, naming what is drawn; panels named in words
    from powernorm_fairseq.cli import plots
    from powernorm_fairseq.cli import study as norm_study

    drawn, save = {}, plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, plt: drawn.setdefault(Path(path).name, fig)
                        and save(fig, path, plt))
    again = tmp_path / "study"  # a copy: the other tests copy the shared one, a figure being rewritten too
    shutil.copytree(out, again)
    norm_study.main([*GRID, "--data", str(demo), "--out", str(again), "--landscape", *MORE])
    legends = {name: [[t.get_text() for t in legend.get_texts()] for legend in fig.legends]
               for name, fig in drawn.items()}
    lines = [line for ax in drawn["loss.png"].axes for line in ax.lines]
    kinds = [label for label, present in (("training", any(line.get_linestyle() == "-" for line in lines)),
                                          ("valid", any(line.get_linestyle() == "--" for line in lines)),
                                          ("diverged: past 10x the initial loss",
                                           any(line.get_marker() == "^" for line in lines))) if present]
    assert "training" in kinds and "diverged: past 10x the initial loss" in kinds  # lr 1 diverges here
    assert legends == {"init_grads.png": [["ln", "bn", "none"]], "landscape.png": [["ln", "bn", "none"]],
                       "loss.png": [["ln", "bn", "none", *kinds]]}
    assert not any(ax.get_legend() for fig in drawn.values() for ax in fig.axes)
    assert {ax.get_title() for ax in drawn["loss.png"].axes} == {f"depth 1, width 32, xavier-kaiming, lr {lr}"
                                                                 for lr in LRS}
    study_json = json.loads((out / "study.json").read_text(),  # strict JSON: a diverged cell's NaN is null
                            parse_constant=lambda c: pytest.fail(f"study.json holds a bare {c}"))
    majority = study_json["majority_loss"]
    counts = [int(line.split()[1]) for line in (demo / "label" / "dict.txt").read_text().splitlines()]
    p = [c / sum(counts) for c in counts]
    assert majority == pytest.approx(-sum(x * math.log2(x) for x in p))
    for name, r in results.items():
        cell = out / "cells" / name
        init = json.loads((cell / "init.json").read_text())
        assert "encoder layer 1" in init["grad_norms"] and r["initial_loss"] == init["loss"]
        # the final loss is the last epoch record of the cell's own log
        epochs = [json.loads(line.split(" | train | ")[1]) for line in (cell / "train.log").read_text().splitlines()
                  if " | train | " in line]
        if r["status"] == "finished":
            assert r["final_loss"] == float(epochs[-1]["train_loss"]) and r["updates"] == 8
            assert r["lipschitz"] > 0 and r["smoothness"] > 0
            assert r["converged"] == (r["final_loss"] < 0.5 * r["initial_loss"] and r["final_loss"] < majority)
        else:
            assert r["status"] == "diverged" and not r["converged"] and math.isnan(r["final_loss"])
            assert next(c for c in study_json["cells"] if c["name"] == name)["final_loss"] is None
        cells_row = study_json["tables"][0]["rows"][LRS.index(f"{r['lr']:g}")]["norms"][r["norm"]]
        assert cells_row["converged"] == int(r["converged"])


def test_a_rerun_skips_every_cell_and_an_interrupted_one_resumes(study, demo, tmp_path):
    """One rerun over a copy of the study: a cell measured before --landscape
    was asked for is measured, a cell stopped after its last checkpoint and
    before its result resumes (not retrains), and every other cell is skipped.
    The stopped cell was killed before fairseq printed its epoch's line (its
    only epoch): its numbers come from its last checkpoint, not its log."""
    import shutil

    out = tmp_path / "study"  # a copy: the other tests read the shared one
    shutil.copytree(study[0], out)
    results = cell_results(out)
    name = next(n for n, r in results.items() if r["status"] == "finished" and r["norm"] == "bn")
    (out / "cells" / name / "result.json").unlink()
    log = out / "cells" / name / "train.log"
    lines = log.read_text().splitlines(keepends=True)
    assert sum(" | train | " in line for line in lines) == 1  # one epoch: the kill leaves no line at all
    log.write_text("".join(line for line in lines if " | train | " not in line))
    measured = next(n for n, r in results.items() if "lipschitz" in r and n != name)
    plain = {k: v for k, v in results[measured].items() if k not in ("lipschitz", "smoothness", "grad_norm")}
    (out / "cells" / measured / "result.json").write_text(json.dumps(plain))
    before = {n: (out / "cells" / n / "result.json").stat().st_mtime_ns for n in results if n not in (name, measured)}
    start = time.time()
    proc = recipe("scripts/norm-study.sh", *GRID, "--data", demo, "--out", out, "--landscape", *MORE)
    assert "4 finished, 2 to run" in proc.stderr and time.time() - start < 30
    assert {n: (out / "cells" / n / "result.json").stat().st_mtime_ns for n in before} == before
    assert cell_results(out)[measured]["lipschitz"] > 0
    log = (out / "cells" / name / "train.log").read_text()
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 8 updates\)", log)
    again = cell_results(out)[name]
    assert again["final_loss"] == results[name]["final_loss"] and again["updates"] == 8
    assert again["metric"] == results[name]["metric"] and again["converged"] == results[name]["converged"]


def test_the_report_holds_every_cell_another_run_finished(study, demo, tmp_path, monkeypatch):
    """Two runs on one OUT: the cells the other run trained (skipped here as
    running elsewhere, finished there meanwhile) are in this run's report,
    which reads every result on disk when it is written."""
    import shutil

    from powernorm_fairseq.cli import study as norm_study
    from powernorm_fairseq.cli.study import launchers

    out = tmp_path / "study"
    shutil.copytree(study[0], out)
    kept = {}
    for path in (out / "cells").glob("*/result.json"):
        kept[path] = path.read_text()
        path.unlink()
    (out / "study.md").unlink()

    def the_other_run(args, todo):
        for cell in todo:
            path = out / "cells" / cell["name"] / "result.json"
            path.write_text(kept[path])  # the other run finished it
            yield cell, None  # this one found it locked

    monkeypatch.setattr(launchers, "run_all", the_other_run)
    lost = sorted((out / "cells").glob("*/init.json"))[0]  # a finished cell's probe removed: reported, not fatal
    lost.unlink()
    norm_study.main([*GRID, "--data", str(demo), "--out", str(out), "--landscape", *MORE])
    md = (out / "study.md").read_text()
    assert "pending" not in md and "done" not in md
    assert f"Gradient norms at init are missing for 1 finished cell(s), whose init.json was removed or is " \
           f"unreadable (left out of init_grads.png): {lost.parent.name}." in md
    assert len([c for c in json.loads((out / "study.json").read_text())["cells"] if c["status"] != "pending"]) == 6


def test_print_commands_and_bad_grids(study, demo, tmp_path, capsys):
    from powernorm_fairseq.cli import study as norm_study

    out = tmp_path / "s"
    norm_study.main([*GRID, "--norms", "ln", "dyt", "--data", str(demo), "--out", str(out), "--print-commands",
                     "--jobs", "2", "--", "--dropout", "0.2"])
    commands = (out / "commands.sh").read_text().splitlines()
    assert len(commands) == 4 and all("--cell d1-w32-" in c and c.endswith("-- --dropout 0.2") for c in commands)
    assert not any("--jobs" in c or "--print-commands" in c for c in commands)
    capsys.readouterr()
    (tmp_path / "a-file").write_text("")
    new = tmp_path / "new"
    for flags, message in ((["--norms", "ln", "layernorm", "--data", str(demo)],
                            "--norms: unknown kind 'layernorm'; choose from ln, bn"),
                           (["--task", "translation", "--data", str(demo)], "no dict.*.txt for --task translation"),
                           (["--inits", "uniform:0", "--data", str(demo)], "invalid --inits 'uniform:0'"),
                           (["--out", str(study[0]), "--max-update", "9", "--data", str(demo), "--landscape", *MORE],
                            f"--out {study[0]} holds a study run with max-update 8, not 9: rerun it with its "
                            "settings"),
                           (["--lrs", "0.1", "0.1000001", "--data", str(demo)],
                            "--lrs 0.1 and 0.1000001 name the same cell d1-w32-ln-xavier-kaiming-lr0.1-s1"),
                           (["--widths", "200", "--data", str(demo)],
                            "--widths 200: its 3 heads (one per 64 channels) do not divide 200"),
                           (["--seeds", "-1", "--data", str(demo)], "--seeds must be from 1 to 4294967295, got -1"),
                           (["--lr", "0.1", "--data", str(demo)], "unrecognized arguments: --lr 0.1"),
                           (["--out", str(tmp_path / "a-file"), "--data", str(demo)], "is a file, not a directory"),
                           (["--data", str(demo), "--", "--dropuot", "0.1"],
                            "fairseq-train (the flags after --): unrecognized arguments: --dropuot 0.1"),
                           (["--data", str(demo), "--", "--no-save"], "after --: --no-save: a cell's result"),
                           (["--data", str(demo), "--placement", "post", "--placements", "pre"],
                            "--placement and --placements: give one"),
                           (["--data", str(demo), "--qk-norms", "pn"],
                            "--qk-norms: 'pn' cannot normalise a head's queries and keys; choose from ln,"),
                           (["--data", str(demo), "--placements", "pre", "pre"], "--placements lists a value twice"),
                           (["--data", str(demo), "--qk-norms", "ln", "ln"], "--qk-norms lists a value twice: ln ln"),
                           (["--data", str(demo), "--placements", "deepnorm", "--", "--small-init"],
                            "--small-init contradicts --norm-placement deepnorm")):
        with pytest.raises(SystemExit) as end:
            norm_study.main([*GRID, "--out", str(new), *flags])
        error = capsys.readouterr().err.strip().splitlines()
        assert end.value.code == 2 and len(error) == 1 and error[0].startswith("norm-study.sh: error: ")
        assert message in error[0], error
        assert not new.exists()  # nothing written


def test_a_failed_start_does_not_lock_the_study(demo, tmp_path, capsys):
    """A start that failed before any cell trained (a flag fairseq needed was
    missing) recorded nothing that binds: the corrected command runs, and the
    probes made with the old settings are made again."""
    from powernorm_fairseq.cli import study as norm_study

    out = tmp_path / "s"
    cell = out / "cells" / "d1-w32-ln-xavier-kaiming-lr1-s1"
    cell.mkdir(parents=True)
    (cell / "init.json").write_text("{}")
    (out / "settings.json").write_text(json.dumps({"fairseq_args": ["--max-positions", "4"]}))
    norm_study.main([*GRID, "--data", str(demo), "--out", str(out), "--print-commands", *MORE])
    assert "error" not in capsys.readouterr().err
    assert not (cell / "init.json").exists() and not (out / "settings.json").exists()


def test_paired_differences_and_their_interval():
    from powernorm_fairseq.cli.stats import paired, t975

    d = paired({1: 31.0, 2: 32.0, 3: 33.0}, {1: 30.0, 2: 30.0, 3: 30.0})  # differences 1, 2, 3
    half = 4.303 * 1.0 / math.sqrt(3)
    assert d["n"] == 3 and d["mean"] == pytest.approx(2.0)
    assert (d["low"], d["high"]) == (pytest.approx(2 - half, abs=1e-3), pytest.approx(2 + half, abs=1e-3))
    assert not d["evidence"]
    d = paired({s: 30 + 1 + 0.01 * s for s in range(1, 6)}, {s: 30.0 for s in range(1, 6)})
    assert d["evidence"] and d["low"] > 0
    assert paired({1: 1.0}, {1: 0.0}) is None  # one seed: no interval
    # Student's t 0.975 quantiles as printed tables give them (Abramowitz & Stegun, Table 26.10)
    for df, t in ((1, 12.706), (2, 4.303), (5, 2.571), (29, 2.045), (30, 2.042), (60, 2.000), (120, 1.980)):
        assert t975(df) == pytest.approx(t, abs=1e-3)


def descendants(pid):
    """Every process below ``pid``, from /proc's parent links."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_the_pools_fork_server_preloads_modules_that_exist():
    """multiprocessing's fork server passes over a preload that fails to import, and each worker would then
    import it itself, as slowly as a worker started afresh."""
    import importlib.util

    from powernorm_fairseq.cli.study.launchers import PRELOAD

    assert [m for m in PRELOAD if importlib.util.find_spec(m) is None] == []


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_ends_every_cell_of_a_parallel_study(demo, tmp_path, signal_name):
    """SIGTERM to the script (a scheduler), or SIGINT to its process group
    (Ctrl-C): every process ends, no cell is taken for finished, and no
    worker prints a traceback; Ctrl-C gets one line saying how to resume."""
    import signal

    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore"}
    out = tmp_path / "s"
    long = ["--lrs", "0.01", "--norms", "ln", "bn", "--max-update", "100000"]  # two cells that neither end nor diverge
    script = subprocess.Popen(["bash", "scripts/norm-study.sh", *GRID, *long, "--jobs", "2",
                               "--data", str(demo), "--out", str(out)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while len(list(out.glob("cells/*/train.log"))) < 2:  # both workers are training
        assert time.time() < deadline and script.poll() is None, script.stderr.read() if script.poll() else ""
        time.sleep(0.1)
    below = descendants(script.pid)
    assert len(below) >= 4  # the supervisor's bash, python, and two workers at least
    if signal_name == "SIGTERM":
        script.send_signal(signal.SIGTERM)
    else:
        os.killpg(script.pid, signal.SIGINT)
    assert script.wait(timeout=60) != 0
    console = script.stderr.read()
    assert "Traceback" not in console, console
    if signal_name == "SIGINT":
        assert console.strip().splitlines()[-1].startswith("norm-study.sh: interrupted; "), console
    deadline = time.time() + 30
    while (left := [p for p in below if os.path.exists(f"/proc/{p}")]) and time.time() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left running after SIGTERM: {left}"
    assert not list(out.glob("cells/*/result.json"))  # no cell is taken for finished

def test_a_worker_killed_mid_cell_neither_hangs_the_study_nor_loses_its_cell(demo, tmp_path):
    """The system's OOM killer (SIGKILL) takes one worker of ``--jobs 2`` in
    the middle of a cell: the study names the cells it held, runs them again
    in new processes, and ends with every cell's result."""
    import signal

    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore"}
    out = tmp_path / "s"
    script = subprocess.Popen(["bash", "scripts/norm-study.sh", *GRID, "--lrs", "0.1", "--norms", "ln", "bn",
                               "--max-update", "40", "--jobs", "2", "--data", str(demo), "--out", str(out)],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    victim, deadline = None, time.time() + 120
    while victim is None:
        assert time.time() < deadline and script.poll() is None, script.stderr.read() if script.poll() else ""
        for pid in descendants(script.pid):  # the worker with a cell's log open
            try:
                logs = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            except OSError:
                continue
            held = [Path(log).parent.name for log in logs if log.endswith("/train.log")]
            if held:
                victim, cell = pid, held[0]
                break
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    try:
        assert script.wait(timeout=300) == 0, script.stderr.read()
    finally:
        script.kill()
    console = script.stderr.read()
    line = [x for x in console.splitlines() if "ended abruptly" in x]
    assert len(line) == 1 and cell in line[0] and "started again" in line[0], console
    results = [json.loads(p.read_text()) for p in out.glob("cells/*/result.json")]
    assert len(results) == 2 and all(r["status"] == "finished" and r["updates"] == 40 for r in results), console



def last_line(proc):
    return proc.stderr.strip().splitlines()[-1]


def test_preparation_accepts_only_label_sets_that_train(tmp_path):
    """Labels that would not train are refused in one line, before anything is
    binarized; a header, a BOM, case variants, U+2028 and latin-1's 0x85 are
    read as what they are."""
    import random

    words = "profit sales rose fell the company shares market quarter growth".split()
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(words) for _ in range(6)) + f" {i} ." for i in range(40)]
    rows = [(s, "up" if i % 2 else "down") for i, s in enumerate(sentences)]
    # a label of one sentence, which this seed's shuffle puts in valid (the recipe's own shuffle, replayed)
    with_rare = [*rows[1:], (rows[0][0] + "!", "rare")]

    def in_valid(seed):
        order = list(with_rare)
        random.Random(seed).shuffle(order)
        return ("rare" in [label for _, label in order[:8]])  # valid is the first 20%

    seed = next(seed for seed in range(1, 100) if in_valid(seed))
    src = tmp_path / "rare.tsv"
    src.write_text("".join(f"{s}\t{label}\n" for s, label in with_rare))
    proc = recipe("data-prep/prepare-phrasebank.sh", "--src", src, "--out", tmp_path / "a", "--seed", str(seed),
                  check=False)
    assert proc.returncode != 0 and "label 'rare' (1 sentence(s)) falls in no training sentence" in last_line(proc)
    assert len(proc.stderr.strip().splitlines()) <= 2 and not (tmp_path / "a" / "bin").exists()
    for name, text, flags, message in (
            ("header.tsv", "sentence\tlabel\n" + "".join(f"{s}\t{lab}\n" for s, lab in rows), [],
             "header.tsv:1 looks like a header (one word, and its label 'label' is on no other line): pass --header"),
            ("three.tsv", "".join(f"{s}\tx\t{lab}\n" for s, lab in rows), [],
             "40 malformed line(s) in"),
    ):
        (tmp_path / name).write_text(text)
        proc = recipe("data-prep/prepare-phrasebank.sh", "--src", tmp_path / name, "--out", tmp_path / name[:-4],
                      *flags, check=False)
        assert proc.returncode != 0 and message in last_line(proc), proc.stderr[-1000:]
    assert "3 columns, not 2" in last_line(proc)
    # what trains: a BOM, a header taken by flag, U+2028 inside a sentence, labels folded by flag
    good = tmp_path / "good.tsv"
    good.write_text("\ufeffsentence\tlabel\n" + "".join(
        f"{s}{chr(0x2028) if i == 3 else ''}\t{lab.upper() if i % 4 == 1 else lab}\n"
        for i, (s, lab) in enumerate(rows)), encoding="utf-8")
    proc = recipe("data-prep/prepare-phrasebank.sh", "--src", good, "--out", tmp_path / "good", "--header",
                  "--fold-case", "--bpe-size", "20")
    assert sorted((tmp_path / "good" / "bin" / "label" / "dict.txt").read_text().split()[::2]) == ["down", "up"]
    raw = tmp_path / "good" / "raw"
    texts = (raw / "train.txt").read_text() + (raw / "valid.txt").read_text()
    assert len(texts.split("\n")) == 41 and "\ufeff" not in texts and "sentence" not in texts
    # latin-1 with byte 0x85 (a character there, not a line end), and case variants named without --fold-case
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"".join(f"{s} \x85\t{'Neutral' if i % 5 == 0 else ['positive', 'neutral'][i % 2]}\n".encode(
        "iso-8859-1") for i, (s, _) in enumerate(rows)))
    proc = recipe("data-prep/prepare-phrasebank.sh", "--src", latin, "--out", tmp_path / "latin", "--bpe-size", "20")
    assert "labels that differ only in case are separate classes: Neutral / neutral" in proc.stderr
    raw = tmp_path / "latin" / "raw"
    assert len(((raw / "train.txt").read_text() + (raw / "valid.txt").read_text()).split("\n")) == 41
    assert all(line.split()[-2].isdigit() for line in (raw / "train.txt").read_text().splitlines())  # whole lines
    # another source into a prepared --out: refused, not skipped
    proc = recipe("data-prep/prepare-phrasebank.sh", "--src", latin, "--out", tmp_path / "good", check=False)
    assert proc.returncode != 0 and f"--out {tmp_path / 'good'} holds data prepared from {good}" in last_line(proc)


def test_every_recipe_finds_the_checkouts_environment(tmp_path):
    """Run from a shell with no environment active, a recipe uses the
    checkout's .venv; a checkout without one is refused in one line before
    anything is written."""
    import shutil

    bare = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    proc = subprocess.run(["bash", "data-prep/prepare-phrasebank.sh", "--demo", "60", "--bpe-size", "20", "--out",
                           str(tmp_path / "demo")], cwd=ROOT, env=bare, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "demo" / "bin" / "label" / "dict.txt").exists()
    copy = tmp_path / "checkout"  # the scripts without a .venv beside them
    for part in ("scripts", "data-prep"):
        shutil.copytree(ROOT / part, copy / part)
    scripts = sorted(str(p.relative_to(copy)) for p in [*copy.glob("scripts/*.sh"), *copy.glob("data-prep/*.sh")]
                     if "\nwhole \"$@\"\n" in p.read_text() and p.name != "quickstart.sh")
    assert len(scripts) >= 11
    for script in scripts:
        proc = subprocess.run(["bash", script, "--out", str(tmp_path / "out"), "--save-dir", str(tmp_path / "out")],
                              cwd=copy, env=bare, capture_output=True, text=True, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "no environment with fairseq and this plugin" in lines[0] \
            and "scripts/setup.sh" in lines[0], (script, proc.stderr)
        assert not (tmp_path / "out").exists()


def test_a_full_disk_is_named_by_the_preparation(tmp_path):
    """On a real small file system (tmpfs; mounting one needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        proc = recipe("data-prep/prepare-phrasebank.sh", "--demo", "2000", "--out", disk / "out", check=False)
        assert proc.returncode != 0
        assert "(No space left on device: the file system of" in last_line(proc), proc.stderr[-2000:]
        assert not (disk / "out" / "bin").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_read_only_out_and_a_full_disk_at_the_report_are_one_line(study, demo, tmp_path, capsys, monkeypatch):
    import errno
    import shutil

    from powernorm_fairseq.cli import plots
    from powernorm_fairseq.cli import study as norm_study

    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(locked), str(locked)], capture_output=True).returncode:
        pytest.skip("a read-only bind mount needs root")
    try:
        with pytest.raises(SystemExit):
            norm_study.main([*GRID, "--data", str(demo), "--out", str(locked / "s")])
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and f"--out {locked / 's'}: cannot write there (Read-only file system)" in error[0]
    finally:
        subprocess.run(["umount", str(locked)], check=True)
    out = tmp_path / "study"
    shutil.copytree(study[0], out)
    before = (out / "study.md").read_text()

    def full(fig, path, plt):
        plt.close(fig)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(plots, "save_figure", full)
    with pytest.raises(SystemExit):
        norm_study.main([*GRID, "--data", str(demo), "--out", str(out), "--landscape", *MORE])
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith(f"norm-study.sh: error: {out / 'init_grads.png'}: could not be written (No space "
                                "left on device); every finished cell is kept"), error
    assert (out / "study.md").read_text() == before and not list(out.glob(".*.tmp")) and not list(out.glob(".*png"))


def test_a_switch_axis_gives_each_norm_a_column_with_the_flag_on(demo, tmp_path):
    """--switches: each of the models' on/off flags a column beside its norm (its cells hold it in their
    name and train with it), paired by seed against the first norm without it; an unknown one is refused."""
    out = tmp_path / "switched"
    recipe("scripts/norm-study.sh", "--task", "classification", "--lrs", "0.1", "--depths", "2", "--widths", "32",
           "--norms", "ln", "--placement", "pre", "--switches", "none", "norm-depth-scaling", "norm-unit-offset",
           "--seeds", "1", "2", "--max-update", "4", "--log-interval", "2", "--threads", "1", "--data", demo,
           "--out", out)
    names = sorted(p.name for p in (out / "cells").iterdir())
    switched = ("", "-norm-depth-scaling", "-norm-unit-offset")
    assert names == sorted(f"d2-w32-ln{s}-xavier-kaiming-lr0.1-s{seed}" for s in switched for seed in (1, 2)), names
    from powernorm_fairseq.common.checkpoints import load

    for name in names:
        state = load(str(out / "cells" / name / "checkpoint_last.pt"))
        cfg = state["cfg"]["model"]
        assert (cfg.norm_depth_scaling, cfg.norm_unit_offset) == ("scaling" in name, "offset" in name), name
        gain = next(v for k, v in state["model"].items() if k.endswith("layer_norm.weight"))
        assert (float(gain.abs().max()) < 0.5) == ("offset" in name), name  # stored from 0, or from 1
    text = (out / "study.md").read_text()
    assert "| lr | ln | ln +norm-depth-scaling | ln +norm-unit-offset |" in text
    rows = {r["norm"]: r for r in json.loads((out / "study.json").read_text())["seeds"]}
    assert rows["ln +norm-depth-scaling"]["difference"]["n"] == 2 and rows["ln"]["difference"] is None
    assert rows["ln +norm-unit-offset"]["difference"]["n"] == 2
    bad = recipe("scripts/norm-study.sh", "--task", "classification", "--switches", "depth-scaling", "--data", demo,
                 "--out", tmp_path / "bad", check=False)
    assert bad.returncode == 2 and "--switches: 'depth-scaling' is not an on/off flag of the models; choose from " \
        "none, " in bad.stderr.splitlines()[-1] and not (tmp_path / "bad").exists()


def test_a_study_over_placements_groups_its_tables_and_pairs_them(demo, tmp_path):
    """--placements and --qk-norms join the grid: a table per placement (rezero's cells take norm none),
    names that hold the placement, and the paired differences to the first norm and the first placement."""
    out = tmp_path / "placed"
    recipe("scripts/norm-study.sh", "--task", "classification", "--lrs", "0.1", "--depths", "1", "--widths", "32",
           "--norms", "ln", "pn", "--placements", "pre", "rezero", "--qk-norms", "none", "rmsnorm", "--seeds", "1", "2",
           "--max-update", "4", "--log-interval", "2", "--threads", "1", "--data", demo, "--out", out)
    names = sorted(p.name for p in (out / "cells").iterdir())
    assert len(names) == 12 and "d1-w32-ln-pre-xavier-kaiming-lr0.1-s1" in names
    assert "d1-w32-none-rezero-qkrmsnorm-xavier-kaiming-lr0.1-s2" in names
    text = (out / "study.md").read_text()
    assert "placements pre, rezero" in text
    for heading in ("## pre, depth 1", "## pre, qk-norm rmsnorm, depth 1", "## rezero, depth 1",
                    "## rezero, qk-norm rmsnorm, depth 1"):
        assert heading in text, heading
    assert "| lr | none |" in text and "| lr | ln | pn |" in text
    study = json.loads((out / "study.json").read_text())
    rows = {(r["placement"], r["qk"], r["norm"]): r for r in study["seeds"]}
    assert len(rows) == 6
    assert rows["pre", "none", "pn"]["difference"] is not None
    assert rows["pre", "none", "pn"]["placement_difference"] is None
    moved = rows["rezero", "rmsnorm", "none"]["placement_difference"]  # against pre's first norm, ln
    assert moved is not None and moved["n"] == 2
