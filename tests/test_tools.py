"""powernorm-average and powernorm-score."""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import ROOT, cli
from powernorm_fairseq.cli.average import average_checkpoints, last_checkpoints
from powernorm_fairseq.cli.score import read_generate_output, score, split_compounds

pytestmark = pytest.mark.fast


def fake_checkpoint(path, value, steps):
    state = {
        "args": argparse.Namespace(arch="powernorm_transformer_iwslt_de_en"),
        "model": {
            "w": torch.full((2, 2), float(value)),
            "encoder.layer_norm.running_psi2": torch.full((2,), 2.0 * value),
            "encoder.layer_norm.num_steps": torch.tensor(steps),
        },
        "extra_state": {"epoch": value},
    }
    torch.save(state, path)
    time.sleep(0.01)  # distinct modification times: the newest gives the metadata


def test_average_parameters_and_running_statistics(tmp_path):
    for epoch in (1, 2, 3, 4):
        fake_checkpoint(tmp_path / f"checkpoint{epoch}.pt", epoch, steps=10 * epoch)
    paths = last_checkpoints(tmp_path, 3)
    assert [p.name for p in paths] == ["checkpoint4.pt", "checkpoint3.pt", "checkpoint2.pt"]
    avg = average_checkpoints(paths)
    torch.testing.assert_close(avg["model"]["w"], torch.full((2, 2), 3.0))
    torch.testing.assert_close(avg["model"]["encoder.layer_norm.running_psi2"], torch.full((2,), 6.0))
    assert int(avg["model"]["encoder.layer_norm.num_steps"]) == 40  # the newest counter
    assert avg["extra_state"]["epoch"] == 4


@pytest.mark.slow
def test_average_cli_writes_a_loadable_checkpoint(tmp_path):
    for epoch in (1, 2):
        fake_checkpoint(tmp_path / f"checkpoint{epoch}.pt", epoch, steps=epoch)
    out = tmp_path / "avg.pt"
    proc = cli("powernorm-average", "--inputs", tmp_path, "--num-epoch-checkpoints", "2", "--output", out)
    assert "averaged 2 checkpoints" in proc.stderr and "running statistics" in proc.stderr
    torch.testing.assert_close(torch.load(out, weights_only=True)["model"]["w"], torch.full((2, 2), 1.5))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".avg.pt")]  # no temporary left


@pytest.mark.slow
def test_average_cli_errors(tmp_path):
    fake_checkpoint(tmp_path / "checkpoint1.pt", 1, steps=1)
    proc = cli("powernorm-average", "--inputs", tmp_path, "--num-epoch-checkpoints", "3",
               "--output", tmp_path / "avg.pt", check=False)
    assert proc.returncode == 2 and "has 1 epoch checkpoints, 3 requested" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "avg.pt").exists()


@pytest.mark.slow
def test_average_refuses_to_write_over_one_of_its_inputs(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    fake_checkpoint(a, 1, steps=1)
    fake_checkpoint(b, 3, steps=3)
    before = a.read_bytes()
    for output in (a, tmp_path / "." / "a.pt"):
        proc = cli("powernorm-average", "--inputs", a, b, "--output", output, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"powernorm-average: error: --output {output} is one of the inputs ({a}): it would be overwritten; "
            "name another file"]
    assert a.read_bytes() == before


GENERATE = """S-1\tdas haus
T-1\tThe house
H-1\t-0.2\tthe house
D-1\t-0.2\tthe house
S-0\tder state-of-the-art hund
T-0\ta state-of-the-art dog
H-0\t-0.1\ta state-of-the-art dog
Generate test with beam=5: BLEU4 = 100.00
"""


def test_read_generate_output_orders_by_id(tmp_path):
    path = tmp_path / "gen.txt"
    path.write_text(GENERATE)
    hyps, refs = read_generate_output(path)
    assert hyps == ["a state-of-the-art dog", "the house"]
    assert refs == ["a state-of-the-art dog", "The house"]


def test_bleu_definitions():
    hyps, refs = ["the house is red", "a state-of-the-art dog"], ["The house is red", "a state-of-the-art dog"]
    iwslt = score(hyps, refs, "iwslt14", "en")
    wmt = score(hyps, refs, "wmt14", "en")
    assert iwslt["bleu"][0] == pytest.approx(100.0) and "case-insensitive" in iwslt["bleu"][1]
    assert wmt["bleu"][0] < 100.0 and "case-sensitive" in wmt["bleu"][1]
    assert wmt["sacrebleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert "test:" not in wmt["sacrebleu_signature"]
    own = score(hyps, refs, "wmt14", "en", raw_refs=refs, test_set=("wmt14/full", "en-de"))
    assert "|test:wmt14/full|lang:en-de|" in own["sacrebleu_signature"]  # as `sacrebleu -t wmt14/full -l en-de`
    assert "sacrebleu's wmt14/full en-de references" in own["sacrebleu"][1]
    assert split_compounds("a-b-c d-e") == "a ##AT##-##AT## b-c d ##AT##-##AT## e"


@pytest.mark.slow
def test_score_cli(tmp_path):
    path = tmp_path / "gen.txt"
    path.write_text(GENERATE)
    raw = tmp_path / "ref.en"
    raw.write_text("A state-of-the-art dog\nThe house\n")
    (tmp_path / "ref.en.sacrebleu").write_text("wmt14/full de-en\n")
    proc = cli("powernorm-score", path, "--bleu", "iwslt14", "--raw-ref", raw, "--checkpoints", "5",
               "--json", tmp_path / "s.json")
    assert "tokenized BLEU, case-insensitive; 5 checkpoint(s) averaged" in proc.stdout
    assert "vs sacrebleu's wmt14/full de-en references" in proc.stdout and "sacreBLEU signature: nrefs:1" in proc.stdout
    assert "|test:wmt14/full|lang:de-en|" in proc.stdout
    bad = cli("powernorm-score", raw, "--bleu", "iwslt14", check=False)
    assert bad.returncode == 2 and "no complete H-/T- pairs" in bad.stderr


def test_checkpoint_copies_are_atomic(tmp_path, monkeypatch):
    """A copy interrupted half-way (fairseq copies checkpoint_last.pt and
    _best.pt from the first file it saved) leaves the previous file whole."""
    import shutil

    from fairseq.file_io import PathManager

    from powernorm_fairseq.patches.checkpoints import atomic_checkpoint_copies

    atomic_checkpoint_copies()
    src, dst = tmp_path / "checkpoint_best.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(b"new" * 1000)
    dst.write_bytes(b"old")
    assert PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == b"new" * 1000

    def killed_half_way(a, b, **kwargs):
        Path(b).write_bytes(Path(a).read_bytes()[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copyfile", killed_half_way)
    src.write_bytes(b"newer" * 1000)
    with pytest.raises(KeyboardInterrupt):
        PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == b"new" * 1000  # the previous checkpoint_last.pt is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt", "checkpoint_last.pt"]


def test_background_batch_loaders_stop_before_exit():
    import itertools
    import threading

    import torch
    from fairseq.data.iterators import BackgroundConsumer, BufferedIterator

    from powernorm_fairseq.patches.shutdown import stop_background_loaders

    class Endless:
        def __len__(self):
            return 10 ** 9

        def __iter__(self):
            return (torch.tensor([i]) for i in itertools.count())

    itr = BufferedIterator(2, Endless())
    assert int(next(itr)) == 0
    threads = [t for t in threading.enumerate() if isinstance(t, BackgroundConsumer)]
    assert threads and all(t.is_alive() for t in threads)
    stop_background_loaders(timeout=5)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.slow
def test_process_groups_end_before_exit(tmp_path):
    """fairseq leaves the default group and its own cached group of all ranks
    open; the plugin destroys both at exit, and their worker threads end
    before the interpreter finalises. A handler registered before the
    plugin's runs after it and reports."""
    program = f"""
import atexit, os
import torch, torch.distributed as dist
from fairseq.distributed.utils import get_global_group
threads = lambda: len(os.listdir("/proc/self/task"))
torch.ones(64, 64) @ torch.ones(64, 64)  # torch's own thread pools start here
before = threads()
atexit.register(lambda: print("at exit:", dist.is_initialized(), threads() - before))
from powernorm_fairseq import patches
patches.for_the_models()
dist.init_process_group("gloo", init_method="file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
dist.all_reduce(t, group=get_global_group())
dist.barrier(get_global_group())  # as fairseq's distributed_main ends
print("running:", dist.is_initialized(), threads() - before > 0)
"""
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["running: True True", "at exit: False 0"], out


@pytest.mark.slow
def test_powernorm_flags_lists_every_flag_the_models_take():
    """Every flag of the models' parsers, with its default, from the one definition (NormConfig)."""
    from powernorm_fairseq.models.options import add_norm_args

    out = cli("powernorm-flags", "--format", "markdown").stdout
    listed = {line.split("`")[1].split(" / ")[0] for line in out.splitlines()[2:]}
    for lm in (False, True):
        parser = argparse.ArgumentParser()
        add_norm_args(parser, lm=lm)
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        assert {f for f in flags if not f.startswith("--no-")} <= listed
    assert "| `--pn-alpha-fwd` | `0.9` |" in out
    from powernorm_fairseq.norms.placement import PLACEMENTS

    assert f"| `--norm-placement` | `pre` | `{','.join(PLACEMENTS)}` |" in out


def test_the_console_shows_an_epochs_last_validation():
    """With --validate-interval-updates an epoch validates several times; its line shows the last."""
    from powernorm_fairseq.cli.progress import Summary

    summary, shown = Summary(), []
    for source, body in [("valid", "epoch 001 | loss 9.5 | ppl 700"), ("valid", "epoch 001 | loss 8.25 | ppl 300"),
                         ("train", "epoch 001 | loss 9.75 | wps 1000 | num_updates 20 | wall 12")]:
        shown += summary.lines(f"2026-11-24 10:00:00 | INFO | {source} | {body}")
    assert shown == ["epoch   1 | train loss 9.750 | valid loss 8.250 | 1,000 words/s | 20 updates | 0:00:12"]


def test_the_heartbeat_reads_each_log_on_from_where_it_stopped(tmp_path, monkeypatch):
    """A launcher's heartbeat (cli/progress.py's ``where`` with the dict it keeps) says, at every point of a
    growing log, a line still being written among them, what a reading of the whole log says; it reads only
    what the log gained; a log replaced, or cut shorter, is read again from its start."""
    from powernorm_fairseq.cli import progress

    records = ["2026-11-24 10:00:00 | INFO | fairseq_cli.train | {'optimization': {'max_epoch': 4, 'max_update': 0}}"]
    for epoch in (1, 2, 3):
        for k in (10, 20, 30):
            records.append(f"2026-11-24 10:00:{k:02} | INFO | train_inner | epoch {epoch:03}:     {k} / 40 "
                           f"loss=9.5, wps={1000 + k}, ups=2.0, num_updates={40 * (epoch - 1) + k}, lr=0.001, wall={k}")
        records.append(f"2026-11-24 10:00:40 | INFO | train | epoch {epoch:03} | loss 9.25 | wps 1200 | "
                       f"num_updates {40 * epoch} | wall {40 * epoch}")
    text = "".join(line + "\n" for line in records).encode()
    log, read, bytes_read = tmp_path / "train.log", {}, []
    monkeypatch.setattr(progress.time, "time", lambda: 1e9)  # the same age for both readings
    real_open = open

    def counting(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "b" in mode:
            read_at = f.read
            f.read = lambda size=-1: bytes_read.append(len(chunk := read_at(size))) or chunk
        return f

    monkeypatch.setattr("builtins.open", counting)
    longest, before = max(len(line) + 1 for line in records), 0
    for cut in list(range(0, len(text), 97)) + [len(text)]:  # mid-line cuts too
        log.write_bytes(text[:cut])
        os.utime(log, (1e9 - 5, 1e9 - 5))
        bytes_read.clear()
        on = progress.where(log, read)
        assert bytes_read[0] <= cut - before + longest, (cut, bytes_read)  # what it gained, and a partial line
        assert on == progress.where(log) and bytes_read[1] == cut, cut
        before = cut
    assert "epoch 3/4" in progress.where(log, read)
    log.write_bytes(text[:len(text) // 2])  # cut shorter (a run started again in its directory)
    os.utime(log, (1e9 - 5, 1e9 - 5))
    assert progress.where(log, read) == progress.where(log) != progress.where(tmp_path / "none", {})
    log.unlink()
    log.write_bytes(text)  # replaced
    os.utime(log, (1e9 - 5, 1e9 - 5))
    assert progress.where(log, read) == progress.where(log)


@pytest.mark.slow
def test_a_training_s_console_says_where_it_is_at_least_every_heartbeat(tmp_path):
    """The console filter (cli/progress.py, what every recipe pipes fairseq-train through), fed a real
    run's records with a pause mid-epoch: a heartbeat line (epoch k/N, update, words/s, ETA) within its
    --heartbeat seconds of silence, none while lines come; each console line in the run's log too."""
    config = "2026-11-24 10:00:00 | INFO | fairseq_cli.train | {'optimization': {'max_epoch': 4, 'max_update': 0}}"
    inner = ("2026-11-24 10:00:10 | INFO | train_inner | epoch 001:     20 / 40 loss=9.5, wps=1234.5, ups=2.0, "
             "num_updates=20, lr=0.001, wall=10")
    epoch = "2026-11-24 10:00:20 | INFO | train | epoch 001 | loss 9.25 | wps 1200 | num_updates 40 | wall 20"
    log = tmp_path / "train.log"
    proc = subprocess.Popen([sys.executable, "-m", "powernorm_fairseq.cli.progress", "--log", str(log),
                             "--heartbeat", "1"], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in (config, "2026-11-24 10:00:01 | INFO | fairseq.trainer | Start iterating over samples", inner):
        proc.stdin.write(line + "\n")
    proc.stdin.flush()
    time.sleep(2.5)
    proc.stdin.write(epoch + "\n")
    _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert 1 <= len(lines) - 1 <= 3, lines  # the heartbeats of 2.5 s of silence, then the epoch's line
    assert lines[0] == "epoch 1/4, update 20 (20/40 of the epoch) | 1,234 words/s | 0:00:10 | ETA 0:01:10 " \
        "(still training; the last record 0:00:0" + lines[0][-6:], lines
    assert lines[-1] == "epoch 1/4 | train loss 9.250 | 1,200 words/s | 40 updates | 0:00:20 | ETA 0:01:00"
    kept = [line.split(" | ", 3)[3] for line in log.read_text().splitlines() if "powernorm_fairseq.progress" in line]
    assert kept == lines


@pytest.mark.slow
def test_the_set_up_says_each_stage_and_how_long_it_has_run(tmp_path):
    """scripts/setup.sh on a fresh checkout, with an interpreter that stands in for Python and pip
    (each install takes 1.2 s): a line per stage with the time so far, a line at least every
    POWERNORM_HEARTBEAT seconds while one runs, and the total at the end."""
    import shutil

    checkout = tmp_path / "checkout"
    for name in ("scripts/setup.sh", "requirements.txt", "requirements-dev.txt", "pyproject.toml", "setup.py"):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, checkout / name)
    (checkout / "powernorm_fairseq/norms/kernels/csrc").mkdir(parents=True)
    (checkout / "powernorm_fairseq/norms/kernels/csrc/norms.cpp").write_text("")
    python = tmp_path / "python"
    python.write_text("""#!/usr/bin/env bash
case "$1 $2" in
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
  "-m pip") [[ "$3" == uninstall ]] || sleep 1.2 ;;
  -c*) case "$2" in *version_info*) echo 3.11 ;; *torch.version.cuda*) echo "2.13.0+cpu CPU only" ;; esac ;;
esac
""")
    python.chmod(0o755)
    proc = subprocess.run(["bash", str(checkout / "scripts/setup.sh"), "--python", str(python)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "POWERNORM_HEARTBEAT": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    stages = [line for line in lines if not line.startswith("setup.sh: still ")]
    assert [re.sub(r" \(\d+:\d\d\)$", "", line) for line in stages[:-1]] == [
        f"setup.sh: creating {checkout}/.venv", "setup.sh: installing torch==2.13.0 (the largest download)",
        "setup.sh: installing requirements-dev.txt (the runtime's, the tests' and the linter's)",
        "setup.sh: building fairseq-fixed==0.12.3.1 against that torch",
        "setup.sh: installing the plugin and compiling its CPU kernels"], lines
    assert re.fullmatch(r"setup.sh: environment ready in \S+ \(Python 3.11, torch 2.13.0\+cpu CPU only\), in "
                        r"0:0[4-9]", stages[-1]), lines
    assert sum(line.startswith("setup.sh: still installing torch==2.13.0") for line in lines) >= 1, lines
    again = subprocess.run(["bash", str(checkout / "scripts/setup.sh"), "--python", str(python)], capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == "", again.stdout  # up to date: nothing to say


@pytest.mark.slow
def test_without_fairseq_the_norms_run_and_the_models_name_the_install_command():
    """`pip install .` brings no fairseq (pyproject.toml says why): in a fresh interpreter that finds
    none, the norm library runs, and importing the models says in one line what is missing and the
    command that installs it."""
    code = ("import importlib.util\nfind = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'fairseq' else find(name, *a)\n"
            "import torch\nfrom powernorm_fairseq.norms import build_norm\n"
            "build_norm('pn', 8).train()(torch.randn(3, 2, 8)).sum().backward()\nimport sys\n"
            "assert 'fairseq' not in sys.modules\nfrom powernorm_fairseq import models\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("ImportError: powernorm_fairseq's models need fairseq"), proc.stderr
    assert "pip install --no-deps --no-build-isolation fairseq-fixed==0.12.3.1" in last


def test_every_runtime_import_is_a_declared_dependency():
    """pyproject.toml declares what the package imports: a plain `pip install .`
    has the kernels' build (ninja, filelock) and powernorm-analyze's figures
    (matplotlib). fairseq and what it brings (hydra-core, omegaconf) are
    installed apart, without their deps (pyproject.toml says why); triton is
    the `gpu` extra."""
    import ast
    import importlib
    import importlib.metadata
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda spec: re.match(r"[A-Za-z0-9_.-]+", spec)[0].lower()  # noqa: E731
    declared = {name(d) for d in project["dependencies"]}
    extras = {name(d) for deps in project["optional-dependencies"].values() for d in deps}
    imported = set()
    for path in (ROOT / "powernorm_fairseq").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    distributions = importlib.metadata.packages_distributions()
    needed = {dist.lower() for module in imported - set(sys.stdlib_module_names) - {"powernorm_fairseq"}
              for dist in distributions[module]}
    assert needed - declared - extras == {"fairseq-fixed", "hydra-core", "omegaconf"}
    assert "triton" in extras and {"ninja", "filelock", "matplotlib", "torch"} <= declared
    for script, target in project["scripts"].items():  # each console script names a real function
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), script


def package_imports():
    """{module: the package's modules it imports, at any depth of its code}."""
    import ast

    package = ROOT / "powernorm_fairseq"
    names = {}
    for path in package.rglob("*"):
        if path.suffix in (".py", ".so") and "csrc" not in path.parts:
            parts = [*path.relative_to(ROOT).parent.parts, path.name.split(".")[0]]
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in names.items():
        if path.suffix == ".so":
            continue
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in names else source for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[module] = {m for m in found if m in names and m != module}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = package_imports()

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted(m for m in graph if m in reach(m))
    assert circles == []
    # the GPU backend: its kernels, their plans and launcher, and the contract they meet; nothing of the rest
    kernels = "powernorm_fairseq.norms.kernels."
    assert graph[kernels + "gpu"] == {kernels + m for m in ("compiled", "contract", "launcher", "plans", "gpu_channel",
                                                            "gpu_rows")}
    assert graph[kernels + "gpu_channel"] == {kernels + "contract", kernels + "gpu_helpers"}
    assert graph[kernels + "gpu_rows"] == {kernels + "gpu_helpers"} and graph[kernels + "gpu_helpers"] == set()
    assert graph[kernels + "launcher"] == graph[kernels + "plans"] == set()


@pytest.mark.fast
def test_every_console_tool_takes_flags_only_as_spelled_in_full():
    """No prefix matching in any parser of the plugin or its scripts
    (``--lr 0.1`` taken as ``--lrs``): each is ``common.flags.ArgumentParser``
    or passes ``allow_abbrev=False``; the ones with ``add_help=False`` gather
    fairseq's flags for fairseq's own parser and are no console's."""
    import ast

    from powernorm_fairseq.common.flags import ArgumentParser

    found = []
    for path in sorted([*(ROOT / "powernorm_fairseq").rglob("*.py"), *(ROOT / "scripts").glob("*.py"),
                        *(ROOT / "bench").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            f = getattr(node, "func", None)
            name = getattr(f, "attr", None) or getattr(f, "id", None)
            if isinstance(node, ast.Call) and name == "ArgumentParser":
                keywords = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
                ours = isinstance(f, ast.Name)  # the one from common.flags, as every module imports it
                found.append(path.name)
                assert ours or keywords.get("allow_abbrev") is False or keywords.get("add_help") is False, \
                    f"{path.relative_to(ROOT)}:{node.lineno}: a parser that takes prefixes of its flags"
    assert {"options.py", "average.py", "progress.py", "docs_tables.py", "run.py"} <= set(found)
    assert ArgumentParser(prog="x").allow_abbrev is False


def test_no_file_of_the_package_or_the_bench_exceeds_400_lines():
    """Every file of the package and of bench/ small enough to read: at most 400 lines, a kernels' file
    (Triton's and C++'s, whose kernels are long) at most 600; the study a package of one job per file."""
    files = [p for p in [*(ROOT / "powernorm_fairseq").rglob("*"), *(ROOT / "bench").glob("*")]
             if p.suffix in (".py", ".cpp", ".h", ".c") and "__pycache__" not in p.parts]
    assert len(files) > 60
    kernels = ROOT / "powernorm_fairseq" / "norms" / "kernels"
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > (600 if p.is_relative_to(kernels) else 400)}
    assert not long, long
    study = {p.name for p in (ROOT / "powernorm_fairseq" / "cli" / "study").glob("*.py")}
    assert {"grid.py", "cell.py", "launchers.py", "slurm.py", "report.py"} <= study


def test_the_kernel_room_names_a_row_kind_only_in_the_kinds_kernels():
    """A per-row or per-entry kind is a descriptor (contract.RowKind, in its module) that the compiled
    module finds by name: of the kernel room and the measuring tools, only the files of the kinds' kernels
    (Triton's, the CPU's and the GPU passes) name one; the plumbing between (contract, ops, autograd,
    backends, bindings, nodes, plans, launches, measures) names none, so a new kind touches its module,
    its kernels and the registry; of the whole package, at most 6 files name one."""
    from powernorm_fairseq.norms.kernels.contract import ROW_KINDS

    assert {"scalenorm", "rmsnorm", "dyt"} <= set(ROW_KINDS)
    package = ROOT / "powernorm_fairseq"
    room = [p for d in ("norms/kernels", "measure") for p in (package / d).rglob("*")
            if p.suffix in (".py", ".cpp", ".h", ".c")]
    assert len(room) > 20
    every = [p for p in package.rglob("*") if p.suffix in (".py", ".cpp", ".h", ".c")]
    for kind in ROW_KINDS:
        naming = {p.name for p in room if kind in p.read_text().lower()}
        assert naming == {"gpu_rows.py", "cpu_rows.h", "gpu_passes.h"}, (kind, naming)
        assert kind in (package / "norms" / f"{kind}.py").read_text().lower()
        # in the whole package: its module (descriptor, passes, its own flags), its kernels, the registry, and
        # at most one more (the study's presets)
        files = sorted(str(p.relative_to(package)) for p in every if kind in p.read_text().lower())
        assert len(files) <= 6, (kind, files)
