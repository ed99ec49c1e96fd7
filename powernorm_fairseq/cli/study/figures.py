"""The figures: gradient norms at init, loss curves and the loss landscape."""

import re
from pathlib import Path
from ..layout import Out
from .cell import read_log
from .grid import LOSS, series
from .out import read_probe
from .probe import order


def figures(args, grid, results):
    """init_grads.png, loss.png and (--landscape) landscape.png."""
    from ..plots import pyplot, save_figure

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
        records = read_log(Path(Out(args.out).cell(c["name"]), "train.log"))
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
