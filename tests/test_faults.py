"""Faults a careless or hostile user can cause: checkpoints that hold code,
two runs on one save directory, truncated or mismatched files, a full disk,
and kills at random moments. Each ends in one line naming the file, with
nothing half-written and nothing complete lost."""

import argparse
import errno
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import BIN, ROOT, Command, cli, processes_mentioning, stand_ins, train_args

pytestmark = pytest.mark.slow

USER_DIR = ROOT / "powernorm_fairseq"


class Payload:
    """Unpickled, it opens (creates) ``marker``: code run by loading a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def malicious_checkpoint(path, marker, fmt="zip"):
    state = {"model": {"w": torch.zeros(2)}, "args": Payload(marker), "cfg": None}
    if fmt == "zip":
        torch.save(state, path)
    elif fmt == "legacy":
        torch.save(state, path, _use_new_zipfile_serialization=False)
    else:
        with open(path, "wb") as f:
            pickle.dump(state, f, protocol=int(fmt[-1]))
    return path


class SystemPayload:
    """os.system itself as the global (torch names it "posix.system, whose module is blocked")."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.fast
def test_an_os_system_pickle_is_called_refused_not_corrupt(tmp_path):
    from powernorm_fairseq.common.checkpoints import why_unreadable

    path = tmp_path / "bad.pt"
    torch.save({"model": {}, "args": SystemPayload(tmp_path / "marker")}, path)
    with pytest.raises(pickle.UnpicklingError) as err:
        torch.load(path, weights_only=True)
    assert "refused" in why_unreadable(path, err.value) and not (tmp_path / "marker").exists()
    assert "(posix.system)" in why_unreadable(path, err.value)  # the global it holds, named


def one_line_error(proc, path, tool):
    """The command failed, without a traceback, its last line naming ``path``."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    # a recipe passes on the line of the command it ran
    assert re.match(rf"({re.escape(tool)}|fairseq-[a-z-]+): error:", last) and str(path) in last, last


def sh(*args, env=None, forked=False, **kw):
    """A recipe; ``forked``: with the stand-ins first on its PATH (its fairseq
    commands forked from the fork server, as in test_recipes.py)."""
    first = f"{stand_ins()}:" if forked else ""
    env = {**os.environ, "PATH": f"{first}{BIN}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run(["bash", *map(str, args)], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=600, **kw)


@pytest.mark.parametrize("fmt", ["zip", "legacy", "pickle2", "pickle4"])
def test_the_payload_runs_when_loaded_unsafely_and_average_refuses_it(tmp_path, fmt):
    marker = tmp_path / "marker"
    bad = malicious_checkpoint(tmp_path / "bad.pt", marker, fmt)
    if fmt.startswith("pickle"):
        with open(bad, "rb") as f:
            pickle.load(f)
    else:
        torch.load(bad, weights_only=False)
    assert marker.exists()  # the file really runs code: the refusals below can fail
    marker.unlink()
    proc = cli("powernorm-average", "--inputs", bad, "--output", tmp_path / "avg.pt", check=False)
    one_line_error(proc, bad, "powernorm-average")
    assert not marker.exists() and not (tmp_path / "avg.pt").exists()
    # protocol 4's framing is itself beyond the weights-only reader: refused before any object is made
    assert ("refused" if fmt != "pickle4" else "not a readable checkpoint") in proc.stderr


#: what guides recommend for loading old fairseq checkpoints, and what makes torch.load run a pickle's code
UNSAFE = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


@pytest.mark.parametrize("env", [None, UNSAFE], ids=["default", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_every_command_that_loads_a_checkpoint_refuses_code(toy_data, lm_data, tmp_path, env):
    marker = tmp_path / "marker"
    save = tmp_path / "run"
    save.mkdir()
    bad = malicious_checkpoint(save / "checkpoint_last.pt", marker)
    runs = {
        "fairseq-generate": cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", bad, "--cpu",
                                check=False, env=env),
        "fairseq-interactive": cli("fairseq-interactive", toy_data, "--user-dir", USER_DIR, "--path", bad,
                                   "-s", "de", "-t", "en", "--cpu", input="haus\n", check=False, env=env),
        "fairseq-validate": cli("fairseq-validate", toy_data, "--user-dir", USER_DIR, "--path", bad, "--cpu",
                                "--task", "translation", "--batch-size", "8", check=False, env=env),
        "fairseq-eval-lm": cli("fairseq-eval-lm", lm_data, "--user-dir", USER_DIR, "--path", bad, "--cpu",
                               check=False, env=env),
        "fairseq-train": cli("fairseq-train", *train_args(toy_data, tmp_path / "resume", "--restore-file", bad,
                                                          "--cpu", max_update=2), check=False, env=env),
        "fairseq-train --finetune-from-model": cli(
            "fairseq-train", *train_args(toy_data, tmp_path / "finetune", "--finetune-from-model", bad, "--cpu",
                                         max_update=2), check=False, env=env),
        "powernorm-analyze": cli("powernorm-analyze", "--checkpoints", bad, "--out", tmp_path / "analysis",
                                 check=False, env=env),
        "evaluate.sh": sh("scripts/evaluate.sh", "--dataset", "iwslt14", "--data", toy_data, "--save-dir", save,
                          "--average", "1", "--cpu", env=env, forked=True),
        "evaluate-lm.sh": sh("scripts/evaluate-lm.sh", "--data", lm_data, "--save-dir", save,
                             "--checkpoint", "checkpoint_last.pt", "--cpu", env=env, forked=True),
    }
    for tool, proc in runs.items():
        one_line_error(proc, bad, tool.split()[0])
        assert "refused: it holds what the weights-only loader does not read (io.open)" in \
            proc.stderr.strip().splitlines()[-1], (tool, proc.stderr[-500:])
    assert not marker.exists()
    assert not (tmp_path / "resume" / "checkpoint_last.pt").exists()


@pytest.mark.fast
def test_the_python_loaders_refuse_code_under_the_unsafe_variable(tmp_path, monkeypatch):
    """from_pretrained and load_model_ensemble_and_task (fairseq's readers, in this process) with
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1: the pickle's code does not run, and the refusal names the file."""
    from fairseq import checkpoint_utils
    from fairseq.models.transformer import TransformerModel

    import powernorm_fairseq  # noqa: F401  (installs the patches)
    from powernorm_fairseq.common.errors import InputFileError

    marker = tmp_path / "marker"
    bad = malicious_checkpoint(tmp_path / "checkpoint.pt", marker)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    loaders = [lambda: checkpoint_utils.load_model_ensemble_and_task([str(bad)]),
               lambda: TransformerModel.from_pretrained(str(tmp_path), checkpoint_file="checkpoint.pt")]
    for load in loaders:
        with pytest.raises(InputFileError, match=f"{re.escape(str(bad))}: refused"):
            load()
    assert not marker.exists()
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"  # the environment is left as it was


@pytest.mark.parametrize("planted", ["link", "directory"])
def test_the_lock_is_never_written_through_a_link(toy_data, tmp_path, planted):
    """A link (or a directory) where the save directory's lock goes: refused in
    one line, and the file the link points to is left as it was."""
    save, victim = tmp_path / "run", tmp_path / "precious.txt"
    save.mkdir()
    victim.write_text("the user's data\n")
    if planted == "link":
        (save / ".powernorm-train.lock").symlink_to(victim)
    else:
        (save / ".powernorm-train.lock").mkdir()
    proc = cli("fairseq-train", *train_args(toy_data, save, max_update=1), check=False)
    one_line_error(proc, save, "fairseq-train")
    assert ("is a symbolic link" if planted == "link" else "is not a regular file") in proc.stderr
    assert victim.read_text() == "the user's data\n"
    assert not list(save.glob("checkpoint*.pt"))


def test_a_second_training_on_a_save_directory_stops_and_a_dead_ones_lock_does_not(toy_data, tmp_path):
    save = tmp_path / "run"
    first = Command("fairseq-train", train_args(toy_data, save, max_update=100000))
    try:
        lock = save / ".powernorm-train.lock"
        deadline = time.time() + 120
        while not (lock.exists() and lock.read_text().strip() == str(first.pid)):
            assert time.time() < deadline and first.poll() is None, "the first run never took the lock"
            time.sleep(0.2)
        second = cli("fairseq-train", *train_args(toy_data, save, "--seed", "2", max_update=2), check=False)
        one_line_error(second, save, "fairseq-train")
        assert f"in use by another training (pid {first.pid})" in second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert lock.read_text().strip() == str(first.pid)  # left behind by a killed run
    third = cli("fairseq-train", *train_args(toy_data, save, max_update=3), check=False)
    assert third.returncode == 0, third.stderr[-2000:]


def test_debris_is_removed_and_a_broken_last_checkpoint_is_replaced(toy_data, tmp_path):
    cli("fairseq-train", *train_args(toy_data, tmp_path, max_update=4))
    debris = [tmp_path / ".checkpoint_last.pt.x1y2z3", tmp_path / "checkpoint_last.pt.tmp"]
    for path in debris:
        path.write_bytes(b"partial")
    last = tmp_path / "checkpoint_last.pt"
    last.write_bytes(last.read_bytes()[:1000])  # truncated, as by a full disk
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, max_update=6))
    log = proc.stdout + proc.stderr
    assert "removed 2 partial file(s)" in log and not any(p.exists() for p in debris)
    said = re.search(r"resuming from \S*/(checkpoint\w*\.pt): \1 \(4 updates\) is the newest complete checkpoint; "
                     r"checkpoint_last.pt is incomplete \(kept as checkpoint_last.pt.incomplete-\d+T\d+\)", log)
    assert said, "\n".join(line[-300:] for line in log.splitlines() if "resum" in line)
    assert re.search(rf"Loaded checkpoint .*{said.group(1)} \(epoch \d+ @ 4 updates\)", log), log[-3000:]
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoint_last.pt.incomplete-")]
    assert len(kept) == 1 and len(kept[0].read_bytes()) == 1000  # set aside, not overwritten
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name  # as fairseq's own files


@pytest.mark.fast
def test_a_full_disk_ends_a_save_in_one_line_with_no_partial_file(tmp_path, monkeypatch):
    from fairseq import checkpoint_utils

    from powernorm_fairseq.common.errors import InputFileError
    from powernorm_fairseq.patches.checkpoints import name_failed_saves

    name_failed_saves()

    calls = []

    def full(obj, f):
        calls.append(f)
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    target = tmp_path / "checkpoint7.pt"
    with pytest.raises(InputFileError, match=r"checkpoint7.pt: could not be written \(No space left on device\)"):
        checkpoint_utils.torch_persistent_save({"model": {}}, str(target))
    assert len(calls) == 1  # no retries on a full disk
    assert not target.exists() and not Path(f"{target}.tmp").exists()


@pytest.mark.fast
def test_an_interrupt_in_a_save_is_the_interrupt_not_a_write_failure(tmp_path, monkeypatch):
    """SIGTERM (a SystemExit here) landing in one of torch.save's writes to fairseq's file reaches the
    caller as itself, not as a failed write to retry or name: no retry, no partial file, the last
    checkpoint as it was."""
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    from powernorm_fairseq.patches.checkpoints import name_failed_saves

    name_failed_saves()
    opened, open_ = [], PathManager.open

    def opening(path, mode="r", **kwargs):
        f = open_(path, mode, **kwargs)
        if "w" in mode:
            opened.append(path)
            write = f.write

            def interrupted(data):
                if len(opened) == 1 and f.tell() > 0:
                    raise SystemExit(143)
                return write(data)

            f.write = interrupted
        return f

    monkeypatch.setattr(PathManager, "open", opening)
    target = tmp_path / "checkpoint_last.pt"
    torch.save({"step": 1}, target)
    with pytest.raises(SystemExit) as end:
        checkpoint_utils.torch_persistent_save({"model": {"w": torch.ones(1000)}}, str(target))
    assert end.value.code == 143 and len(opened) == 1
    assert torch.load(target) == {"step": 1} and not Path(f"{target}.tmp").exists()


def fake(path, dim=4, **settings):
    args = argparse.Namespace(**{"arch": "powernorm_transformer_iwslt_de_en", "norm_type": "pn", **settings})
    torch.save({"args": args, "model": {"encoder.w": torch.ones(dim, dim)}}, path)
    return path


@pytest.mark.parametrize("case, message", [
    ("ln-vs-groupnorm", "another model than"),
    ("pn-vs-ln", "norm_type='ln' (not 'pn')"),
    ("64-vs-128", "has shape (8, 8), (4, 4) in"),
    ("same-file-twice", "given twice"),
    ("text-file", "not a readable checkpoint"),
    ("output-is-a-directory", "is a directory"),
])
def test_average_refuses_what_is_not_one_model(tmp_path, case, message):
    a = fake(tmp_path / "a.pt")
    inputs = {
        "ln-vs-groupnorm": lambda: [fake(tmp_path / "ln.pt", norm_type="ln"),
                                    fake(tmp_path / "gn.pt", norm_type="groupnorm")],
        "pn-vs-ln": lambda: [a, fake(tmp_path / "b.pt", norm_type="ln")],
        "64-vs-128": lambda: [a, fake(tmp_path / "b.pt", dim=8)],
        "same-file-twice": lambda: [a, tmp_path / "." / "a.pt"],
        "text-file": lambda: [a, tmp_path / "notes.txt"],
        "output-is-a-directory": lambda: [a, fake(tmp_path / "b.pt")],
    }[case]()
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    output = tmp_path if case == "output-is-a-directory" else tmp_path / "avg.pt"
    proc = cli("powernorm-average", "--inputs", *inputs, "--output", output, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("powernorm-average: error:") and message in last, last
    assert not (tmp_path / "avg.pt").exists() and not list(tmp_path.glob(".avg.pt.*"))


def test_average_keeps_the_file_mode_of_fairseq(tmp_path):
    cli("powernorm-average", "--inputs", fake(tmp_path / "a.pt"), fake(tmp_path / "b.pt"),
        "--output", tmp_path / "avg.pt")
    assert (tmp_path / "avg.pt").stat().st_mode & 0o777 == (tmp_path / "a.pt").stat().st_mode & 0o777


@pytest.fixture
def data_copy(toy_data, tmp_path):
    copy = tmp_path / "bin"
    shutil.copytree(toy_data, copy)
    return copy


@pytest.mark.parametrize("fault, named", [
    ("truncated-bin", "train.de-en.de.bin"),
    ("idx-of-another-split", "train.de-en.de.bin"),
    ("truncated-idx", "train.de-en.de.idx"),
    ("empty-idx", "train.de-en.de.idx"),
    ("random-idx", "train.de-en.de.idx"),
    ("corrupt-idx-header", "train.de-en.de.idx"),
    ("dict-line-without-count", "dict.de.txt"),
    ("dict-not-utf8", "dict.de.txt"),
])
def test_a_bad_binarized_file_is_named_in_one_line(data_copy, tmp_path, fault, named):
    base = data_copy / "train.de-en.de"
    idx, dictionary = Path(f"{base}.idx"), data_copy / "dict.de.txt"
    if fault == "empty-idx":
        idx.write_bytes(b"")
    elif fault == "random-idx":
        idx.write_bytes(random.Random(1).randbytes(5000))
    elif fault == "corrupt-idx-header":
        data = bytearray(idx.read_bytes())
        data[9:17] = b"\xff" * 8
        idx.write_bytes(bytes(data))
    elif fault == "dict-line-without-count":
        lines = dictionary.read_text().splitlines()
        lines[4] = lines[4].rsplit(" ", 1)[0]
        dictionary.write_text("\n".join(lines) + "\n")
    elif fault == "dict-not-utf8":
        dictionary.write_bytes(dictionary.read_bytes() + b"abc\xff 5\n")
    elif fault == "truncated-bin":
        data = Path(f"{base}.bin").read_bytes()
        Path(f"{base}.bin").write_bytes(data[: len(data) // 2])
    elif fault == "idx-of-another-split":
        shutil.copy(data_copy / "valid.de-en.de.idx", f"{base}.idx")
    else:
        data = Path(f"{base}.idx").read_bytes()
        Path(f"{base}.idx").write_bytes(data[: len(data) - 100])
    proc = cli("fairseq-train", *train_args(data_copy, tmp_path / "run", max_update=2), check=False)
    one_line_error(proc, data_copy / named, "fairseq-train")


def newest_on_disk(save):
    """The most updates of any complete checkpoint in ``save``, read with
    torch alone (what a rerun must resume from, whatever the killed run said)."""
    newest = 0
    for path in save.glob("checkpoint*.pt"):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception:  # truncated: not complete
            continue
        newest = max(newest, state["optimizer_history"][-1]["num_updates"])
    return newest


def test_a_rerun_resumes_from_the_newest_complete_checkpoint_by_its_updates(toy_data, tmp_path):
    """checkpoint_last.pt older than a complete checkpoint_1_10.pt (a kill or a full
    disk during the copies after a save): the rerun resumes at 10 updates, and
    says which file and why."""
    argv = train_args(toy_data, tmp_path, "--save-interval-updates", "5", max_update=10)
    cli("fairseq-train", *argv)
    # as a kill during the copies after the save at 10 leaves them: as written at the save at 5, older on
    # disk than checkpoint_1_10.pt (a copy newer on disk is fairseq's rollback idiom: see below)
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        shutil.copy2(tmp_path / "checkpoint_1_5.pt", tmp_path / name)
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, "--save-interval-updates", "5", max_update=12))
    log = proc.stdout + proc.stderr
    assert ("checkpoint_1_10.pt (10 updates) is the newest complete checkpoint; checkpoint_last.pt has 5 updates"
            in log), log[-3000:]
    assert re.search(r"Loaded checkpoint .*checkpoint_1_10.pt \(epoch \d+ @ 10 updates\)", log), log[-3000:]


def test_a_legacy_format_last_checkpoint_is_judged_complete_and_kept(toy_data, tmp_path):
    """torch's legacy (non-zip) format is complete when it loads: it is resumed
    from, not called unreadable and replaced by an older file."""
    cli("fairseq-train", *train_args(toy_data, tmp_path, "--save-interval-updates", "5", max_update=10))
    last = tmp_path / "checkpoint_last.pt"
    state = torch.load(last, map_location="cpu", weights_only=False)
    torch.save(state, last, _use_new_zipfile_serialization=False)
    legacy = last.read_bytes()
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, "--save-interval-updates", "5", max_update=12))
    log = proc.stdout + proc.stderr
    assert "checkpoint_last.pt (10 updates) is the newest complete checkpoint" in log, log[-3000:]
    assert re.search(r"Loaded checkpoint .*checkpoint_last.pt \(epoch \d+ @ 10 updates\)", log), log[-3000:]
    assert not any(p.name.startswith("checkpoint_last.pt.") for p in tmp_path.iterdir())
    assert legacy[:2] != b"PK"


def test_kills_at_random_moments_lose_nothing_complete(toy_data, tmp_path):
    """Fault injection on the save path: kill -9 a training at a random moment
    around one of its saves, several times; each rerun resumes from the newest
    complete checkpoint, and the last one finishes with nothing left over."""
    rng = random.Random(7)
    save = tmp_path / "run"
    flags = ("--save-interval-updates", "2", "--keep-interval-updates", "3")
    argv = train_args(toy_data, save, *flags, max_update=120)
    env = {"PYTHONUNBUFFERED": "1"}  # every log line out before the kill
    saves = re.compile(r"Saved checkpoint .*\(epoch \d+ @ (\d+) updates")
    loaded = re.compile(r"Loaded checkpoint .* @ (\d+) updates\)")
    complete = 0  # updates of the newest complete checkpoint on disk
    for attempt in range(5):
        log_path = tmp_path / f"attempt{attempt}.log"
        with open(log_path, "w") as out:
            proc = Command("fairseq-train", argv, stdout=out, stderr=subprocess.STDOUT, env=env)
            wanted, deadline = rng.randint(1, 4), time.time() + 300
            while proc.poll() is None and len(saves.findall(log_path.read_text())) < wanted:
                assert time.time() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)
            time.sleep(rng.uniform(0, 0.5))  # within or just after the next save
            proc.kill()
            proc.wait()
        log = log_path.read_text()
        if attempt:
            resumed = loaded.search(log)
            assert resumed and int(resumed.group(1)) == complete, log[-3000:]
        complete = newest_on_disk(save)
    assert complete > 0
    final = cli("fairseq-train", *argv, check=False)
    log = final.stdout + final.stderr
    assert final.returncode == 0, log[-3000:]
    assert int(loaded.search(log).group(1)) == complete
    assert not [p.name for p in save.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".checkpoint")]
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 120


def test_a_run_on_a_missing_data_directory_leaves_no_save_directory(tmp_path):
    save = tmp_path / "run"
    proc = cli("fairseq-train", *train_args(tmp_path / "no-such-data", save, max_update=2), check=False)
    one_line_error(proc, tmp_path / "no-such-data", "fairseq-train")
    assert not save.exists()


@pytest.mark.parametrize("env, message", [
    ({"POWERNORM_BACKEND": "bogus"}, "POWERNORM_BACKEND='bogus': choose one of plain, cpu, triton"),
    pytest.param({"POWERNORM_BACKEND": "triton", "TRITON_INTERPRET": "0"}, "POWERNORM_BACKEND=triton needs a GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the triton kernels")),
    ({"POWERNORM_BUILD_WAIT": "abc"}, "POWERNORM_BUILD_WAIT='abc': give a whole number of seconds >= 0"),
    ({"POWERNORM_KERNELS": "no"}, "POWERNORM_KERNELS='no': 0 (the plain PyTorch path) or 1 (the kernels, the default)"),
])
def test_a_bad_environment_is_refused_before_the_run_in_one_line(toy_data, tmp_path, env, message):
    save = tmp_path / "run"
    proc = cli("fairseq-train", *train_args(toy_data, save, max_update=2), check=False, env={**os.environ, **env})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"fairseq-train: error: {message}" or \
        proc.stderr.strip().splitlines()[-1].startswith(f"fairseq-train: error: {message}")
    assert not save.exists() or not list(save.iterdir())  # no crash.pt, nothing


def test_paths_that_cannot_serve_are_refused_in_one_line(toy_data, trained, lm_trained, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = cli("fairseq-train", *train_args(toy_data, afile, max_update=2), check=False)
    one_line_error(proc, f"--save-dir {afile}: is a file, not a directory", "fairseq-train")
    for tool in ("fairseq-generate", "fairseq-interactive"):
        proc = cli(tool, toy_data, "--user-dir", USER_DIR, "--path", tmp_path / "missing.pt", input="haus\n",
                   check=False)
        one_line_error(proc, f"--path {tmp_path / 'missing.pt'}: no such checkpoint", tool)
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path / "run", "--restore-file", tmp_path / "missing.pt",
                                            max_update=2), check=False)
    one_line_error(proc, f"--restore-file {tmp_path / 'missing.pt'}: no such checkpoint", "fairseq-train")
    proc = cli("powernorm-analyze", "--logs", tmp_path, "--out", afile, check=False)
    one_line_error(proc, f"--out {afile} is a file", "powernorm-analyze")
    assert afile.read_text() == "x"
    # a language model's data directory is not a translation one: the task's dictionary is named
    proc = cli("fairseq-eval-lm", toy_data, "--user-dir", USER_DIR, "--path",
               lm_trained("ln") / "checkpoint_last.pt", "--cpu", check=False)
    one_line_error(proc, f"no such file: {toy_data}/dict.txt", "fairseq-eval-lm")
    garbage = tmp_path / "garbage.pt"  # and an unreadable checkpoint: still the user's input, in one line
    garbage.write_bytes(b"not a checkpoint")
    proc = cli("fairseq-eval-lm", toy_data, "--user-dir", USER_DIR, "--path", garbage, "--cpu", check=False)
    one_line_error(proc, f"no such file: {toy_data}/dict.txt", "fairseq-eval-lm")


def test_evaluating_a_read_only_save_directory_is_refused_in_one_line(toy_data, trained, tmp_path):
    save = tmp_path / "run"
    shutil.copytree(trained("pn"), save)
    if subprocess.run(["mount", "--bind", "-o", "ro", str(save), str(save)], capture_output=True).returncode:
        pytest.skip("a read-only bind mount needs root")
    try:
        for script in ("evaluate.sh", "evaluate-lm.sh"):
            proc = sh(f"scripts/{script}", "--data", toy_data, "--save-dir", save, "--cpu", forked=True)
            one_line_error(proc, f"--save-dir: cannot write into '{save}'", script)
    finally:
        subprocess.run(["umount", str(save)], check=True)


def test_resuming_with_other_dimensions_is_refused_in_one_line(toy_data, trained, tmp_path):
    save = tmp_path / "run"
    shutil.copytree(trained("pn"), save)
    args = train_args(toy_data, save, max_update=50)
    args[args.index("--encoder-ffn-embed-dim") + 1] = "48"
    proc = cli("fairseq-train", *args, check=False)
    one_line_error(proc, "the checkpoint's tensors have other shapes than the model's", "fairseq-train")
    assert "checkpoint [64, 32], model [48, 32]" in proc.stderr


@pytest.mark.parametrize("size, named", [
    ("1000k", "checkpoint_last.pt"),  # the first save fits, its copy to checkpoint_last.pt does not
    ("400k", "checkpoint_best.pt"),  # torch.save itself runs out of room
])
def test_a_full_file_system_ends_the_run_in_one_line_with_no_partial_file(toy_data, tmp_path, size, named):
    """On a real small file system (tmpfs; mounting one needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        save = disk / "run"
        proc = cli("fairseq-train", *train_args(toy_data, save, max_update=4), check=False)
        one_line_error(proc, save / named, "fairseq-train")
        assert "could not be written (No space left on device)" in proc.stderr.strip().splitlines()[-1]
        # nothing partial; the directory itself is gone when the run made it and saved nothing whole
        left = [p.name for p in save.iterdir()] if save.exists() else []
        assert not [n for n in left if n.endswith(".tmp") or n.startswith(".checkpoint")], left
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_an_overlong_line_is_skipped_by_fairseq_interactive_which_goes_on(toy_data, trained):
    lines = "haus baum\n" + " ".join(["haus"] * 1100) + "\nkatze hund\n"
    proc = cli("fairseq-interactive", toy_data, "--user-dir", USER_DIR, "--path", trained("pn") / "checkpoint_last.pt",
               "-s", "de", "-t", "en", input=lines, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(re.findall(r"^H-(\d+)\t", proc.stdout, re.M)) == ["0", "2"]  # the lines around it translated
    said = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-interactive: skipped")]
    assert said == ["fairseq-interactive: skipped a line of 1101 tokens, more than the model takes (1024): "
                    "'haus haus haus haus haus haus haus haus ...'"]


def poisoned(source, path, key, value):
    """A copy of checkpoint ``source`` with ``value`` (NaN or inf) in the first element of model entry ``key``."""
    state = torch.load(source, weights_only=True)
    state["model"][key].view(-1)[0] = value
    torch.save(state, path)
    return path


def test_non_finite_checkpoints_are_refused_naming_the_tensor(toy_data, trained, tmp_path):
    run = trained("pn")
    weight = "encoder.layers.0.fc1.weight"
    statistic = "encoder.layers.0.final_layer_norm.running_psi2"
    nan = poisoned(run / "checkpoint_last.pt", tmp_path / "nan.pt", weight, float("nan"))
    inf = poisoned(run / "checkpoint_last.pt", tmp_path / "inf.pt", statistic, float("inf"))
    good = run / "checkpoint_best.pt"
    proc = cli("powernorm-average", "--inputs", good, nan, "--output", tmp_path / "avg.pt", check=False)
    one_line_error(proc, nan, "powernorm-average")
    assert f"{nan}: {weight} holds NaN or inf" in proc.stderr and not (tmp_path / "avg.pt").exists()
    proc = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", inf, "--cpu", check=False)
    one_line_error(proc, inf, "fairseq-generate")
    assert f"{inf}: {statistic} holds NaN or inf" in proc.stderr
    # a post-mortem may load them
    cli("powernorm-average", "--inputs", good, nan, "--output", tmp_path / "avg.pt", "--allow-nonfinite")
    proc = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", inf, "--cpu", check=False,
               env={"POWERNORM_ALLOW_NONFINITE": "1"})
    assert "holds NaN or inf" not in proc.stderr


def test_averaging_takes_the_most_updated_inputs_metadata_whatever_the_order(tmp_path):
    from powernorm_fairseq.cli.average import average_checkpoints

    for i, name in enumerate(["a.pt", "b.pt", "c.pt"]):
        torch.save({"model": {"w": torch.full((3,), float(i)), "steps": torch.tensor(10 * (i + 1))},
                    "optimizer_history": [{"num_updates": 10 * (i + 1)}], "tag": name}, tmp_path / name)
    for order in (["a.pt", "b.pt", "c.pt"], ["c.pt", "a.pt", "b.pt"], ["b.pt", "c.pt", "a.pt"]):
        avg = average_checkpoints([tmp_path / n for n in order])
        assert avg["tag"] == "c.pt" and int(avg["model"]["steps"]) == 30
        assert torch.equal(avg["model"]["w"], torch.full((3,), 1.0))


def test_averaging_memory_does_not_grow_with_the_inputs(tmp_path):
    """30 inputs peak less than two file sizes above 2 inputs: one input and
    one float64 accumulator are held at a time. glibc's mmap threshold is held
    at its default: left to move, it serves these 8 MB blocks from a heap whose
    retained free space varies from run to run (0 to 50 MB over 30 inputs,
    measured), whatever the program holds; fixed, the peak is what it holds."""
    state = {"model": {"w": torch.randn(2_000_000)}, "optimizer_history": [{"num_updates": 1}]}
    paths = []
    for i in range(30):
        paths.append(tmp_path / f"c{i}.pt")
        torch.save(state, paths[-1])
    size = paths[0].stat().st_size

    def peak(inputs):
        code = ("import resource, sys\nfrom powernorm_fairseq.cli.average import main\n"
                "main(sys.argv[1:])\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
        proc = subprocess.run([sys.executable, "-c", code, "--inputs", *map(str, inputs), "--output",
                               str(tmp_path / "avg.pt")], capture_output=True, text=True, cwd=ROOT, check=True,
                              env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
        return int(proc.stdout.split()[-1])

    two, thirty = peak(paths[:2]), peak(paths)
    assert thirty - two < 2 * size, (two, thirty, size)


def test_fairseqs_rollback_idiom_resumes_from_the_copied_checkpoint(toy_data, tmp_path):
    """An earlier checkpoint copied over checkpoint_last.pt (to rerun with a
    lower lr, say): the run goes on from it and says so in one line; the
    checkpoints with more updates are kept aside, never deleted, and the
    chosen state is not deleted by --keep-interval-updates."""
    save = tmp_path / "run"
    keep = ("--save-interval-updates", "5", "--keep-interval-updates", "2")
    cli("fairseq-train", *train_args(toy_data, save, *keep, max_update=20))
    chosen, later = sorted(save.glob("checkpoint_*_15.pt")), sorted(save.glob("checkpoint_*_20.pt"))
    assert len(chosen) == len(later) == 1
    chosen, later = chosen[0], later[0]
    time.sleep(1.1)  # a copy made now is newer on disk than every checkpoint of the first run
    shutil.copyfile(chosen, save / "checkpoint_last.pt")
    proc = cli("fairseq-train", *train_args(toy_data, save, *keep, max_update=17))
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "put there on purpose" in line]
    assert len(said) == 1 and f"checkpoint_last.pt (15 updates) is newer on disk than {later.name}" in said[0]
    assert "@ 15 updates)" in proc.stdout + proc.stderr  # fairseq loaded the chosen state
    assert chosen.exists()  # not deleted: no newer state of this run supersedes it yet
    assert len(list(save.glob(f"{later.name}.abandoned-*"))) == 1
    state = torch.load(save / "checkpoint_last.pt", weights_only=False)
    assert state["optimizer_history"][-1]["num_updates"] == 17



@pytest.mark.parametrize("flags", [("--restore-file", "no-such.pt"), ("--finetune-from-model", "no-such.pt"),
                                   ("--norm-type", "bn")], ids=["restore-file", "finetune", "other-norms"])
def test_a_refused_run_leaves_no_save_directory(toy_data, trained, tmp_path, flags):
    save = tmp_path / "new-run"
    if flags[0] == "--norm-type":  # a checkpoint of other norms to start from: refused after the lock
        flags = (*flags, "--restore-file", str(trained("pn") / "checkpoint_last.pt"), "--reset-optimizer")
    proc = cli("fairseq-train", *train_args(toy_data, save, *flags), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not save.exists(), list(save.iterdir())


def term_while(script, running, tree, wait=0.5):
    """SIGTERM to ``script`` (a Popen) ``wait`` s after a process whose command
    line contains every string of ``running`` appears; then every process
    whose command line mentions ``tree`` must be gone within 30 s."""
    deadline = time.time() + 120
    while not [pid for pid in processes_mentioning(running[0])
               if all(text in open(f"/proc/{pid}/cmdline").read().replace("\0", " ") for text in running)]:
        assert time.time() < deadline and script.poll() is None, f"{running} never ran"
        time.sleep(0.05)
    time.sleep(wait)
    assert script.poll() is None, f"the script ended before the signal: {running}"
    script.send_signal(signal.SIGTERM)
    assert script.wait(timeout=60) != 0
    deadline = time.time() + 30
    while (left := processes_mentioning(str(tree))) and time.time() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left running after SIGTERM: {left}"


@pytest.mark.parametrize("where", ["in a __del__", "caught by the command"])
def test_a_sigterm_is_never_lost(where):
    """Python ignores an exit raised in a ``__del__``, and a command may catch
    it: either way the command ends, at once or after the grace period."""
    program = f"""
import os, signal, time
from powernorm_fairseq.common import files
files.GRACE = 1.0
files.end_cleanly_on_sigterm()
class Trap:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, and Python ignores what it raises
        sum(range(1000))
if {where == "in a __del__"}:
    Trap()
else:
    os.kill(os.getpid(), signal.SIGTERM)
start = time.monotonic()
while time.monotonic() < start + 20:
    try:
        sum(range(1000))
    except BaseException:
        if {where == "in a __del__"}:
            raise
"""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert time.monotonic() - start < (1 if where == "in a __del__" else 5)


def temporaries(directory):
    """Files a step writes before renaming them: ``*.tmp`` and hidden ones (the locks excepted)."""
    return [str(p) for p in Path(directory).rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".")
            and not re.fullmatch(r"\.powernorm-(train|prep)\.lock", p.name)]


def popen(*args):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(["bash", *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("case", ["evaluate.sh averaging", "evaluate.sh --verbose generating",
                                  "evaluate-lm.sh", "data-prep"])
def test_sigterm_ends_every_process_of_a_recipe_and_leaves_no_temporary_file(toy_data, lm_data, trained,
                                                                              lm_trained, tmp_path, case):
    """A scheduler's SIGTERM reaches the script alone; every process it started,
    at any depth, ends with it, and no temporary file is left. A second
    preparation into the same --out is refused while the first runs."""
    save = tmp_path / "run"
    if case.startswith("evaluate.sh"):
        shutil.copytree(trained("pn"), save)
        for epoch in (1, 2):
            shutil.copy(save / "checkpoint_last.pt", save / f"checkpoint{epoch}.pt")
        verbose = ["--verbose", "--average", "1"] if "verbose" in case else ["--average", "2"]
        script = popen("scripts/evaluate.sh", "--dataset", "iwslt14", "--data", toy_data, "--save-dir", save,
                       "--cpu", *verbose)
        term_while(script, ["fairseq-generate" if "verbose" in case else "powernorm-average", str(save)], save)
        assert not (save / "averaged_last_2.pt").exists()  # the average did not go on to write it
    elif case == "evaluate-lm.sh":
        save.mkdir()
        shutil.copy(lm_trained("ln") / "checkpoint_last.pt", save / "checkpoint_last.pt")
        script = popen("scripts/evaluate-lm.sh", "--data", lm_data, "--save-dir", save, "--cpu",
                       "--checkpoint", "checkpoint_last.pt")
        term_while(script, ["fairseq-eval-lm", str(save)], save)
        assert not list(save.glob("perplexity-*"))
    else:
        save = tmp_path / "prep"
        script = popen("data-prep/prepare-quickstart.sh", "--out", save)
        deadline = time.time() + 120
        while not processes_mentioning("sacremoses") or not (save / ".powernorm-prep.lock").exists():
            assert time.time() < deadline and script.poll() is None
            time.sleep(0.05)
        second = sh("data-prep/prepare-quickstart.sh", "--out", save, check=False)
        assert second.returncode != 0 and second.stderr.strip().splitlines()[-1].startswith(
            f"prepare-quickstart.sh: error: --out: '{save}' is being prepared by another run (pid "), second.stderr
        term_while(script, ["sacremoses", str(save)], save, wait=0)
    assert temporaries(save) == []


def test_evaluate_sh_writes_nothing_through_a_link(toy_data, trained, tmp_path):
    """A link planted where evaluate.sh appends its log is refused in one line;
    one planted at its temporary output is removed, not written through."""
    save, victim = tmp_path / "run", tmp_path / "victim"
    shutil.copytree(trained("pn"), save)
    victim.write_text("mine\n")
    flags = ["--dataset", "iwslt14", "--data", toy_data, "--save-dir", save, "--average", "1", "--cpu"]
    (save / "generate.log").symlink_to(victim)
    proc = sh("scripts/evaluate.sh", *flags, forked=True)
    one_line_error(proc, f"{save / 'generate.log'} is a symbolic link", "evaluate.sh")
    (save / "generate.log").unlink()
    (save / "generate-test-checkpoint_last.txt.tmp").symlink_to(victim)
    proc = sh("scripts/evaluate.sh", *flags, forked=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert victim.read_text() == "mine\n" and (save / "generate-test-checkpoint_last.txt").read_text().count("H-")


@pytest.mark.parametrize("child", ["bash", "python"])
def test_the_supervisor_exits_137_when_the_oom_killer_ends_its_child(tmp_path, child):
    """SIGKILL of tree.py's direct child (what the OOM killer sends, and what
    no handler can catch): tree.py exits 137 as a shell does, without a
    traceback, and ends what the child left running."""
    pidfile = tmp_path / "orphan.pid"
    program = {"bash": ["bash", "-c", f"sleep 300 & echo $! > {pidfile}; kill -9 $$"],
               "python": [sys.executable, "-c", "import os, signal, subprocess; "
                          f"open({str(pidfile)!r}, 'w').write(str(subprocess.Popen(['sleep', '300']).pid)); "
                          "os.kill(os.getpid(), signal.SIGKILL)"]}[child]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tree.py"), *program], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL and proc.stderr == "", (proc.returncode, proc.stderr)
    orphan = int(pidfile.read_text())
    assert not Path(f"/proc/{orphan}").exists() or "Z" in Path(f"/proc/{orphan}/stat").read_text().split()[2]


def test_a_score_names_its_checkpoints_and_never_outlives_its_model(toy_data, trained, tmp_path):
    """bleu-test.json says which checkpoints it scored; an evaluation of more
    training, stopped while translating, leaves no earlier score or
    translation beside the new average."""
    import json

    save = tmp_path / "run"
    shutil.copytree(trained("pn"), save)
    for epoch in (1, 2):
        shutil.copy(save / "checkpoint_last.pt", save / f"checkpoint{epoch}.pt")
    flags = ["--dataset", "iwslt14", "--data", toy_data, "--save-dir", save, "--average", "2", "--cpu"]
    proc = sh("scripts/evaluate.sh", *flags, forked=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    scores = json.loads((save / "bleu-test.json").read_text())
    assert sorted(c["file"] for c in scores["scored"]) == ["checkpoint1.pt", "checkpoint2.pt"]
    assert all(c["updates"] == 40 for c in scores["scored"]) and scores["checkpoint"].endswith("averaged_last_2.pt")
    shutil.copy(save / "checkpoint_last.pt", save / "checkpoint3.pt")  # more training
    script = popen("scripts/evaluate.sh", *flags)
    term_while(script, ["fairseq-generate", str(save)], save)
    assert not (save / "bleu-test.json").exists() and not (save / "generate-test-averaged_last_2.txt").exists()
    assert "checkpoint3.pt" in [c["file"] for c in torch.load(save / "averaged_last_2.pt")["averaged_from"]]
