"""The suite's toy corpora, tiny models and their training flags."""

import json
import random
import re

from .commands import ROOT

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


def make_toy_data(root):
    for split, n, seed in (("train", 600, 1), ("valid", 40, 2), ("test", 27, 3)):
        src, tgt = toy_corpus(n, seed)
        (root / f"{split}.de").write_text("\n".join(src) + "\n")
        (root / f"{split}.en").write_text("\n".join(tgt) + "\n")
    preprocess("--source-lang", "de", "--target-lang", "en",
               "--trainpref", root / "train", "--validpref", root / "valid", "--testpref", root / "test",
               "--destdir", root / "bin", "--joined-dictionary", "--workers", "1")


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


def make_lm_data(root):
    for split, n, seed in (("train", 800, 4), ("valid", 40, 5), ("test", 40, 6)):
        (root / f"{split}.txt").write_text("\n".join(lm_corpus(n, seed)) + "\n")
    preprocess("--only-source", "--trainpref", root / "train.txt", "--validpref",
               root / "valid.txt", "--testpref", root / "test.txt", "--destdir", root / "bin", "--workers", "1")
