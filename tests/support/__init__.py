"""What the tests share beyond pytest's fixtures (``conftest.py``): running
console scripts (``commands.py``, through ``forkserver.py``), the toy
corpora and tiny models (``toy.py``), and :func:`once`."""

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

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's directory, above each worker's own
    path, made = base / name, base / f"{name}.made"
    with FileLock(str(base / f"{name}.lock")):
        if not made.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            make(path)
            made.touch()
    return path



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
