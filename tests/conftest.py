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

import pytest  # noqa: E402

from powernorm_fairseq.checkpoints import allow_fairseq_checkpoints  # noqa: E402

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


def cli(tool, *args, check=True, cwd=ROOT, timeout=600):
    """Run a fairseq console script of this environment; return the process."""
    proc = subprocess.run(
        [str(BIN / tool), *map(str, args)], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
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


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    """A binarized toy de-en corpus with a joined dictionary."""
    root = tmp_path_factory.mktemp("toy")
    for split, n, seed in (("train", 600, 1), ("valid", 40, 2), ("test", 27, 3)):
        src, tgt = toy_corpus(n, seed)
        (root / f"{split}.de").write_text("\n".join(src) + "\n")
        (root / f"{split}.en").write_text("\n".join(tgt) + "\n")
    cli("fairseq-preprocess", "--source-lang", "de", "--target-lang", "en",
        "--trainpref", root / "train", "--validpref", root / "valid", "--testpref", root / "test",
        "--destdir", root / "bin", "--joined-dictionary", "--workers", "1")
    return root / "bin"


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
    root = tmp_path_factory.mktemp("lm")
    for split, n, seed in (("train", 800, 4), ("valid", 40, 5), ("test", 40, 6)):
        (root / f"{split}.txt").write_text("\n".join(lm_corpus(n, seed)) + "\n")
    cli("fairseq-preprocess", "--only-source", "--trainpref", root / "train.txt", "--validpref",
        root / "valid.txt", "--testpref", root / "test.txt", "--destdir", root / "bin", "--workers", "1")
    return root / "bin"


def backend_or_fail(name):
    """The kernels module of backend ``name``, failing (never skipping) when it is missing."""
    from powernorm_fairseq.norms import kernels

    if name == "plain":
        return None
    k = {"cpu": kernels.cpu, "triton": kernels.gpu}[name]
    if not k.available():
        pytest.fail(f"the {name} kernels are unavailable: {k.failure}")
    return k


#: what a test calls when it runs a command or trains in other processes
SPAWNS = ("cli(", "sh(", "subprocess.", "Popen(", "two_workers(", "mp.spawn(", "_python(")


def pytest_collection_modifyitems(config, items):
    """The second tier, ``slow``: tests that run commands, train in other
    processes or prepare data with the recipes (seconds to minutes each).
    ``scripts/test.sh --fast`` runs the rest, which take well under a second
    each. A test is slow if its own code spawns (``SPAWNS``), if it uses the
    recipes' prepared data, or if it is marked ``slow`` by hand."""
    import inspect

    def spawns(function):
        return function is not None and any(call in inspect.getsource(function) for call in SPAWNS)

    for item in items:
        # the test's own code, and the fixtures of its module (the shared toy
        # corpora of this file are binarized once per session, in seconds)
        fixtures = [defs[-1].func for defs in item._fixtureinfo.name2fixturedefs.values()
                    if defs[-1].func.__module__ == getattr(item.module, "__name__", None)]
        slow = spawns(getattr(item, "function", None)) or any(spawns(f) for f in fixtures)
        # gradcheck calls a kernel hundreds of times, slow under Triton's interpreter
        slow |= item.name.startswith("test_gradcheck") and "triton" in item.name
        if slow:
            item.add_marker(pytest.mark.slow)
