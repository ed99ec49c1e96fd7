"""``OUT/table.md``, ``OUT/table.json`` and the figures, from the runs on disk.

Per row: the metric per seed, its mean with a 95% t-interval, the paper's
number (where the table has one), sacreBLEU with its signature; against the
first row (the LayerNorm baseline), the paired difference over the seeds both
have, with its t-interval and a plain verdict, and per seed sacreBLEU's paired
bootstrap of the translations (``significance.py``). A run that failed or is
unfinished is marked as such and never averaged in. Every number is kept
unrounded until it is printed."""

import json
import math
from pathlib import Path

from ...common.files import atomic_path, check_regular_file
from ..progress import RECORD, epoch_stats
from .. import stats
from . import significance
from .runs import SETTINGS, directory, state


def interval(values):
    """{n, mean, low, high} over the values (no interval for fewer than two)."""
    if not values:
        return None
    mean, _, half = stats.interval(values)
    return dict(n=len(values), mean=mean, low=mean - half, high=mean + half)


def collect(args, rows, seeds):
    """The table as table.json holds it."""
    table = {"table": args.table, "seeds": seeds, "data": str(args.data), "code": args.code_version,
             "fairseq-train flags": list(args.fairseq), "rows": []}
    for row in rows:
        runs, values, sacre, signature = {}, {}, {}, None
        facts = args.facts[row.name]
        for seed in seeds:
            kind, what = state(row, directory(args, row, seed))
            kept = _settings(directory(args, row, seed))
            if kind == "scored" and kept.get("tokens per update") != facts["tokens per update"]:
                kind, what = "failed", (f"trained with {kept.get('tokens per update')} tokens per update, not the "
                                        f"table's {facts['tokens per update']}: never averaged in")
            if kind == "scored":
                value, sacre_value, signature = what
                values[seed] = value
                if sacre_value is not None:
                    sacre[seed] = sacre_value
                runs[seed] = {"state": "scored", row.metric: value, "sacreBLEU": sacre_value,
                              "world size": kept.get("world size")}
            else:
                runs[seed] = {"state": kind, "why": what}
        table["rows"].append({"row": row.name, "config": str(row.config.relative_to(row.config.parents[1])),
                              "metric": row.metric, "paper": row.paper, "runs": runs,
                              "tokens per update": facts["tokens per update"],
                              "averaged checkpoints": facts["average"],
                              "mean": interval(list(values.values())),
                              "sacreBLEU": interval(list(sacre.values())), "sacreBLEU signature": signature,
                              "values": values})
    base = table["rows"][0]
    scored_runs = {r.name: {seed: directory(args, r, seed) for seed in entry["values"]}
                   for r, entry in zip(rows, table["rows"])}
    for row, entry in zip(rows[1:], table["rows"][1:]):
        entry[f"minus {base['row']}"] = stats.paired(entry["values"], base["values"])
        entry["paired bootstrap"], signature = significance.paired(row, rows[0], scored_runs[row.name],
                                                                   scored_runs[rows[0].name])
        if signature:
            table["paired bootstrap signature"] = signature
    for entry in table["rows"]:
        del entry["values"]
    return table


def _settings(run):
    """A run's run.json, or {} (a run never started, or its record unreadable)."""
    try:
        check_regular_file(Path(run, SETTINGS), "run record")
        return json.loads(Path(run, SETTINGS).read_text())
    except (OSError, ValueError):
        return {}


def strict(value):
    """``value`` with every NaN as None: table.json is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict(v) for v in value]
    return value


def fmt(x, digits=2, sign=""):
    """``x`` to ``digits`` decimals (``sign`` "+": always signed), never "-0.00"; "" for none or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    text = f"{x:{sign}.{digits}f}"
    return text.replace("-", sign, 1) if float(text) == 0 and text.startswith("-") else text


def _ci(summary):
    if not summary:
        return "no scored run"
    if summary["n"] < 2:
        return f"{fmt(summary['mean'])} (one seed)"
    return f"{fmt(summary['mean'])} ± {fmt(summary['high'] - summary['mean'])}"  # of the unrounded values


def verdict(diff, base):
    if diff is None:
        return "fewer than two paired seeds"
    if not diff["evidence"]:
        return "no evidence of a difference"
    return f"{'higher' if diff['mean'] > 0 else 'lower'} than {base}"


def _batch(rows):
    """The provenance of the runs' batch and averaging: one sentence."""
    tokens = sorted({r["tokens per update"] for r in rows})
    worlds = sorted({run["world size"] for r in rows for run in r["runs"].values() if run.get("world size")})
    averaged = sorted({r["averaged checkpoints"] for r in rows if r["averaged checkpoints"]})
    text = f"Batch per update: {', '.join(f'{t:,}' for t in tokens)} tokens"
    if worlds:
        text += f" (world size {', '.join(map(str, worlds))})"
    if averaged:
        text += f"; the last {', '.join(map(str, averaged))} epoch checkpoints averaged"
    return text + "."


def _bootstrap(tests):
    """The paired bootstrap's per-seed cells: "s1 +0.41 (p 0.08)", its difference and p-value."""
    return "; ".join(f"s{seed} {fmt(t['score'] - t['base'], sign='+')} (p {t['p']:.3f})"
                     for seed, t in sorted(tests.items())) if tests else ""


def markdown(table):
    rows, base = table["rows"], table["rows"][0]["row"]
    metric = rows[0]["metric"]
    seeds = table["seeds"]
    paper = any(entry["paper"] is not None for entry in rows)  # a column only where the table has numbers
    bootstrap = "paired bootstrap signature" in table
    head = ["row", *(["paper"] if paper else []), *(f"seed {s}" for s in seeds), "mean ± 95% CI",
            "sacreBLEU mean ± 95% CI", f"− {base} [95% CI]", "verdict",
            *([f"paired bootstrap − {base}, per seed (p)"] if bootstrap else [])]
    out = [f"# {table['table']}: {metric}, seeds {', '.join(map(str, seeds))}", "",
           f"Data `{table['data']}`; {table['code']}; fairseq-train flags after `--`: "
           f"`{' '.join(table['fairseq-train flags']) or 'none'}`. {_batch(rows)} Intervals: 95%, Student's t over "
           f"the seeds; the difference is paired by seed, against the first row ({base})"
           + ("; the paired bootstrap (sacreBLEU, 1,000 resamples of the test set) compares each seed's "
              "translations with the baseline's of the same seed." if bootstrap else "."), "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes, signatures = [], set()
    for entry in rows:
        cells = []
        for seed in seeds:
            run = entry["runs"][seed]
            if run["state"] == "scored":
                cells.append(fmt(run[metric]))
            else:
                cells.append(run["state"])
                notes.append(f"- {entry['row']}, seed {seed}: {run['why']}")
        diff = entry.get(f"minus {base}")
        if entry["row"] == base:
            against, plain = "(baseline)", ""
        elif diff is None:
            against, plain = "", verdict(None, base)
        else:
            against = f"{fmt(diff['mean'], sign='+')} [{fmt(diff['low'], sign='+')}, {fmt(diff['high'], sign='+')}]"
            plain = verdict(diff, base)
        sacre = _ci(entry["sacreBLEU"]) if entry["sacreBLEU"] else ""
        if entry["sacreBLEU signature"]:
            signatures.add(entry["sacreBLEU signature"])
        line = [entry["row"], *([fmt(entry["paper"], 1)] if paper else []), *cells, _ci(entry["mean"]), sacre,
                against, plain, *([_bootstrap(entry.get("paired bootstrap"))] if bootstrap else [])]
        out.append("| " + " | ".join(line) + " |")
    if signatures:
        out += ["", *(f"sacreBLEU signature: `{s}`" for s in sorted(signatures))]
    if bootstrap:
        out += [f"Paired bootstrap signature: `{table['paired bootstrap signature']}`"]
    if notes:
        out += ["", "Runs without a score (never averaged in):", *notes]
    return "\n".join(out) + "\n"


def write(args, rows, seeds):
    """table.json, table.md and the figures; table.md's path and text."""
    table = collect(args, rows, seeds)
    text = markdown(table)
    with atomic_path(Path(args.out, "table.json")) as tmp:
        Path(tmp).write_text(json.dumps(strict(table), indent=1, allow_nan=False) + "\n")
    with atomic_path(Path(args.out, "table.md")) as tmp:
        Path(tmp).write_text(text)
    figures(args, rows, seeds, table)
    return Path(args.out, "table.md"), text


def valid_losses(log):
    """{epoch: validation loss} from a run's train.log."""
    losses = {}
    if not Path(log).is_file():
        return losses
    for line in Path(log).read_text(errors="replace").splitlines():
        m = RECORD.match(line)
        stats = m and m["logger"] == "valid" and epoch_stats("valid", m["message"])
        if stats and "loss" in stats:
            losses[int(stats["epoch"])] = float(stats["loss"])
    return losses


def figures(args, rows, seeds, table):
    """metric.png (each row's seeds as jittered points, and their mean with its 95% interval beside them)
    and valid_loss.png (a line per run: a colour per row, the same in both, a line style per seed); each
    marker drawn is in the legend, and nothing else is."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    from ..plots import pyplot, save_figure

    plt = pyplot()
    metric = table["rows"][0]["metric"]
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 3, 4))
    papers = False
    for i, entry in enumerate(table["rows"]):
        colour = f"C{i % 10}"
        scored = [(j, r[metric]) for j, r in enumerate(entry["runs"].values()) if r["state"] == "scored"]
        jitter = [-0.24 + 0.2 * j / max(len(seeds) - 1, 1) for j, _ in scored]  # seeds side by side, left
        ax.plot([i + d for d in jitter], [v for _, v in scored], "o", color=colour, markerfacecolor="none")
        summary = entry["mean"]
        if summary:
            half = summary["high"] - summary["mean"] if summary["n"] > 1 else 0
            ax.errorbar([i + 0.15], [summary["mean"]], yerr=[[half], [half]], fmt="s", color=colour, capsize=5)
        if entry["paper"] is not None:
            papers = True
            ax.plot([i + 0.15], [entry["paper"]], "x", color="k", markersize=9)
    names = [r.name for r in rows]
    long = max(map(len, names)) > 8
    ax.set_xticks(range(len(rows)), names, rotation=30 if long else 0, ha="right" if long else "center")
    ax.set_xlim(-0.6, len(rows) - 0.4)
    handles = [Line2D([], [], marker="o", linestyle="", color="0.3", markerfacecolor="none", label="a seed's run"),
               Line2D([], [], marker="s", linestyle="-", color="0.3", label="mean, 95% CI over seeds")]
    if papers:
        handles.append(Line2D([], [], marker="x", linestyle="", color="k", label="the paper's"))
    ax.legend(handles=handles, fontsize=8)
    ax.set(ylabel=metric, title=f"{args.table}: {metric} of each row, seeds {', '.join(map(str, seeds))}")
    fig.tight_layout()
    save_figure(fig, Path(args.out, "metric.png"), plt)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]
    drawn_rows, drawn_seeds = [], []
    for i, row in enumerate(rows):
        for j, seed in enumerate(seeds):
            losses = valid_losses(directory(args, row, seed) / "train.log")
            if losses:
                epochs = sorted(losses)
                ax.plot(epochs, [losses[e] for e in epochs], color=f"C{i % 10}", linestyle=styles[j % len(styles)])
                drawn_rows += [(i, row.name)] if (i, row.name) not in drawn_rows else []
                drawn_seeds += [(j, seed)] if (j, seed) not in drawn_seeds else []
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    ax.set(xlabel="epoch", ylabel="validation loss (bits)",
           title=f"{args.table}: validation loss per epoch (colour: row; line: seed)")
    handles = [Line2D([], [], color=f"C{i % 10}", label=name) for i, name in drawn_rows]
    handles += [Line2D([], [], color="0.3", linestyle=styles[j % len(styles)], label=f"seed {seed}")
                for j, seed in sorted(drawn_seeds)]
    if handles:
        ax.legend(handles=handles, fontsize=8)
    fig.tight_layout()
    save_figure(fig, Path(args.out, "valid_loss.png"), plt)
