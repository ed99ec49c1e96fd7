"""The PowerNorm paper's analysis figures from training runs: ``powernorm-analyze``.

Each input gives one analysis, a CSV and PNG plots in ``--out``:

* ``--logs``: fairseq logs of runs trained with ``--norm-diagnostics``
  (``--log-format json`` or ``simple``; ``--log-file``, or the console saved
  to a file such as the ``train.log`` of ``scripts/train.sh``), or directories
  holding them (``*.log``). -> ``statistics.csv``,
  ``statistics.png`` (batch vs running statistics distance, Figures 2 and 4),
  ``gradients.png`` (gradient terms of the statistics, Figures 3 and 4),
  ``discrepancy.png`` (the training-inference discrepancy, TID, of Wang et al., 2022).
* ``--checkpoints``: -> ``spectrum.csv``, ``spectrum.png``: singular values of
  the embedding matrix divided by the largest, one curve per checkpoint
  (Figure 6).
* ``--ablation``: the ``figure5.csv`` of ``scripts/batch-ablation.sh`` ->
  ``batch_size.csv``, ``batch_size.png``: BLEU against the statistics batch
  size (Figure 5).
* ``--landscape`` with ``--checkpoints`` and ``--data``: -> ``landscape.csv``,
  ``landscape_summary.csv``, ``landscape.png``. On a few batches, with W the
  checkpoint's weights, g the gradient of the per-token training loss L there
  and a over step sizes in (0, lr): the local Lipschitz constant max_a
  |L(W) - L(W - a g)|, the smoothness max_a ||grad L(W) - grad L(W - a g)||,
  ||g||, and ||g|| of the same model freshly initialised (step 0). The loss is
  the training criterion of the checkpoint in training mode (batch statistics,
  as the optimizer sees them) without dropout, back-propagated summed over
  tokens and divided after, as fairseq's trainer does (PN's nu holds gradients
  in the units of the summed loss); the model's buffers are restored after
  every evaluation. Averages over the batches go to the summary.
"""

import csv
import json
import logging
import re
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import torch

from ..common.errors import InputFileError
from ..common.files import atomic_path, check_regular_file, end_cleanly_on_sigterm
from ..common.flags import ArgumentParser, at_least, positive
from .checkpoint_info import AnalyzeError, checkpoint_info, checkpoint_label, load_checkpoint
from .plots import pyplot, save_figure

# a training-interval record: "... | train_inner | {json}" on the console, the
# bare JSON in a --log-file (where epoch and valid records prefix their keys)
RECORD = re.compile(r"(?:\| (\w+) \| )?(\{.*\})\s*$")
# the same in --log-format simple: "epoch 001:  10 / 90 loss=3.1, ..., num_updates=10, diag/...=0.5"
# (only interval records use key=value; epoch and valid summaries use "key value |")
SIMPLE_FIELD = re.compile(r"([\w./-]+)=([^,\s]+)")
STATISTICS_COLUMNS = ["run", "norm_type", "layer", "metric", "update", "value"]
SPECTRUM_COLUMNS = ["checkpoint", "norm_type", "update", "index", "singular_value", "normalized"]
BATCH_SIZE_COLUMNS = ["source", "norm_type", "stat_batch_tokens", "bleu", "sacrebleu"]
LANDSCAPE_COLUMNS = ["checkpoint", "norm_type", "update", "batch", "step_size", "loss", "loss_change",
                     "grad_change"]
SUMMARY_COLUMNS = ["checkpoint", "norm_type", "update", "lr", "batches", "lipschitz", "smoothness",
                   "grad_norm", "initial_grad_norm"]
LABELS = {
    "mu": r"$\frac{1}{d}\|\mu_B - \mu\|_2$", "var": r"$\frac{1}{d}\|\sigma_B^2 - \sigma^2\|_2$",
    "psi2": r"$\frac{1}{d}\|\psi_B^2 - \psi^2\|_2$",
    "grad_mu": r"$\|\partial L/\partial\mu_B\|_2$", "grad_var": r"$\|\partial L/\partial\sigma_B^2\|_2$",
    "grad_psi2": r"$\|\partial L/\partial\psi^2\|_2$",
    "tid_mu": r"mean $|\mu - \mu_B| / \sigma_B$", "tid_sigma": r"mean $|\sigma / \sigma_B - 1|$",
    "tid_psi": r"mean $|\psi / \psi_B - 1|$",
}


# ---------------------------------------------------------------- logs


def find_logs(paths):
    logs = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.rglob("*.log"))
            if not found:
                raise AnalyzeError(f"no fairseq log (*.log) under {path}")
            logs += found
        elif path.is_file():
            logs.append(path)
        else:
            raise AnalyzeError(f"no such log file or directory: {path}")
    return logs


def run_labels(paths):
    """Each run is named by the directory of its log, or directory/file when two share one."""
    parents = [p.resolve().parent.name for p in paths]
    return [f"{parent}/{p.stem}" if parents.count(parent) > 1 else parent
            for parent, p in zip(parents, paths)]


def read_diagnostics(path):
    """Rows (norm_type, layer, metric, update, value) of the ``diag/`` metrics in a fairseq log."""
    rows = {}  # a --log-file can hold each record more than once
    _regular(path, "log")
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            record = None
            match = RECORD.search(line)
            if match and match.group(1) in (None, "train_inner"):
                try:
                    record = json.loads(match.group(2))
                except json.JSONDecodeError:
                    pass
            elif "num_updates=" in line:
                record = dict(SIMPLE_FIELD.findall(line))
            if not isinstance(record, dict) or "num_updates" not in record:
                continue
            update = int(float(record["num_updates"]))
            for key, value in record.items():
                if key.startswith("diag/") and key.count("/") == 3:
                    _, kind, layer, metric = key.split("/")
                    rows[(kind, layer, metric, update)] = float(value)
    return [(*key, value) for key, value in rows.items()]


def statistics(logs):
    rows = []
    for label, path in zip(run_labels(logs), logs):
        found = read_diagnostics(path)
        if not found:
            print(f"powernorm-analyze: {path}: no diag/ metrics (no --norm-diagnostics, no batch-statistic "
                  "norm, or a tqdm/none --log-format); skipped", file=sys.stderr)
        rows += [(label, *row) for row in found]
    if not rows:
        raise AnalyzeError("no log has diag/ metrics: train a bn, bn-original, pn-v or pn norm with "
                           "--norm-diagnostics and --log-format json or simple")
    return rows


def plot_statistics(rows, prefix, out, title, plt):
    """One panel per metric; per run the mean over its layers, shaded from min to max layer."""
    metrics = sorted({r[3] for r in rows if r[3].startswith(prefix)}, key=[
        "dist_mu", "dist_var", "dist_psi2", "grad_mu", "grad_var", "grad_psi2", "tid_mu", "tid_sigma", "tid_psi"].index)
    if not metrics:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        curves = defaultdict(lambda: defaultdict(list))
        for run, kind, _layer, m, update, value in rows:
            if m == metric:
                curves[(run, kind)][update].append(value)
        for (run, kind), points in sorted(curves.items()):
            updates = sorted(points)
            mean = [sum(points[u]) / len(points[u]) for u in updates]
            line, = ax.plot(updates, mean, label=f"{kind} ({run})", lw=1.8)
            ax.fill_between(updates, [min(points[u]) for u in updates], [max(points[u]) for u in updates],
                            color=line.get_color(), alpha=0.15, lw=0)
        ax.set_yscale("log")
        ax.set_xlabel("update (optimizer steps)")
        ax.set_ylabel(LABELS[metric.replace("dist_", "")] + {"dist": " (activation units)", "tid": " (ratio)"}.get(
            prefix, " (summed loss / statistic)"))
        ax.set_title(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="norm (run)", title_fontsize=8)
    fig.suptitle(f"{title} (line: mean over layers; band: min to max layer)")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- checkpoints


def _regular(path, what):
    """A user's file, refused in one line unless it is a regular file (a FIFO would hold the command)."""
    try:
        check_regular_file(path, what)
    except InputFileError as err:
        raise AnalyzeError(str(err)) from None


def normalized_singular_values(matrix):
    """Singular values of ``matrix``, largest first, and the same divided by the largest."""
    s = torch.linalg.svdvals(matrix.double())
    return s, s / s[0]


def spectrum(paths, key):
    rows = []
    for path in paths:
        state = load_checkpoint(path)
        if key not in state.get("model", {}):
            raise AnalyzeError(f"{path} has no '{key}' (choose the matrix with --embedding KEY)")
        kind, update = checkpoint_info(state)
        s, normalized = normalized_singular_values(state["model"][key])
        rows += [(checkpoint_label(path), kind, update, i + 1, v.item(), r.item())
                 for i, (v, r) in enumerate(zip(s, normalized))]
    return rows


def plot_spectrum(rows, key, plt):
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    curves = defaultdict(list)
    for ckpt, kind, update, index, _, normalized in rows:
        curves[(kind, ckpt, update)].append((index, normalized))
    for (kind, ckpt, update), points in curves.items():
        ax.plot(*zip(*points), label=f"{kind}: {ckpt} (update {update})", lw=1.6)
    ax.set_xlabel("singular value index i (largest first)")
    ax.set_ylabel(r"$\sigma_i / \sigma_1$ (dimensionless)")
    ax.set_title(f"Normalized singular values of {key}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="encoder norm: checkpoint", title_fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- Figure 5


def batch_size(paths):
    rows = []
    for path in paths:
        _regular(path, "ablation table")
        with open(path, newline="") as f:
            records = list(csv.DictReader(f))
        wanted = {"norm", "stat_batch_tokens", "bleu", "sacrebleu"}
        if not records or not wanted <= set(records[0]):
            raise AnalyzeError(f"{path} is not a figure5.csv of scripts/batch-ablation.sh "
                               f"(needs columns {', '.join(sorted(wanted))})")
        rows += [(str(path), r["norm"], int(r["stat_batch_tokens"]), float(r["bleu"]), float(r["sacrebleu"]))
                 for r in records]
    return rows


def plot_batch_size(rows, plt):
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    curves = defaultdict(list)
    for _, kind, tokens, bleu, _ in rows:
        curves[kind].append((tokens, bleu))
    for kind, points in sorted(curves.items()):
        ax.plot(*zip(*sorted(points)), marker="o", label=kind)
    sizes = sorted({r[2] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("statistics batch size (tokens per forward)")
    ax.set_ylabel("test BLEU (%)")
    ax.set_title("BLEU against the batch size the norm statistics see")
    ax.grid(alpha=0.3)
    ax.legend(title="encoder norm")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- output


def write_csv(path, columns, rows):
    """Write to a temporary file and rename, so no half-written table is left."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(rows)
    return path


def main(argv=None):
    end_cleanly_on_sigterm()
    parser = ArgumentParser(
        prog="powernorm-analyze",
        description="Plots and CSVs of the PowerNorm paper's analyses from training logs and checkpoints.")
    parser.add_argument("--out", required=True, help="directory for the CSV and PNG files")
    parser.add_argument("--logs", nargs="+", metavar="PATH",
                        help="fairseq logs of --norm-diagnostics runs (--log-format json or simple), "
                             "or directories searched for *.log")
    parser.add_argument("--checkpoints", nargs="+", metavar="CKPT",
                        help="checkpoints for the embedding spectrum (and --landscape)")
    parser.add_argument("--embedding", default="encoder.embed_tokens.weight", metavar="KEY",
                        help="state-dict entry of the matrix (default: encoder.embed_tokens.weight)")
    parser.add_argument("--ablation", nargs="+", metavar="CSV",
                        help="figure5.csv tables of scripts/batch-ablation.sh")
    landscape_group = parser.add_argument_group("loss landscape (--landscape)")
    landscape_group.add_argument("--landscape", action="store_true",
                                 help="probe the loss landscape of every --checkpoints entry")
    landscape_group.add_argument("--data", help="binarized data of the checkpoints (fairseq-preprocess output)")
    landscape_group.add_argument("--subset", default="valid", help="batches from this subset (default: valid)")
    landscape_group.add_argument("--batches", type=at_least(1), default=4, help="batches (default: 4)")
    landscape_group.add_argument("--max-tokens", type=at_least(1), default=4096,
                                 help="tokens per batch (default: 4096)")
    landscape_group.add_argument("--steps", type=at_least(1), default=8,
                                 help="step sizes lr*k/(steps+1), k=1..steps (default: 8)")
    landscape_group.add_argument("--lr", type=positive,
                                 help="upper end of the step sizes (default: the checkpoint's --lr)")
    landscape_group.add_argument("--seed", type=int, default=1, help="batch order and fresh init (default: 1)")
    args = parser.parse_args(argv)
    if not (args.logs or args.checkpoints or args.ablation):
        parser.error("nothing to analyze: give --logs, --checkpoints or --ablation")
    if args.landscape and not (args.checkpoints and args.data):
        parser.error("--landscape needs --checkpoints and --data")
    if args.data and not Path(args.data, "dict.txt").exists() and not list(Path(args.data).glob("dict.*.txt")):
        parser.error(f"--data {args.data} has no fairseq dictionary (dict.*.txt)")

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.exit(2, f"{parser.prog}: error: --out {out} is a file: name a directory for the CSV and PNG files\n")
    logging.getLogger().setLevel(logging.WARNING)  # fairseq's INFO lines while loading
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    try:
        plt = pyplot()
        results = []  # (analysis, rows, figures) computed before anything is written
        if args.logs:
            rows = statistics(find_logs(args.logs))
            results.append(("statistics", [("statistics.csv", STATISTICS_COLUMNS, rows)], [
                ("statistics.png", plot_statistics(rows, "dist", out, "Batch vs running statistics", plt)),
                ("gradients.png", plot_statistics(rows, "grad", out, "Gradient terms of the batch statistics",
                                                  plt)),
                ("discrepancy.png", plot_statistics(rows, "tid", out, "Training-inference discrepancy (Wang et al., "
                                                    "2022)", plt))]))
        if args.checkpoints:
            rows = spectrum(args.checkpoints, args.embedding)
            results.append(("spectrum", [("spectrum.csv", SPECTRUM_COLUMNS, rows)],
                            [("spectrum.png", plot_spectrum(rows, args.embedding, plt))]))
        if args.ablation:
            rows = batch_size(args.ablation)
            results.append(("batch size", [("batch_size.csv", BATCH_SIZE_COLUMNS, rows)],
                            [("batch_size.png", plot_batch_size(rows, plt))]))
        if args.landscape:
            from .landscape import landscape, plot_landscape

            rows, summary = landscape(args.checkpoints, args.data, args.subset, args.batches, args.max_tokens,
                                      args.steps, args.lr, args.seed)
            results.append(("landscape", [("landscape.csv", LANDSCAPE_COLUMNS, rows),
                                          ("landscape_summary.csv", SUMMARY_COLUMNS, summary)],
                            [("landscape.png", plot_landscape(rows, summary, plt))]))
    except (AnalyzeError, InputFileError) as err:  # (InputFileError: a checkpoint's settings, through fairseq)
        parser.error(str(err))
    out.mkdir(parents=True, exist_ok=True)
    for name, tables, figures in results:
        written = [write_csv(out / f, columns, rows) for f, columns, rows in tables]
        written += [save_figure(fig, out / f, plt) for f, fig in figures if fig is not None]
        print(f"powernorm-analyze: {name}: {', '.join(str(p) for p in written)}", file=sys.stderr)


if __name__ == "__main__":
    main()
