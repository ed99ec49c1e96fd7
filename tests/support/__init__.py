"""What the tests share beyond pytest's fixtures (``conftest.py``): running
console scripts (``commands.py``, through ``forkserver.py``), the toy
corpora and tiny models (``toy.py``), and :func:`once`."""

import json
import os

import pytest

from .commands import BIN, ROOT, Command, cli, norm_query, processes_mentioning, stand_ins
from .toy import (TINY, TINY_LM, USER_DIR, build_model, lm_corpus, losses, make_lm_data, make_toy_data, preprocess,
                  sample, toy_corpus, train_args)


def once(tmp_path_factory, name, make):
    """A directory ``name`` that ``make(path)`` fills once per test session,
    whichever worker asks first; the others wait for it and share it."""
    import shutil

    from filelock import FileLock

    base = shared_base(tmp_path_factory)
    path, made = base / name, base / f"{name}.made"
    with FileLock(str(base / f"{name}.lock")):
        if not made.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            make(path)
            tmp = made.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest(path)))
            tmp.rename(made)
    return path


def shared_base(tmp_path_factory):
    """The session's directory, above each xdist worker's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def manifest(path):
    """Each file under ``path``: its size and modification time, to tell that no test wrote there. A
    lock file is left out: a command that reads there (a rerun that finds its work done) takes it."""
    return {str(f.relative_to(path)): [(stat := f.stat()).st_size, stat.st_mtime_ns]
            for f in sorted(path.rglob("*")) if f.is_file() and f.suffix != ".lock"}


def changed_since_made(base):
    """The shared directories under ``base`` that differ from what :func:`once` made, each with the
    files written, removed or added since."""
    changed = {}
    for made in sorted(base.glob("*.made")):
        before, now = json.loads(made.read_text()), manifest(made.with_suffix(""))
        diff = sorted(f for f in before.keys() | now.keys() if before.get(f) != now.get(f))
        if diff:
            changed[made.stem] = diff
    return changed


def refused_in_process(main, argv, env, capsys):
    """(exit status, stderr's lines) of a command's ``main(argv)`` that refuses its input, run in this
    process with a run's ``env`` (its PATH, and the cluster's SLURM_CONF where it has one): what the
    command's process says, without a fresh interpreter's imports."""
    with pytest.MonkeyPatch.context() as patch:
        for key in ("PATH", "SLURM_CONF"):
            if key in env:
                patch.setenv(key, env[key])
        patch.delenv("POWERNORM_REGISTRY", raising=False)  # main() sets it for the scripts it starts
        capsys.readouterr()
        with pytest.raises(SystemExit) as end:
            main(argv)
    return end.value.code, capsys.readouterr().err.strip().splitlines()


def fast_for(values, fast):
    """``values`` to parametrize a fast test by, each one outside ``fast`` in the
    slow tier: where every case compiles (a second or more each), the fast
    tier keeps the hardest one or two and the full suite runs them all."""
    return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


def backend_or_fail(name):
    """The kernels module of backend ``name``, failing (never skipping) when it is missing."""
    from powernorm_fairseq.norms import kernels

    if name == "plain":
        return None
    k = {"cpu": kernels.cpu, "triton": kernels.gpu}[name]
    if not k.available():
        pytest.fail(f"the {name} kernels are unavailable: {k.failure}")
    return k


__all__ = ["BIN", "ROOT", "TINY", "TINY_LM", "USER_DIR", "Command", "backend_or_fail", "build_model", "cli",
           "lm_corpus", "losses",
           "make_lm_data", "make_toy_data", "norm_query", "once", "preprocess", "processes_mentioning", "sample",
           "stand_ins", "toy_corpus", "train_args"]
