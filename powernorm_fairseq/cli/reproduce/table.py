"""``OUT/table.md``, ``OUT/table.json`` and the figures, from the runs on disk.

Per row: the metric per seed, its mean with a 95% t-interval, the paper's
number, sacreBLEU with its signature; against the first row (the LayerNorm
baseline), the paired difference over the seeds both have, with its
t-interval and a plain verdict. A run that failed or is unfinished is marked
as such and never averaged in."""

import json
import math
from pathlib import Path

from ...common.files import atomic_path, check_regular_file
from ..progress import RECORD, epoch_stats
from .. import stats
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
    for entry in table["rows"][1:]:
        entry[f"minus {base['row']}"] = stats.paired(entry["values"], base["values"])
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


def fmt(x, digits=2):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ci(summary):
    if not summary:
        return "no scored run"
    if summary["n"] < 2:
        return f"{fmt(summary['mean'])} (one seed)"
    return f"{fmt(summary['mean'])} ± {fmt(summary['high'] - summary['mean'])}"


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


def markdown(table):
    rows, base = table["rows"], table["rows"][0]["row"]
    metric = rows[0]["metric"]
    seeds = table["seeds"]
    out = [f"# {table['table']}: {metric}, seeds {', '.join(map(str, seeds))}", "",
           f"Data `{table['data']}`; {table['code']}; fairseq-train flags after `--`: "
           f"`{' '.join(table['fairseq-train flags']) or 'none'}`. {_batch(rows)} Intervals: 95%, Student's t over "
           f"the seeds; the difference is paired by seed, against the first row ({base}).", "",
           f"| row | paper | {' | '.join(f'seed {s}' for s in seeds)} | mean ± 95% CI | sacreBLEU mean ± 95% CI "
           f"| − {base} [95% CI] | verdict |",
           "|---|---|" + "---|" * len(seeds) + "---|---|---|---|"]
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
            against = f"{diff['mean']:+.2f} [{diff['low']:+.2f}, {diff['high']:+.2f}]"
            plain = verdict(diff, base)
        sacre = _ci(entry["sacreBLEU"]) if entry["sacreBLEU"] else ""
        if entry["sacreBLEU signature"]:
            signatures.add(entry["sacreBLEU signature"])
        out.append(f"| {entry['row']} | {fmt(entry['paper'], 1)} | {' | '.join(cells)} | {_ci(entry['mean'])} | "
                   f"{sacre} | {against} | {plain} |")
    if signatures:
        out += ["", *(f"sacreBLEU signature: `{s}`" for s in sorted(signatures))]
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
    """metric.png (each row's mean and interval, its seeds as dots) and valid_loss.png (a line per run)."""
    from ..plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 3, 4))
    for i, entry in enumerate(table["rows"]):
        values = [r[entry["metric"]] for r in entry["runs"].values() if r["state"] == "scored"]
        ax.plot([i] * len(values), values, "o", color="C0", alpha=0.4)
        stats = entry["mean"]
        if stats:
            half = stats["high"] - stats["mean"] if stats["n"] > 1 else 0
            ax.errorbar([i], [stats["mean"]], yerr=[[half], [half]], fmt="s", color="C1", capsize=6)
        if entry["paper"] is not None:
            ax.plot([i], [entry["paper"]], "x", color="k", markersize=9)
    ax.set_xticks(range(len(rows)), [r.name for r in rows], rotation=30, ha="right")
    ax.set(ylabel=table["rows"][0]["metric"], title=f"{args.table}: runs (dots), mean and 95% CI (squares), "
                                                      "paper (x)")
    save_figure(fig, Path(args.out, "metric.png"), plt)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, row in enumerate(rows):
        for j, seed in enumerate(seeds):
            losses = valid_losses(directory(args, row, seed) / "train.log")
            if losses:
                epochs = sorted(losses)
                ax.plot(epochs, [losses[e] for e in epochs], color=f"C{i % 10}", alpha=0.8,
                        label=row.name if j == 0 else None)
    ax.set(xlabel="epoch", ylabel="validation loss (bits)", title=f"{args.table}: validation loss, a line per run")
    if ax.lines:
        ax.legend()
    save_figure(fig, Path(args.out, "valid_loss.png"), plt)
