import contextlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

# The GPU kernels run on CPU tensors under Triton's interpreter, which has to
# be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' models are tiny: one thread each, and one worker per core (xdist),
# rather than every process's thread pool competing for the same cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from powernorm_fairseq.common.checkpoints import allow_fairseq_checkpoints  # noqa: E402

allow_fairseq_checkpoints()  # torch.load(weights_only=True) of the checkpoints tests write

sys.path.insert(0, str(Path(__file__).parent))  # for `import reference`

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# a model small enough to train in seconds on a CPU
TINY = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
]

USER_DIR = ROOT / "powernorm_fairseq"
# a language model as small
TINY_LM = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
           "--decoder-attention-heads", "4"]


def train_args(data, save_dir, *flags, max_update=40):
    return [
        data, "--user-dir", USER_DIR, "--arch", "powernorm_transformer_iwslt_de_en", *TINY,
        "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
        "--lr", "0.003", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "8",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", "600", "--max-update", max_update, "--save-dir", save_dir,
        "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", "1",
        "--seed", "1", "--num-workers", "0", *flags,
    ]


def losses(log):
    """Training losses per update from fairseq's JSON log lines."""
    rows = [json.loads(m) for m in re.findall(r"\| train_inner \| (\{.*\})", log)]
    return [float(r["loss"]) for r in rows]


def processes_mentioning(text):
    """Pids of running processes whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry) != os.getpid():
                found.append(int(entry))
    return found


class Command:
    """A console script running in a fork of the suite's fork server
    (``forkserver.py``): a process of its own, with the parts of
    ``subprocess.Popen`` the tests use."""

    def __init__(self, tool, args, cwd=ROOT, env=None, stdin=None, stdout=None, stderr=None):
        import socket

        self.args = [str(BIN / tool), *map(str, args)]
        self.returncode = None
        request = json.dumps({"tool": tool, "argv": self.args, "cwd": str(cwd),
                              "env": {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}}).encode()
        streams = [stdin or subprocess.DEVNULL, stdout, stderr]
        self.stdout = None  # with stdout=subprocess.PIPE: the read end, as text
        with contextlib.ExitStack() as opened:
            fds = []
            for i, stream in enumerate(streams):
                if stream == subprocess.PIPE and i == 1:
                    read, write = os.pipe()
                    self.stdout = open(read, "r")
                    stream = opened.enter_context(open(write, "wb"))
                elif stream == subprocess.STDOUT and i == 2:
                    stream = fds[1]
                elif stream is None or stream == subprocess.DEVNULL:
                    stream = opened.enter_context(open(os.devnull, "rb" if i == 0 else "wb"))
                fds.append(stream if isinstance(stream, int) else stream.fileno())
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._conn.connect(_fork_server("fairseq" if tool.startswith("fairseq-") else "torch"))
            socket.send_fds(self._conn, [len(request).to_bytes(8, "big")], fds)
            self._conn.sendall(request)
        self._buffer = b""
        self.pid = self._reply()["pid"]

    def _reply(self):
        while b"\n" not in self._buffer:
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the fork server lost {self.args[0]}: see its stderr above")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self):
        return self.wait(timeout=0)

    def _ended(self, timeout):
        import select

        return b"\n" in self._buffer or bool(select.select([self._conn], [], [], timeout)[0])

    def wait(self, timeout=None):
        if self.returncode is None:
            if not self._ended(timeout):
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._reply()["returncode"]
            self._conn.close()
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self):
        import signal

        self.send_signal(signal.SIGKILL)


_servers = {}


def _fork_server(modules):
    """The socket of this session's fork server that has imported ``modules``
    ("fairseq": torch and fairseq, for fairseq's commands; "torch": torch
    alone, for the plugin's tools), started on first use."""
    if modules not in _servers:
        import atexit
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="powernorm-forkserver-"), "socket")
        imports = ["torch", "fairseq"] if modules == "fairseq" else ["torch"]
        proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "forkserver.py"), path, *imports],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit status {proc.wait()})")
        atexit.register(proc.kill)
        _servers[modules] = path
    return _servers[modules]


def cli(tool, *args, check=True, cwd=ROOT, timeout=600, input=None, env=None):
    """Run a console script of this environment (fairseq's or the plugin's) in
    a process of its own; return it as ``subprocess.run`` would."""
    import tempfile

    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        stdin.write((input or "").encode())
        stdin.seek(0)
        command = Command(tool, args, cwd=cwd, env=env, stdin=stdin, stdout=out, stderr=err)
        try:
            command.wait(timeout)
        except subprocess.TimeoutExpired:
            command.kill()
            raise
        out.seek(0), err.seek(0)
        proc = subprocess.CompletedProcess(command.args, command.returncode, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def build_model(*argv, seed=0):
    """A model and its task, from fairseq-train's arguments, built as fairseq-train builds them."""
    import torch
    from fairseq import options, tasks

    args = options.parse_args_and_arch(options.get_training_parser(), list(map(str, argv)))
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    return task.build_model(args), task


def sample(task, n=8):
    """A batch of the first ``n`` validation examples."""
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    return dataset.collater([dataset[i] for i in range(n)])


def toy_corpus(n, seed):
    """Word-for-word "translation" through a fixed lexicon, lengths 3-12."""
    rng = random.Random(seed)
    de = "haus baum katze hund auto buch tisch stuhl fenster tür garten blume apfel brot milch wasser".split()
    en = "house tree cat dog car book table chair window door garden flower apple bread milk water".split()
    src, tgt = [], []
    for _ in range(n):
        idx = [rng.randrange(len(de)) for _ in range(rng.randint(3, 12))]
        src.append(" ".join(de[i] for i in idx))
        tgt.append(" ".join(en[i] for i in idx))
    return src, tgt


def preprocess(*args):
    """fairseq-preprocess in this process (its CLI is driven by the recipes'
    tests): the session's corpora are data, not what a test checks."""
    from fairseq import options
    from fairseq_cli.preprocess import main

    main(options.get_preprocessing_parser().parse_args(list(map(str, args))))


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


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    """A binarized toy de-en corpus with a joined dictionary."""
    return once(tmp_path_factory, "toy", _make_toy_data) / "bin"


def _make_toy_data(root):
    for split, n, seed in (("train", 600, 1), ("valid", 40, 2), ("test", 27, 3)):
        src, tgt = toy_corpus(n, seed)
        (root / f"{split}.de").write_text("\n".join(src) + "\n")
        (root / f"{split}.en").write_text("\n".join(tgt) + "\n")
    preprocess("--source-lang", "de", "--target-lang", "en",
               "--trainpref", root / "train", "--validpref", root / "valid", "--testpref", root / "test",
               "--destdir", root / "bin", "--joined-dictionary", "--workers", "1")


@pytest.fixture(scope="session")
def trained(toy_data, tmp_path_factory):
    """``trained(norm)``: the save directory of a tiny model trained once per
    session through fairseq-train (40 updates, ``--norm-type norm``), with the
    run's console in ``train.log``. Tests only read it; one that resumes
    from it copies it first."""
    def get(norm):
        def make(save):
            proc = cli("fairseq-train", *train_args(toy_data, save, "--norm-type", norm))
            (save / "train.log").write_text(proc.stdout + proc.stderr)
        return once(tmp_path_factory, f"trained-{norm}", make)
    return get


def lm_corpus(n, seed):
    """Sentences that walk a fixed cycle of words from a random start: after the
    first word each next word is determined, so a model can learn them."""
    rng = random.Random(seed)
    words = "house tree cat dog car book table chair window door garden flower apple bread milk water".split()
    lines = []
    for _ in range(n):
        start = rng.randrange(len(words))
        lines.append(" ".join(words[(start + i) % len(words)] for i in range(rng.randint(3, 12))))
    return lines


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory):
    """A binarized toy language-modeling corpus (fairseq-preprocess --only-source)."""
    return once(tmp_path_factory, "lm", _make_lm_data) / "bin"


def _make_lm_data(root):
    for split, n, seed in (("train", 800, 4), ("valid", 40, 5), ("test", 40, 6)):
        (root / f"{split}.txt").write_text("\n".join(lm_corpus(n, seed)) + "\n")
    preprocess("--only-source", "--trainpref", root / "train.txt", "--validpref",
               root / "valid.txt", "--testpref", root / "test.txt", "--destdir", root / "bin", "--workers", "1")


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


def backend_or_fail(name):
    """The kernels module of backend ``name``, failing (never skipping) when it is missing."""
    from powernorm_fairseq.norms import kernels

    if name == "plain":
        return None
    k = {"cpu": kernels.cpu, "triton": kernels.gpu}[name]
    if not k.available():
        pytest.fail(f"the {name} kernels are unavailable: {k.failure}")
    return k


TIERS = ("fast", "slow")


def tier(item):
    """``fast`` or ``slow``, from the test's own marker or else its module's
    ``pytestmark``; None when it declares neither."""
    return next((m.name for m in item.iter_markers() if m.name in TIERS), None)


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
def _cpu_kernels_built():
    """The CPU kernels compile (a process per source) before the first test
    runs, not inside whichever fast test uses them first."""
    from powernorm_fairseq.norms.kernels import cpu

    cpu.available()


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
