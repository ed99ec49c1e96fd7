"""The grid: its axes and defaults, its cells and their names, and each cell's fairseq-train command."""

import argparse
import math
from pathlib import Path

from ...common.files import check_regular_file

TASKS = ("classification", "translation", "lm")
#: width presets: embedding size; the feed-forward is 4x, a head per 64 channels
WIDTHS = {"narrow": 128, "normal": 256, "wide": 512}
#: per task: the defaults of the grid and of training
DEFAULTS = {
    "classification": dict(lrs=[10, 1, 0.5, 0.1, 0.01, 0.001, 0.0001], depths=[1, 5], widths=["narrow", "normal",
                           "wide"], norms=["ln", "bn", "none", "dyt"], inits=["xavier-kaiming"], optimizer="sgd",
                           placement="post", warmup_updates=0, max_epochs=10),
    "translation": dict(lrs=[0.002], depths=[3], widths=["normal"], norms=["ln", "pn", "dyt"], inits=["default"],
                        optimizer="adam", placement="pre", warmup_updates=300, max_epochs=8),
    "lm": dict(lrs=[0.0005], depths=[2], widths=["normal"], norms=["ln", "pn", "dyt"], inits=["default"],
               optimizer="adam", placement="pre", warmup_updates=300, max_epochs=5),
}
#: what a table reports besides the loss: (key in fairseq's valid record, label, format)
METRIC = {"classification": ("accuracy", "valid acc. %", "{:.1f}"), "translation": ("bleu", "valid BLEU", "{:.2f}"),
          "lm": ("ppl", "valid ppl", "{:.1f}")}
#: the training loss in bits that convergence is judged on (translation: without label smoothing)
LOSS = {"classification": "loss", "translation": "nll_loss", "lm": "loss"}


class StudyError(ValueError):
    """A grid or data this study cannot run."""


def width(text):
    if text in WIDTHS:
        return text
    try:
        if int(text) >= 1:
            return str(int(text))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--widths takes {', '.join(WIDTHS)} or a positive integer, got {text!r}")


def dims(w):
    """(embedding, feed-forward, heads) of a width preset or number."""
    d = WIDTHS.get(w) or int(w)
    return d, 4 * d, max(1, d // 64)


def check_width(w):
    d, _, heads = dims(w)
    if d % heads:
        raise StudyError(f"--widths {w}: its {heads} heads (one per 64 channels) do not divide {d}; give a width "
                         "below 128 or a multiple of its head count, e.g. a multiple of 64")


def norms_of(args, placement):
    """The norms a placement's cells take: ``--norms``, or none alone for rezero (it has no norms)."""
    return ["none"] if placement == "rezero" else args.norms


def switches_of(args):
    """The model switches of ``--switches`` (none: the model as the other axes give it)."""
    return getattr(args, "switches", None) or ["none"]


def columns(args, placement):
    """A table's columns: each norm of ``placement`` with each switch."""
    return [(n, s) for n in norms_of(args, placement) for s in switches_of(args)]


def column(norm, switch):
    return norm + (f" +{switch}" if switch != "none" else "")


def column_of(cell):
    """The column of a cell's table: its norm, with its switch where it has one."""
    return column(cell["norm"], cell.get("switch", "none"))


def cells(args):
    """Every cell of the grid. A cell's name holds its placement, QK-norm and
    switch only where they are axes (``--placements``, ``--qk-norms``,
    ``--switches``), so that a study of one placement keeps the names it always had."""
    grid = [dict(depth=d, width=w, norm=n, init=i, lr=lr, seed=s, placement=p, qk=q, switch=sw)
            for p in args.placements for q in args.qk_norms for d in args.depths for w in args.widths
            for i in args.inits for lr in args.lrs for n in norms_of(args, p) for sw in switches_of(args)
            for s in args.seeds]
    for cell in grid:
        axes = (f"-{cell['placement']}" if args.placement_axis else "") + (
            f"-qk{cell['qk']}" if cell["qk"] != "none" else "") + (
            f"-{cell['switch']}" if cell["switch"] != "none" else "")
        cell["name"] = (f"d{cell['depth']}-w{cell['width']}-{cell['norm']}{axes}-{cell['init'].replace(':', '')}"
                        f"-lr{cell['lr']:g}-s{cell['seed']}")
    return grid


def series(args, cell):
    """A cell's line in the figures and row label in the tables: its norm, and its placement and
    QK-norm where they are axes."""
    return " ".join([cell["placement"]] * args.placement_axis + [column_of(cell)]
                    + [f"qk {cell['qk']}"] * (cell["qk"] != "none"))


def check_names(grid):
    """Every cell's directory name is its own: learning rates that agree in
    their first 6 digits (what a name holds) would share one cell."""
    seen = {}
    for cell in grid:
        other = seen.setdefault(cell["name"], cell)
        if other is not cell:
            axis = next(k for k in ("lr", "width", "init") if other[k] != cell[k])
            raise StudyError(f"--{axis}s {other[axis]!r} and {cell[axis]!r} name the same cell {cell['name']}; "
                             "give values that differ in their first 6 significant digits")


def train_argv(args, cell, save_dir):
    """fairseq-train's arguments for one cell."""
    d, ffn, heads = dims(cell["width"])
    data = str(args.data)
    argv = [data, "--user-dir", str(Path(__file__).resolve().parents[2]), "--seed", str(cell["seed"]),
            "--norm-type", cell["norm"], "--norm-placement", cell["placement"], "--init", cell["init"],
            "--optimizer", args.optimizer, "--lr", f"{cell['lr']:g}", "--save-dir", str(save_dir),
            "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", str(args.log_interval),
            "--clip-norm", "0", "--num-workers", "0"]
    if cell["qk"] != "none":
        argv += ["--qk-norm", cell["qk"]]
    if cell.get("switch", "none") != "none":
        argv.append("--" + cell["switch"])
    if args.optimizer == "adam":
        argv += ["--adam-betas", "(0.9, 0.98)"]
    if args.warmup_updates:
        argv += ["--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(args.warmup_updates),
                 "--warmup-init-lr", "1e-07"]
    argv += ["--max-update", str(args.max_update)] if args.max_update else ["--max-epoch", str(args.max_epochs)]
    if args.task == "classification":
        argv += ["--task", "sentence_prediction", "--criterion", "sentence_prediction", "--arch",
                 "powernorm_classifier", "--num-classes", str(len(label_counts(args.data))),
                 "--batch-size", str(args.batch_size), "--max-positions", "512", "--required-batch-size-multiple", "1",
                 "--encoder-layers", str(cell["depth"]), "--encoder-embed-dim", str(d),
                 "--encoder-ffn-embed-dim", str(ffn), "--encoder-attention-heads", str(heads)]
    elif args.task == "translation":
        argv += ["--task", "translation", "--arch", "powernorm_transformer_iwslt_de_en",
                 "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
                 "--max-tokens", str(args.max_tokens), "--eval-bleu", "--eval-bleu-remove-bpe",
                 "--eval-tokenized-bleu", "--eval-bleu-args", '{"beam": 5}',
                 "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric"]
        for side in ("encoder", "decoder"):
            argv += [f"--{side}-layers", str(cell["depth"]), f"--{side}-embed-dim", str(d),
                     f"--{side}-ffn-embed-dim", str(ffn), f"--{side}-attention-heads", str(heads)]
        if cell["placement"] == "rezero":  # the decoder's norms too
            argv += ["--decoder-norm-type", "none"]
        if joined_dictionary(args.data):
            argv.append("--share-all-embeddings")
    else:
        argv += ["--task", "language_modeling", "--arch", "powernorm_transformer_lm", "--criterion", "cross_entropy",
                 "--max-tokens", str(args.max_tokens), "--tokens-per-sample", "256", "--sample-break-mode", "none",
                 "--share-decoder-input-output-embed", "--decoder-layers", str(cell["depth"]),
                 "--decoder-embed-dim", str(d), "--decoder-ffn-embed-dim", str(ffn),
                 "--decoder-attention-heads", str(heads)]
    gpus = args.gpus_per_node if args.launcher == "slurm" else None  # None: whatever this machine has
    if gpus and gpus > 1:  # data-parallel inside the cell, the batch statistics over every worker's batch
        argv += ["--distributed-world-size", str(gpus), "--norm-sync", "batch"]
    import torch

    if gpus == 0 or not torch.cuda.is_available():
        argv.append("--cpu")
    return argv + list(args.fairseq)


def label_counts(data):
    path = Path(data, "label", "dict.txt")
    check_regular_file(path, "dictionary")
    counts = [int(line.split()[1]) for line in path.read_text().splitlines() if not line.startswith("madeupword")]
    return counts


def joined_dictionary(data):
    dicts = sorted(Path(data).glob("dict.*.txt"))
    return len(dicts) == 2 and all(d.is_file() for d in dicts) and dicts[0].read_bytes() == dicts[1].read_bytes()


def constant_loss(args):
    """The loss in bits of the best constant prediction on the training data."""
    if args.task == "classification":
        counts = label_counts(args.data)
    else:
        files = sorted(Path(args.data).glob("dict.*.txt")) if args.task == "translation" else [
            Path(args.data, "dict.txt")]
        check_regular_file(files[-1], "dictionary")
        counts = [int(line.split()[1]) for line in files[-1].read_text().splitlines()]
    total = sum(counts)
    return -sum(c / total * math.log2(c / total) for c in counts if c)


def check_data(args):
    need = {"classification": ["input0/dict.txt", "label/dict.txt"], "translation": ["dict.*.txt"],
            "lm": ["dict.txt"]}[args.task]
    for pattern in need:
        if not list(Path(args.data).glob(pattern)):
            prep = {"classification": "data-prep/prepare-phrasebank.sh",
                    "translation": "data-prep/prepare-quickstart.sh", "lm": "data-prep/prepare-lm.sh"}[args.task]
            raise StudyError(f"--data {args.data}: no {pattern} for --task {args.task} (make it with {prep})")
