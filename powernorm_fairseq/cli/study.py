"""The normalization study: one resumable grid of training runs, its tables
and figures (``scripts/norm-study.sh``, docs/study.md).

A cell is one run: task x depth x width x norm x init x learning rate x seed.
Each runs fairseq's own trainer in ``OUT/cells/<name>/`` (its ``train.log``
and ``checkpoint_last.pt``), after measuring the per-layer gradient norms and
the loss of its freshly initialised model (``init.json``); ``result.json``
marks it finished, so a rerun skips it, and an interrupted one resumes from
its last checkpoint. ``study.json`` and ``study.md`` hold one table per depth
x width x init, learning rates as rows and norms as columns, and the figures
go beside them.

A cell *converged* when its final training loss is finite and below both
``--converged-fraction`` times its initial loss and the loss of the best
constant prediction (the training labels' entropy; for translation and
language models the unigram entropy of the training tokens), all in bits.
"""

import argparse
import fcntl
import json
import logging
import math
import os
import re
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from ..common.files import atomic_path, end_cleanly_on_sigterm
from ..common.flags import ArgumentParser, at_least, fraction, positive

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
RECORD = re.compile(r"\| (train_inner|train|valid) \| (\{.*\})\s*$")
logger = logging.getLogger("powernorm_fairseq.study")


class StudyError(ValueError):
    """A grid or data this study cannot run."""


# ---------------------------------------------------------------- the grid


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


def cells(args):
    """Every cell of the grid. A cell's name holds its placement and QK-norm
    only where they are axes (``--placements``, ``--qk-norms``), so that a
    study of one placement keeps the names it always had."""
    grid = [dict(depth=d, width=w, norm=n, init=i, lr=lr, seed=s, placement=p, qk=q)
            for p in args.placements for q in args.qk_norms for d in args.depths for w in args.widths
            for i in args.inits for lr in args.lrs for n in norms_of(args, p) for s in args.seeds]
    for cell in grid:
        axes = (f"-{cell['placement']}" if args.placement_axis else "") + (
            f"-qk{cell['qk']}" if cell["qk"] != "none" else "")
        cell["name"] = (f"d{cell['depth']}-w{cell['width']}-{cell['norm']}{axes}-{cell['init'].replace(':', '')}"
                        f"-lr{cell['lr']:g}-s{cell['seed']}")
    return grid


def series(args, cell):
    """A cell's line in the figures and row label in the tables: its norm, and its placement and
    QK-norm where they are axes."""
    return " ".join([cell["placement"]] * args.placement_axis + [cell["norm"]]
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
    argv = [data, "--user-dir", str(Path(__file__).resolve().parents[1]), "--seed", str(cell["seed"]),
            "--norm-type", cell["norm"], "--norm-placement", cell["placement"], "--init", cell["init"],
            "--optimizer", args.optimizer, "--lr", f"{cell['lr']:g}", "--save-dir", str(save_dir),
            "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", str(args.log_interval),
            "--clip-norm", "0", "--num-workers", "0"]
    if cell["qk"] != "none":
        argv += ["--qk-norm", cell["qk"]]
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
    import torch

    if not torch.cuda.is_available():
        argv.append("--cpu")
    return argv + list(args.fairseq_args)


def label_counts(data):
    path = Path(data, "label", "dict.txt")
    counts = [int(line.split()[1]) for line in path.read_text().splitlines() if not line.startswith("madeupword")]
    return counts


def joined_dictionary(data):
    dicts = sorted(Path(data).glob("dict.*.txt"))
    return len(dicts) == 2 and dicts[0].read_bytes() == dicts[1].read_bytes()


def constant_loss(args):
    """The loss in bits of the best constant prediction on the training data."""
    if args.task == "classification":
        counts = label_counts(args.data)
    else:
        files = sorted(Path(args.data).glob("dict.*.txt")) if args.task == "translation" else [
            Path(args.data, "dict.txt")]
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


# ---------------------------------------------------------------- one cell


def parse(argv):
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, argv)


def initial_probe(train_args, loss_key, batches=4):
    """Per-layer gradient norms of the per-example (per-token) training loss,
    and that loss in bits, of the model as freshly initialised with the cell's
    seed, in training mode without dropout, averaged over the first batches of
    the training data (Figures 2 and 3 of the sentiment study)."""
    from fairseq import tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(train_args)
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model).float()
    criterion = task.build_criterion(cfg.criterion)
    from .analyze import training_batches

    samples = training_batches(task, model, "train", batches, cfg.dataset.max_tokens or 4096, cfg.common.seed)
    model.train()
    for m in model.modules():
        if "Dropout" in type(m).__name__:
            m.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    norms, losses = defaultdict(list), []
    for sample in samples:
        model.load_state_dict(state)  # the running statistics as at init for every batch
        model.zero_grad(set_to_none=True)
        loss, size, out = criterion(model, sample)
        loss.backward()
        if loss_key == "nll_loss":  # without label smoothing, per token
            losses.append(float(out["nll_loss"]) / out["ntokens"] / math.log(2))
        else:
            losses.append(loss.item() / size / math.log(2))
        squares = defaultdict(float)
        for name, p in model.named_parameters():
            if p.grad is not None:
                squares[layer_of(name)] += (p.grad.double() / size).pow(2).sum().item()
        for layer, sq in squares.items():
            norms[layer].append(sq ** 0.5)
    return {"loss": sum(losses) / len(losses), "batches": len(samples),
            "grad_norms": {layer: sum(v) / len(v) for layer, v in sorted(norms.items(), key=lambda kv: order(kv[0]))}}


def layer_of(name):
    m = re.match(r"(encoder|decoder)\.(?:sentence_encoder\.)?layers\.(\d+)\.", name)
    if m:
        return f"{m.group(1)} layer {int(m.group(2)) + 1}"
    return ".".join(name.split(".")[:2]).replace("classification_heads.", "head ")


def order(layer):
    """Embeddings, then the layers bottom up (encoder before decoder), then the rest (final norm, head)."""
    m = re.match(r"(encoder|decoder) layer (\d+)$", layer)
    if m:
        return (1, m.group(1) != "encoder", int(m.group(2)), layer)
    return (0 if "embed" in layer else 2, False, 0, layer)


def read_log(path):
    """The train_inner, train (epoch) and valid records of a cell's log."""
    records = defaultdict(list)
    if not path.exists():
        return records
    for line in path.read_text(errors="replace").splitlines():
        m = RECORD.search(line)
        if m:
            values = {}
            for k, v in json.loads(m.group(2)).items():
                try:
                    values[k.split("_", 1)[1] if k.startswith(m.group(1) + "_") else k] = float(v)
                except (TypeError, ValueError):
                    pass
            records[m.group(1)].append(values)
    return records


def run_cell(args, cell, verbose=False):
    """Probe, train and (``--landscape``) probe the landscape of one cell; its
    ``result.json``. Returns None when another process holds the cell."""
    import torch

    root = Path(args.out, "cells", cell["name"])
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        if args.threads:
            torch.set_num_threads(args.threads)
        if (root / "result.json").exists():
            result = json.loads((root / "result.json").read_text())
            if not wants_landscape(args, result):
                return result
            return measure_landscape(args, cell, root, result)
        start = time.time()
        train_args = parse(train_argv(args, cell, root))
        record_settings(args)
        if not (root / "init.json").exists():
            probe = initial_probe(train_args, LOSS[args.task])
            with atomic_path(root / "init.json") as tmp:
                Path(tmp).write_text(json.dumps(probe, indent=1))
        probe = json.loads((root / "init.json").read_text())
        status = train(train_args, root / "train.log", verbose)
        result = dict(cell, status=status, initial_loss=probe["loss"], seconds=round(time.time() - start, 1))
        if status == "finished":  # the numbers saved with the last checkpoint, not a log a kill may have cut
            end = end_of_run(root / "checkpoint_last.pt")
            result["final_loss"] = end["train"].get(LOSS[args.task], float("nan"))
            result["metric"] = end["valid"].get(METRIC[args.task][0], float("nan"))
            result["updates"] = end["updates"]
        else:
            records = read_log(root / "train.log")
            result["final_loss"] = result["metric"] = float("nan")
            result["updates"] = int(max([r.get("num_updates", 0) for r in records["train_inner"] + records["train"]],
                                        default=0))
        result["converged"] = converged(result["final_loss"], result["initial_loss"], args.majority_loss,
                                        args.converged_fraction)
        if wants_landscape(args, result):
            return measure_landscape(args, cell, root, result)
        with atomic_path(root / "result.json") as tmp:
            Path(tmp).write_text(json.dumps(result, indent=1))
        return result


def wants_landscape(args, result):
    return args.landscape and "lipschitz" not in result and result["status"] == "finished" \
        and math.isfinite(result["final_loss"])


def measure_landscape(args, cell, root, result):
    """``--landscape`` at the cell's final checkpoint, added to its result."""
    from .analyze import landscape

    _, summary = landscape([root / "checkpoint_last.pt"], args.data, "train", 2, args.max_tokens, 8, None,
                           cell["seed"])
    result = dict(result, **dict(zip(("lipschitz", "smoothness", "grad_norm"), summary[0][5:8])))
    with atomic_path(root / "result.json") as tmp:
        Path(tmp).write_text(json.dumps(result, indent=1))
    return result


def converged(final, initial, majority, frac):
    return bool(math.isfinite(final) and final < frac * initial and final < majority)


def train(train_args, log_path, verbose):
    """fairseq's trainer in this process, its log (fairseq's console lines) to
    ``log_path``: "finished", or "diverged" when fairseq stops on a
    non-finite gradient."""
    from fairseq import distributed_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import train as fairseq_train

    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                                           "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    console = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
               and not isinstance(h, logging.FileHandler)]
    levels, root_level = [h.level for h in console], root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for h in console:
        h.setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        with end_of_run_records():
            distributed_utils.call_main(convert_namespace_to_omegaconf(train_args), fairseq_train.main)
        return "finished"
    except SystemExit as end:  # the plugin ends a run that resumes with nothing left to train
        if end.code not in (0, None):
            raise
        return "finished"
    except Exception as err:  # fairseq's NaN detector may fail while it reports the FloatingPointError
        cause = err
        while cause is not None and not isinstance(cause, FloatingPointError):
            cause = cause.__context__
        if cause is None:
            raise
        logger.info("diverged: %s", cause)
        return "diverged"
    finally:
        root.removeHandler(handler)
        root.setLevel(root_level)
        handler.close()
        for h, level in zip(console, levels):
            h.setLevel(level)


def numbers(stats):
    out = {}
    for key, value in stats.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            pass
    return out


@contextmanager
def end_of_run_records():
    """Each checkpoint fairseq saves holds, in its ``extra_state["study"]``,
    the training numbers of the epoch so far (what the epoch's ``| train |``
    line prints after the save), the last validation's and the update count:
    the end of a run is read from its last checkpoint, which fairseq renames
    into place whole, and never from a log that a kill between the save and
    the line would leave one epoch short."""
    from fairseq.logging import metrics
    from fairseq.trainer import Trainer
    from fairseq_cli import train as fairseq_train

    save, valid_stats, last_valid = Trainer.save_checkpoint, fairseq_train.get_valid_stats, {}

    def get_valid_stats(*args, **kwargs):
        stats = valid_stats(*args, **kwargs)
        last_valid.clear()
        last_valid.update(numbers(stats))
        return stats

    def save_checkpoint(self, filename, extra_state):
        extra_state["study"] = dict(updates=self.get_num_updates(), valid=dict(last_valid),
                                    train=numbers(metrics.get_smoothed_values("train")))
        return save(self, filename, extra_state)

    Trainer.save_checkpoint, fairseq_train.get_valid_stats = save_checkpoint, get_valid_stats
    try:
        yield
    finally:
        Trainer.save_checkpoint, fairseq_train.get_valid_stats = save, valid_stats


def end_of_run(checkpoint):
    """The end-of-run record of a finished cell's last checkpoint."""
    from ..common.checkpoints import load

    record = (load(str(checkpoint)).get("extra_state") or {}).get("study")
    if not record:
        raise StudyError(f"{checkpoint}: holds no end-of-run record (saved by an earlier version of the study); "
                         f"remove {checkpoint.parent} to train the cell again")
    return record


# ---------------------------------------------------------------- the report


T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df):
    """Student's t 0.975 quantile: a table to 30 degrees of freedom, then the
    Cornish-Fisher expansion to its second term (Abramowitz & Stegun 26.7.5)."""
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_sd(values):
    n = len(values)
    mean = sum(values) / n
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    return mean, sd


def paired(norm_values, base_values):
    """Mean difference over seeds and its 95% interval (t), from {seed: value} pairs."""
    seeds = sorted(set(norm_values) & set(base_values))
    diffs = [norm_values[s] - base_values[s] for s in seeds if math.isfinite(norm_values[s] - base_values[s])]
    if len(diffs) < 2:
        return None
    mean, sd = mean_sd(diffs)
    half = t975(len(diffs) - 1) * sd / len(diffs) ** 0.5
    low, high = mean - half, mean + half
    return dict(n=len(diffs), mean=mean, low=low, high=high, evidence=not low <= 0 <= high)


def fmt(value, spec="{:.3f}"):
    return spec.format(value) if isinstance(value, (int, float)) and math.isfinite(value) else "—"


def report(args, grid, results):
    """study.json and study.md from every finished cell."""
    metric_key, metric_label, metric_fmt = METRIC[args.task]
    groups = defaultdict(list)
    for cell in grid:  # a table per placement and QK-norm, then per depth, width and init
        groups[(cell["placement"], cell["qk"], cell["depth"], cell["width"], cell["init"])].append(cell)
    placed = (f"placements {', '.join(args.placements)}" if args.placement_axis else f"{args.placement}-norm")
    lines = [f"# Normalization study: {args.task}", "",
             f"Data `{args.data_as_given}`; {args.optimizer}, {placed}, "
             f"warmup {args.warmup_updates} updates, "
             + (f"{args.max_update} updates" if args.max_update else f"{args.max_epochs} epochs")
             + f"; seeds {', '.join(map(str, args.seeds))}."
             + (f" fairseq-train flags after `--` (over the dimensions below where they name them): "
                f"`{shlex.join(args.fairseq_args)}`." if args.fairseq_args else ""), "",
             f"A cell reads *converged k/n* over the seeds, then the mean final training loss (bits) and "
             f"{metric_label} of the seeds that finished. Converged: finite, and below {args.converged_fraction:g} x "
             f"the initial loss and below {args.majority_loss:.3f} bits, the best constant prediction "
             "(docs/study.md).", ""]
    tables = []
    for (placement, qk, depth, w, init), members in groups.items():
        d, ffn, heads = dims(w)
        norms = norms_of(args, placement)
        where = (f"{placement}, " if args.placement_axis else "") + (f"qk-norm {qk}, " if qk != "none" else "")
        lines += [f"## {where}depth {depth}, width {w} ({d}/{ffn}, {heads} heads), init {init}", "",
                  "| lr | " + " | ".join(norms) + " |", "|---" * (len(norms) + 1) + "|"]
        table = dict(placement=placement, qk=qk, depth=depth, width=w, init=init, rows=[])
        for lr in sorted(args.lrs, reverse=True):
            row = [f"{lr:g}"]
            entry = dict(lr=lr, norms={})
            for norm in norms:
                runs = [results.get(c["name"]) for c in members if c["lr"] == lr and c["norm"] == norm]
                done = [r for r in runs if r]
                if len(done) < len(runs):
                    row.append(f"{len(done)}/{len(runs)} done")
                    entry["norms"][norm] = None
                    continue
                k = sum(r["converged"] for r in done)
                finite = [r for r in done if math.isfinite(r["final_loss"])]
                loss = sum(r["final_loss"] for r in finite) / len(finite) if finite else float("nan")
                metric = sum(r["metric"] for r in finite) / len(finite) if finite else float("nan")
                row.append(f"{k}/{len(done)} · {fmt(loss)} · {fmt(metric, metric_fmt)}" if finite
                           else f"{k}/{len(done)} · diverged")
                entry["norms"][norm] = dict(converged=k, runs=len(done), final_loss=loss, metric=metric)
            lines.append("| " + " | ".join(row) + " |")
            table["rows"].append(entry)
        tables.append(table)
        lines.append("")
    if len(args.inits) > 1:
        labels = list(dict.fromkeys(series(args, c) for c in grid))
        lines += ["## init", "", "Converged cells over every learning rate, depth, width and seed.", "",
                  "| init | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for init in args.inits:
            row = [init]
            for label in labels:
                done = [results[c["name"]] for c in grid if c["init"] == init and series(args, c) == label
                        and c["name"] in results]
                row.append(f"{sum(r['converged'] for r in done)}/{len(done)}")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    seeds = seed_report(args, grid, results, lines, metric_label, metric_fmt)
    figures = [f for f in ("init_grads.png", "loss.png", "landscape.png") if Path(args.out, f).exists()]
    if figures:
        lines += ["## figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
    study = dict(task=args.task, data=args.data_as_given, majority_loss=args.majority_loss,
                 converged_fraction=args.converged_fraction, tables=tables, seeds=seeds,
                 cells=[results.get(c["name"], dict(c, status="pending")) for c in grid])
    with atomic_path(Path(args.out, "study.json")) as tmp:
        Path(tmp).write_text(json.dumps(study, indent=1))
    with atomic_path(Path(args.out, "study.md")) as tmp:
        Path(tmp).write_text("\n".join(lines))


def seed_report(args, grid, results, lines, metric_label, metric_fmt):
    """Mean ± sd over seeds per norm, each norm's paired difference to the
    first norm, and with ``--placements`` each placement's to the first
    placement with the same norm (rezero, whose only norm is none, to the
    first placement's first norm)."""
    if len(args.seeds) < 2:
        return []
    base, first = args.norms[0], args.placements[0]
    axis = args.placement_axis
    out = []
    against = f" and to {first}" if axis else ""
    lines += [f"## seeds: {metric_label}, mean ± sd, and the paired difference to {base}{against} (95% interval)",
              ""]
    lines += ["| depth | width | init | lr | " + "placement | " * axis + "norm | " + metric_label + " | difference to "
              + base + " | |" + f" difference to {first} | |" * axis, "|---" * (8 + 3 * axis) + "|"]
    combos = sorted({(c["depth"], c["width"], c["init"], c["lr"]) for c in grid}, key=str)
    for depth, w, init, lr in combos:
        values = defaultdict(dict)
        for c in grid:
            r = results.get(c["name"])
            if r and (c["depth"], c["width"], c["init"], c["lr"]) == (depth, w, init, lr):
                values[c["placement"], c["qk"], c["norm"]][c["seed"]] = r["metric"]
        for placement, qk, norm in dict.fromkeys((c["placement"], c["qk"], c["norm"]) for c in grid):
            v = [x for x in values[placement, qk, norm].values() if math.isfinite(x)]
            if not v:
                continue
            mean, sd = mean_sd(v)
            diff = paired(values[placement, qk, norm], values[placement, qk, base]) if norm != base \
                and (placement, qk, base) in values else None
            other = (first, qk, norm if (first, qk, norm) in values else base)
            moved = paired(values[placement, qk, norm], values[other]) if axis and placement != first \
                and other in values else None
            label = " | ".join([placement] * axis + [norm + (f" qk {qk}" if qk != "none" else "")])
            lines.append(f"| {depth} | {w} | {init} | {lr:g} | {label} | {fmt(mean, metric_fmt)} ± "
                         f"{fmt(sd, metric_fmt)} (n={len(v)}) | {interval(diff)}" + f" | {interval(moved)}" * axis
                         + " |")
            out.append(dict(depth=depth, width=w, init=init, lr=lr, placement=placement, qk=qk, norm=norm, n=len(v),
                            mean=mean, sd=sd, difference=diff, placement_difference=moved))
    lines.append("")
    return out


def interval(diff):
    """A paired difference's cells: its mean and 95% interval, and the verdict."""
    if not diff:
        return " | "
    verdict = "evidence of a difference" if diff["evidence"] else "no evidence"
    return f"{diff['mean']:+.2f} [{diff['low']:+.2f}, {diff['high']:+.2f}] | {verdict}"


def figures(args, grid, results):
    """init_grads.png, loss.png and (--landscape) landscape.png."""
    from .analyze import pyplot, save_figure

    plt = pyplot()
    done = [(c, results[c["name"]]) for c in grid if c["name"] in results]
    if not done:
        return
    labels = list(dict.fromkeys(series(args, c) for c in grid))  # a line per norm (and placement, QK-norm)
    colors = {n: f"C{i % 10}" for i, n in enumerate(labels)}
    styles = dict(zip(args.widths, ["-", "--", ":", "-."] * 4))
    # per-layer gradient norms at init: one panel per depth (x init), a line per norm x width
    panels = sorted({(c["depth"], c["init"]) for c, _ in done}, key=str)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (depth, init) in zip(axes[0], panels):
        seen = set()
        for c, _ in done:
            if (c["depth"], c["init"]) != (depth, init) or (series(args, c), c["width"]) in seen:
                continue
            seen.add((series(args, c), c["width"]))
            probe = json.loads(Path(args.out, "cells", c["name"], "init.json").read_text())
            groups = sorted(probe["grad_norms"], key=order)
            ax.plot(range(len(groups)), [probe["grad_norms"][g] for g in groups], marker="o",
                    color=colors[series(args, c)], linestyle=styles[c["width"]],
                    label=f"{series(args, c)}, width {c['width']}")
            ax.set_xticks(range(len(groups)), [re.sub(r"^(encoder[. ]|head )", "", g) for g in groups],
                          rotation=60, fontsize=7, ha="right")
        ax.set(yscale="log", ylabel="gradient norm at init (per example)", title=f"depth {depth}, init {init}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, Path(args.out, "init_grads.png"), plt)
    # loss curves: a panel per depth x width x init (rows) and learning rate (columns); train solid, valid dashed
    rows = sorted({(c["depth"], c["width"], c["init"]) for c, _ in done}, key=str)
    lrs = sorted({c["lr"] for c, _ in done}, reverse=True)
    fig, axes = plt.subplots(len(rows), len(lrs), figsize=(4 * len(lrs), 3.2 * len(rows)), squeeze=False)
    key = LOSS[args.task]
    for c, r in done:
        if c["seed"] != args.seeds[0]:
            continue
        ax = axes[rows.index((c["depth"], c["width"], c["init"]))][lrs.index(c["lr"])]
        records = read_log(Path(args.out, "cells", c["name"], "train.log"))
        train_points = [(0, r["initial_loss"])] + [(x["num_updates"], x[key]) for x in records["train_inner"]
                                                   if key in x and "num_updates" in x]
        valid_points = [(x["num_updates"], x[key]) for x in records["valid"] if key in x and "num_updates" in x]
        for points, style in ((train_points, "-"), (valid_points, "--")):
            if points:
                ax.plot(*zip(*points), linestyle=style, color=colors[series(args, c)], marker=".")
        ax.set_title(f"d{c['depth']} w{c['width']} {c['init']} lr {c['lr']:g}", fontsize=8)
        ax.set(yscale="log", xlabel="update", ylabel="loss (bits)")
    from matplotlib.lines import Line2D

    fig.legend([Line2D([], [], color=colors[n]) for n in labels], labels, loc="upper right", fontsize=8)
    fig.suptitle(f"training (solid, from the initial loss) and valid (dashed) loss, seed {args.seeds[0]}")
    fig.tight_layout()
    save_figure(fig, Path(args.out, "loss.png"), plt)
    if args.landscape:
        measured = [(c, r) for c, r in done if "lipschitz" in r]
        if measured:
            fig, axes = plt.subplots(len(rows), 2, figsize=(10, 3.4 * len(rows)), squeeze=False)
            for norm in labels:
                for i, row in enumerate(rows):
                    points = sorted((c["lr"], r["lipschitz"], r["smoothness"]) for c, r in measured
                                    if series(args, c) == norm and (c["depth"], c["width"], c["init"]) == row
                                    and c["seed"] == args.seeds[0])
                    for j, name in ((0, "Lipschitz"), (1, "smoothness")):
                        if points:
                            axes[i][j].plot([p[0] for p in points], [p[1 + j] for p in points], marker="o",
                                            color=colors[norm], label=norm)
                        axes[i][j].set(xscale="log", yscale="log", xlabel="learning rate", ylabel=name,
                                       title=f"{name}, d{row[0]} w{row[1]} {row[2]}")
            axes[0][0].legend(fontsize=7)
            fig.suptitle("loss landscape at the final checkpoint: max over a in (0, lr) of |L(W) - L(W - a g)| "
                         "and ||g(W) - g(W - a g)||", fontsize=9)
            fig.tight_layout()
            save_figure(fig, Path(args.out, "landscape.png"), plt)


# ---------------------------------------------------------------- the command


def parser():
    from ..norms.placement import PLACEMENTS

    p = ArgumentParser(prog="norm-study.sh", description="A grid of training runs over learning rate, depth, "
                       "width, norm, init and seed, with its convergence tables and figures (docs/study.md).")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--data", required=True, help="binarized data (data-prep/)")
    p.add_argument("--out", required=True, help="the study's directory: cells/, study.md, study.json, figures")
    p.add_argument("--lrs", nargs="+", type=positive, metavar="LR")
    p.add_argument("--depths", nargs="+", type=at_least(1, "--depths"), metavar="N", help="layers (per side)")
    p.add_argument("--widths", nargs="+", type=width, metavar="W",
                   help=f"{', '.join(f'{k} ({v})' for k, v in WIDTHS.items())} or an embedding size; "
                        "the feed-forward is 4x, a head per 64 channels")
    p.add_argument("--norms", nargs="+", metavar="KIND", help="--norm-type kinds; the first is the baseline "
                   "of the paired differences")
    p.add_argument("--inits", nargs="+", metavar="INIT", help="--init schemes")
    p.add_argument("--seeds", nargs="+", type=at_least(0, "--seeds"), default=[1], metavar="N")
    p.add_argument("--optimizer", choices=("sgd", "adam"))
    p.add_argument("--placement", choices=PLACEMENTS, help="every cell's --norm-placement")
    p.add_argument("--placements", nargs="+", choices=PLACEMENTS, metavar="P", help="--norm-placement as an "
                   "axis of the grid, like --norms (the first is the baseline of a second paired difference); "
                   "rezero's cells take --norm-type none")
    p.add_argument("--qk-norms", nargs="+", metavar="KIND", help="--qk-norm as an axis: per-token kinds, or none "
                   "(default: none)")
    p.add_argument("--warmup-updates", type=at_least(0, "--warmup-updates"), metavar="N",
                   help="linear warmup, then inverse square root (0: a fixed learning rate)")
    p.add_argument("--max-epochs", type=at_least(1, "--max-epochs"), metavar="N")
    p.add_argument("--max-update", type=at_least(1, "--max-update"), metavar="N", help="instead of --max-epochs")
    p.add_argument("--batch-size", type=at_least(1, "--batch-size"), default=32, help="sentences (classification)")
    p.add_argument("--max-tokens", type=at_least(1, "--max-tokens"), default=2048)
    p.add_argument("--log-interval", type=at_least(1, "--log-interval"), default=10, help="updates per loss point")
    p.add_argument("--converged-fraction", type=fraction("--converged-fraction"), default=0.5, metavar="F")
    p.add_argument("--landscape", action="store_true", help="Lipschitz constant and smoothness of each cell's "
                   "final loss (powernorm-analyze --landscape)")
    p.add_argument("--jobs", type=at_least(1, "--jobs"), default=1, help="cells at once (processes)")
    p.add_argument("--threads", type=at_least(1, "--threads"), help="torch threads per cell (default: cores / jobs)")
    p.add_argument("--print-commands", action="store_true", help="write OUT/commands.sh, one command per "
                   "unfinished cell (for a scheduler), and exit; a later run collects the cells")
    p.add_argument("--cell", metavar="NAME", help="run this cell only (what --print-commands writes)")
    p.add_argument("--verbose", action="store_true", help="fairseq's log on the console too")
    p.usage = "norm-study.sh [options] [-- FAIRSEQ-TRAIN FLAGS...]"
    p.epilog = "After --: more fairseq-train flags, given to every cell."
    return p


def parse_args(p, argv):
    """The study's flags, and fairseq-train's after ``--`` (an unknown flag
    before it is refused, never taken for fairseq's)."""
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = p.parse_args(ours)
    args.fairseq_args = theirs
    return args


def check(args, p):
    from ..models.options import init_scheme
    from ..norms import NORM_TYPES

    from ..norms.qk_norm import QK_KINDS

    if args.placement and args.placements:
        p.error("--placement and --placements: give one (--placements P... makes the placement an axis)")
    args.placement_axis = bool(args.placements)
    for key, value in DEFAULTS[args.task].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.placements = args.placements or [args.placement]
    args.placement = "per cell" if args.placement_axis else args.placement  # settings.json: one, or the grid's
    args.qk_norms = args.qk_norms or ["none"]
    for kind in args.qk_norms:
        if kind not in QK_KINDS + ("none",):
            p.error(f"--qk-norms: {kind!r} cannot normalise a head's queries and keys; choose from "
                    f"{', '.join(QK_KINDS)}, none")
    args.lrs = [float(x) for x in args.lrs]
    args.widths = [width(str(w)) for w in args.widths]
    for norm in args.norms:
        if norm not in NORM_TYPES:
            p.error(f"--norms: unknown kind {norm!r}; choose from {', '.join(NORM_TYPES)}")
    try:
        args.inits = [init_scheme(i) for i in args.inits]
    except argparse.ArgumentTypeError as err:
        p.error(str(err).replace("--init", "--inits"))
    for key in ("lrs", "depths", "widths", "norms", "inits", "seeds", "placements", "qk_norms"):
        values = getattr(args, key)
        if len(set(values)) != len(values):
            p.error(f"--{key} lists a value twice: {' '.join(map(str, values))}")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    args.data_as_given = args.data  # what the report names: no path of this machine beyond the user's own
    args.data = Path(args.data).resolve()
    args.out = Path(args.out).resolve()
    for w in args.widths:
        check_width(w)
    check_data(args)
    args.majority_loss = constant_loss(args)
    check_names(cells(args))
    check_fairseq_args(args)


class _FairseqUsage(Exception):
    pass


def check_fairseq_args(args):
    """Every cell's fairseq-train command, parsed by fairseq's own parser (a
    typo after ``--`` or a combination the plugin refuses is one line, before
    anything is written), once per kind of cell; and a run that saves its
    last checkpoint every epoch, which the study's results and resumes read."""
    import argparse as stock

    from ..common.errors import PowerNormConfigError
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ..models.options import check_args

    def error(self, message):
        raise _FairseqUsage(message)

    seen, error_before = set(), stock.ArgumentParser.error
    stock.ArgumentParser.error = error
    try:
        for cell in cells(args):
            kind = (cell["depth"], cell["width"], cell["norm"], cell["init"], cell["placement"], cell["qk"])
            if kind in seen:
                continue
            seen.add(kind)
            try:
                parsed = parse(train_argv(args, cell, args.out / "cells" / cell["name"]))
                # the model's own refusals, before any cell trains, over the sides the model has
                check_args(parsed, tuple(ARCH_MODEL_REGISTRY[parsed.arch].NORM_FLAGS))
            except _FairseqUsage as err:
                raise StudyError(f"fairseq-train (the flags after --): {err}") from None
            except PowerNormConfigError as err:
                raise StudyError(f"cell {cell['name']}: {err}") from None
            for flag, bad in (("--no-save", parsed.no_save), ("--no-last-checkpoints", parsed.no_last_checkpoints),
                              (f"--save-interval {parsed.save_interval}", parsed.save_interval != 1)):
                if bad:
                    raise StudyError(f"after --: {flag}: a cell's result and its resume are read from the "
                                     "checkpoint_last.pt saved at the end of every epoch; leave it out")
    finally:
        stock.ArgumentParser.error = error_before


def quiet(verbose):
    """fairseq's log format on the console: its INFO lines with --verbose,
    else warnings only; the cells' logs hold everything."""
    import warnings

    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO if verbose else logging.WARNING,
                        stream=sys.stderr, force=True)
    # fairseq's --eval-tokenized-bleu scores tokenized text on purpose; sacreBLEU warns of it all the same
    logging.getLogger("sacrebleu").setLevel(logging.ERROR)
    if not verbose:
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)


def main(argv=None):
    end_cleanly_on_sigterm()
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(p, argv)
    try:
        check(args, p)
    except StudyError as err:
        p.error(str(err))
    quiet(args.verbose)
    try:
        study(args, argv, p)
    except KeyboardInterrupt:
        p.exit(130, f"{p.prog}: interrupted; the finished cells are kept, and the same command resumes the rest\n")
    except StudyError as err:
        p.error(str(err))


def writable_out(args, p):
    """OUT made, or one line saying why it cannot be, before anything is written there."""
    out = args.out
    if out.exists() and not out.is_dir():
        p.error(f"--out {out}: is a file, not a directory; give a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        p.error(f"--out {out}: cannot write there ({err.strerror or err}); give a writable directory")


def study(args, argv, p):
    grid = cells(args)
    if args.cell:
        grid = [c for c in grid if c["name"] == args.cell]
        if not grid:
            p.error(f"--cell {args.cell}: not a cell of this grid")
    writable_out(args, p)
    same_settings(args, p)

    def finished(members):
        """{name: result} of the finished cells among ``members``, each result.json read once."""
        done = {}
        for cell in members:
            path = Path(args.out, "cells", cell["name"], "result.json")
            result = json.loads(path.read_text()) if path.exists() else None
            if result is not None and not wants_landscape(args, result):
                done[cell["name"]] = result
        return done

    if args.print_commands:
        rest, skip = [], 0
        for a in argv:  # the same command, one cell each
            if skip:
                skip -= 1
            elif a in ("--print-commands",):
                continue
            elif a in ("--jobs", "--cell"):
                skip = 1
            else:
                rest.append(a)
        script = Path(__file__).resolve().parents[2] / "scripts" / "norm-study.sh"
        done = finished(grid)
        todo = [c for c in grid if c["name"] not in done]
        with atomic_path(args.out / "commands.sh") as tmp:
            Path(tmp).write_text("".join(
                shlex.join(["bash", str(script), *rest_with_cell(rest, c["name"])]) + "\n" for c in todo))
        print(f"norm-study: {len(todo)} command(s), one per unfinished cell: {args.out / 'commands.sh'}; "
              "run them anywhere that sees OUT, then this command again without --print-commands to collect",
              file=sys.stderr)
        return
    results = finished(grid)
    todo = [c for c in grid if c["name"] not in results]
    print(f"norm-study: {len(grid)} cells, {len(results)} finished, {len(todo)} to run ({args.jobs} at once)",
          file=sys.stderr)
    busy = []
    for done, (cell, result) in enumerate(run_all(args, todo), 1):
        if result is None:
            print(f"norm-study: {cell['name']}: running in another process, skipped", file=sys.stderr)
            continue
        results[cell["name"]] = result
        busy.append(result["seconds"])
        left = len(todo) - done
        eta = sum(busy) / len(busy) * left / args.jobs
        state = "converged" if result["converged"] else result["status"] if result["status"] != "finished" \
            else "not converged"
        print(f"norm-study: [{len(results)}/{len(grid)}] {cell['name']}: {state}, loss "
              f"{fmt(result['initial_loss'])} -> {fmt(result['final_loss'])}, {METRIC[args.task][1]} "
              f"{fmt(result['metric'], METRIC[args.task][2])} ({result['seconds']:.0f} s); {left} left, "
              f"about {eta / 60:.1f} min", file=sys.stderr)
    if args.cell:
        return
    full = cells(args)
    with open(args.out / ".report.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one report at a time, each from every result on disk when it starts
        results = finished(full)
        try:
            figures(args, full, results)
            report(args, full, results)
        except OSError as err:
            raise StudyError(f"{err.filename or args.out}: could not be written ({err.strerror or err}); every "
                             "finished cell is kept: rerun the command to write the report") from None
    pending = len(full) - len(results)
    print(f"norm-study: {args.out / 'study.md'}" + (f" ({pending} cells pending)" if pending else ""),
          file=sys.stderr)


#: what every cell of one OUT must share (the grid's lists may grow between runs)
SETTINGS = ("task", "optimizer", "placement", "warmup_updates", "max_epochs", "max_update", "batch_size",
            "max_tokens", "converged_fraction", "fairseq_args")


def settings(args):
    mine = {key: getattr(args, key) for key in SETTINGS}
    mine["data"] = str(args.data)
    return mine


def trained_any(out):
    """Whether a cell of OUT holds what training made: a checkpoint or a result."""
    return any(Path(out, "cells").glob("*/checkpoint*.pt")) or any(Path(out, "cells").glob("*/result.json"))


def same_settings(args, p):
    """OUT/settings.json holds the training settings of the cells trained
    there; a rerun with others would mix cells trained two ways, and is
    refused. Settings that no cell trained with yet (a start that failed)
    bind nothing: the probes they made are removed, and the new settings
    are recorded when a cell starts (:func:`record_settings`)."""
    path = Path(args.out, "settings.json")
    if not path.exists():
        return
    mine, theirs = settings(args), json.loads(path.read_text())
    differ = [k for k in mine if theirs.get(k) != mine[k]]
    if not differ:
        return
    if trained_any(args.out):
        k = differ[0]
        p.error(f"--out {args.out} holds a study run with {k.replace('_', '-')} {theirs.get(k)!r}, not "
                f"{mine[k]!r}: rerun it with its settings, or give another --out")
    for probe in Path(args.out, "cells").glob("*/init.json"):
        probe.unlink()
    path.unlink()


def record_settings(args):
    """settings.json, written when a cell starts."""
    path = Path(args.out, "settings.json")
    mine = settings(args)
    if not path.exists() or json.loads(path.read_text()) != mine:
        with atomic_path(path) as tmp:
            Path(tmp).write_text(json.dumps(mine, indent=1))


def rest_with_cell(rest, name):
    """The command's arguments with ``--cell name`` before any ``--`` (fairseq's flags)."""
    if "--" in rest:
        i = rest.index("--")
        return rest[:i] + ["--cell", name] + rest[i:]
    return rest + ["--cell", name]


def run_all(args, todo):
    """(cell, result) as each finishes: in this process, or in ``--jobs`` worker processes."""
    if args.jobs == 1 or len(todo) <= 1:
        for cell in todo:
            yield cell, run_cell(args, cell, args.verbose)
        return
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(args.jobs, initializer=_worker, initargs=(args.verbose,)) as pool:
        pending = {pool.apply_async(run_cell, (args, cell, False)): cell for cell in todo}
        while pending:
            for job in [j for j in pending if j.ready()]:
                yield pending.pop(job), job.get()
            time.sleep(0.2)


def _worker(verbose):
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process ends the pool
    end_cleanly_on_sigterm()
    quiet(verbose)


if __name__ == "__main__":
    main()
