"""The figures: gradient norms at init, loss curves and the loss landscape. Each has one legend,
outside the panels, of what is drawn (a colour per norm, a line style per width or per split), and
panels named in words."""

import math
import re
from pathlib import Path

from ..layout import Out
from .cell import read_log
from .grid import LOSS, series
from .out import read_probe
from .probe import order


def figures(args, grid, results):
    """init_grads.png, loss.png and (--landscape) landscape.png."""
    from ..plots import plain_log_ticks, pyplot, save_figure

    from matplotlib.lines import Line2D

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
            probe = read_probe(args, c)
            if probe is None:  # removed, or cut short: the report says so and draws the rest
                continue
            seen.add((series(args, c), c["width"]))
            groups = sorted(probe["grad_norms"], key=order)
            ax.plot(range(len(groups)), [probe["grad_norms"][g] for g in groups], marker="o",
                    color=colors[series(args, c)], linestyle=styles[c["width"]])
            ax.set_xticks(range(len(groups)), [re.sub(r"^(encoder[. ]|head )", "", g) for g in groups],
                          rotation=60, fontsize=7, ha="right")
        ax.set(yscale="log", ylabel="gradient norm at init (per example)", title=f"depth {depth}, init {init}")
        plain_log_ticks(ax)
    widths = list(dict.fromkeys(c["width"] for c, _ in done))
    legend(fig, [(Line2D([], [], color=colors[n], marker="o"), n) for n in labels]
           + ([(Line2D([], [], color="0.3", linestyle=styles[w]), f"width {w}") for w in widths]
              if len(widths) > 1 else []))
    fig.suptitle("gradient norm of each layer's parameters at init")
    fig.tight_layout()
    save_figure(fig, Path(args.out, "init_grads.png"), plt)
    # loss curves: a panel per depth x width x init (rows) and learning rate (columns); train solid, valid dashed
    rows = sorted({(c["depth"], c["width"], c["init"]) for c, _ in done}, key=str)
    lrs = sorted({c["lr"] for c, _ in done}, reverse=True)
    fig, axes = plt.subplots(len(rows), len(lrs), figsize=(4 * len(lrs), 3.2 * len(rows)), squeeze=False)
    key = LOSS[args.task]
    drawn = set()  # which kinds of line and marker the panels hold: the legend names those alone
    for c, r in done:
        if c["seed"] != args.seeds[0]:
            continue
        ax = axes[rows.index((c["depth"], c["width"], c["init"]))][lrs.index(c["lr"])]
        records = read_log(Path(Out(args.out).cell(c["name"]), "train.log"))
        train_points = [(0, r["initial_loss"])] + [(x["num_updates"], x[key]) for x in records["train_inner"]
                                                   if key in x and "num_updates" in x]
        valid_points = [(x["num_updates"], x[key]) for x in records["valid"] if key in x and "num_updates" in x]
        top = 10 * r["initial_loss"] if math.isfinite(r["initial_loss"]) else math.inf  # a diverged run: clipped
        for points, style, what in ((train_points, "-", "training"), (valid_points, "--", "valid")):
            kept = [(x, y) for x, y in points if math.isfinite(y) and y <= top]
            if kept:  # a validation is a point too: one at the end of a short run
                ax.plot(*zip(*kept), linestyle=style, color=colors[series(args, c)],
                        marker="o" if what == "valid" else "", markersize=3)
                drawn.add(what)
            if len(kept) < len(points):  # where it left the panel: a triangle at the top
                ax.plot([next(x for x, y in points if not (math.isfinite(y) and y <= top))], [top], "^",
                        color=colors[series(args, c)])
                drawn.add("diverged")
        ax.set_title(panel(c) + f", lr {c['lr']:g}", fontsize=8)
        ax.set(yscale="log", xlabel="update", ylabel="loss (bits)")
        plain_log_ticks(ax)
    kinds = [(Line2D([], [], color="0.3"), "training"),
             (Line2D([], [], color="0.3", linestyle="--", marker="o", markersize=3), "valid"),
             (Line2D([], [], color="0.3", marker="^", linestyle=""), "diverged: past 10x the initial loss")]
    legend(fig, [(Line2D([], [], color=colors[n]), n) for n in labels]
           + [(h, label) for h, label in kinds if label.split(":")[0] in drawn])
    fig.suptitle(f"loss per update (training from the initial loss), seed {args.seeds[0]}")
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
                                            color=colors[norm])
                        axes[i][j].set(xscale="log", yscale="log", xlabel="learning rate", ylabel=name,
                                       title=f"{name}, {panel(dict(depth=row[0], width=row[1], init=row[2]))}")
                        plain_log_ticks(axes[i][j])
            legend(fig, [(Line2D([], [], color=colors[n], marker="o"), n) for n in labels])
            fig.suptitle("loss landscape at the final checkpoint: max over a in (0, lr) of |L(W) - L(W - a g)| "
                         "and ||g(W) - g(W - a g)||", fontsize=9)
            fig.tight_layout()
            save_figure(fig, Path(args.out, "landscape.png"), plt)


def panel(cell):
    """A panel's name in words: "depth 5, width narrow, xavier-kaiming"."""
    return f"depth {cell['depth']}, width {cell['width']}, {cell['init']}"


def legend(fig, entries):
    """The figure's one legend, right of its panels: (handle, label) of each thing drawn."""
    fig.legend([h for h, _ in entries], [label for _, label in entries], loc="center left",
               bbox_to_anchor=(1.0, 0.5), fontsize=8)
