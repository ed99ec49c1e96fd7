"""The suite's fixtures and its two tiers; what the tests share beyond
fixtures is in ``support/``."""

import os
import subprocess
import sys
from pathlib import Path

# The GPU kernels run on CPU tensors under Triton's interpreter, which has to
# be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' models are tiny: one thread each, and one worker per core (xdist),
# rather than every process's thread pool competing for the same cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A command the tests run that crashes (SIGSEGV, SIGABRT) prints where, in every thread, on its stderr.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# The one-node cluster's jobs take seconds: a look at its queue every 2 s at most, not up to 30 s.
os.environ.setdefault("POWERNORM_SLURM_POLL", "2")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # for `import support`, `import reference`

from support import (ROOT, TINY_LM, USER_DIR, Command, changed_since_made, cli, interpreter,  # noqa: E402
                     make_lm_data, make_toy_data, once, shared_base, train_args)


def pytest_configure(config):
    """Set up each process that runs tests: not xdist's controller, which runs
    none (importing torch there would hold back the workers' start by 2 s)."""
    collecting = config.getoption("collectonly")
    if not hasattr(config, "workerinput") and config.getoption("tx", None) and not collecting:
        return
    from powernorm_fairseq.common.checkpoints import allow_fairseq_checkpoints
    from powernorm_fairseq.norms.kernels import cpu

    allow_fairseq_checkpoints()  # torch.load(weights_only=True) of the checkpoints tests write
    interpreter.install()  # without the interpreter's repeated patching (support/interpreter.py)
    if not collecting:  # the CPU kernels load, or build, before the first test, not inside the first using them
        cpu.available()


@pytest.fixture(scope="session", autouse=True)
def shared_directories_stay_as_made(tmp_path_factory):
    """The directories ``once`` makes are shared by every test and worker: at the end of each worker's
    session, none holds a file written, removed or added since it was made (a test writes in a copy)."""
    yield
    changed = changed_since_made(shared_base(tmp_path_factory))
    assert not changed, f"written in a shared directory after it was made (write in a copy): {changed}"


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    """A binarized toy de-en corpus with a joined dictionary."""
    return once(tmp_path_factory, "toy", make_toy_data) / "bin"


@pytest.fixture(scope="session")
def trained(toy_data, tmp_path_factory):
    """``trained(norm, *flags)``: the save directory of a tiny model trained once per
    session through fairseq-train (40 updates, ``--norm-type norm`` and ``flags``), with the
    run's console in ``train.log``. Tests only read it; one that resumes
    from it copies it first."""
    def get(norm, *flags):
        def make(save):
            proc = cli("fairseq-train", *train_args(toy_data, save, "--norm-type", norm, *flags))
            (save / "train.log").write_text(proc.stdout + proc.stderr)
        return once(tmp_path_factory, "-".join(["trained", norm, *(f.lstrip("-") for f in flags)]), make)
    return get


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory):
    """A binarized toy language-modeling corpus (fairseq-preprocess --only-source)."""
    return once(tmp_path_factory, "lm", make_lm_data) / "bin"


@pytest.fixture(scope="session")
def lm_trained(lm_data, tmp_path_factory):
    """``lm_trained(norm)``: the save directory of a tiny language model trained
    once per session through fairseq-train (80 updates, every norm ``norm``).
    Tests only read it."""
    def get(norm):
        def make(save):
            cli("fairseq-train", lm_data, "--user-dir", USER_DIR, "--task", "language_modeling",
                "--arch", "powernorm_transformer_lm", "--norm-type", norm, *TINY_LM,
                "--share-decoder-input-output-embed", "--tokens-per-sample", "32", "--sample-break-mode", "eos",
                "--max-tokens", "512", "--optimizer", "adam", "--lr", "0.005", "--lr-scheduler", "inverse_sqrt",
                "--warmup-updates", "10", "--max-update", "80", "--dropout", "0.1", "--seed", "1",
                "--save-dir", save, "--no-epoch-checkpoints", "--num-workers", "0", "--log-format", "simple")
        return once(tmp_path_factory, f"lm-trained-{norm}", make)
    return get


TIERS = ("fast", "slow")


def tier(item):
    """``fast`` or ``slow``, from the test's own marker or else its module's
    ``pytestmark``; None when it declares neither. A fast test's case on the
    triton backend is slow: Triton's interpreter takes seconds a case."""
    declared = next((m.name for m in item.iter_markers() if m.name in TIERS), None)
    params = item.callspec.params.values() if hasattr(item, "callspec") else ()
    on_triton = any(isinstance(v, str) and v == "triton" for v in params)
    return "slow" if declared == "fast" and on_triton else declared


def pytest_addoption(parser):
    parser.addoption("--tier", choices=TIERS, help="run the tests of one tier only (a test's own marker "
                     "decides over its module's)")


def pytest_collection_modifyitems(config, items):
    """Every test declares its tier: ``fast`` (in this process only, well
    under a second each; ``scripts/test.sh --fast``) or ``slow`` (runs
    commands, trains in other processes, prepares recipe data, or takes
    seconds in this one). A test without one stops the run before it starts."""
    missing = [item.nodeid for item in items if tier(item) is None]
    if missing:
        raise pytest.UsageError(
            f"{len(missing)} test(s) declare no tier, e.g. {missing[0]}: give the module "
            "`pytestmark = pytest.mark.fast` (or .slow), or the test @pytest.mark.fast or @pytest.mark.slow")
    wanted = config.getoption("--tier")
    if wanted:
        config.hook.pytest_deselected(items=[item for item in items if tier(item) != wanted])
        items[:] = [item for item in items if tier(item) == wanted]


@pytest.fixture(scope="session", autouse=True)
def _writes_stay_in_tmp(tmp_path_factory):
    """Tests write under their temporary directories only: no file appears
    in the checkout (git's untracked files, the ignored ones aside)."""
    import support.commands

    support.commands.SOCKETS = str(tmp_path_factory.mktemp("forkservers"))
    status = ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all", "--ignored=no"]

    def untracked():
        return {line for line in subprocess.run(status, capture_output=True, text=True).stdout.splitlines()
                if line.startswith("??")}
    before = untracked()
    yield
    new = sorted(untracked() - before)
    assert not new, f"the tests wrote into the checkout: {new}"


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request, monkeypatch):
    """A test of the fast tier that starts a process fails, saying so."""
    if tier(request.node) != "fast":
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow")

    import multiprocessing.util

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(Command, "__init__", refuse)
