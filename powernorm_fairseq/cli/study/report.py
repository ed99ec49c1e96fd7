"""study.md and study.json: the convergence tables and the seeds' paired differences."""

import json
import math
import shlex
from collections import defaultdict
from pathlib import Path

from ...common.files import atomic_path
from .grid import METRIC, column, column_of, columns, dims, series, switches_of
from .out import read_probe
from ..stats import mean_sd, paired


def fmt(value, spec="{:.3f}"):
    return spec.format(value) if isinstance(value, (int, float)) and math.isfinite(value) else "—"


def strict(value):
    """``value`` with every non-finite float replaced by None, for strict JSON parsers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


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
                f"`{shlex.join(args.fairseq)}`." if args.fairseq else ""), "",
             f"A cell reads *converged k/n* over the seeds, then the mean final training loss (bits) and "
             f"{metric_label} of the seeds that finished. Converged: finite, and below {args.converged_fraction:g} x "
             f"the initial loss and below {args.majority_loss:.3f} bits, the best constant prediction "
             "(docs/study.md).", ""]
    tables = []
    for (placement, qk, depth, w, init), members in groups.items():
        d, ffn, heads = dims(w)
        norms = [column(n, s) for n, s in columns(args, placement)]
        where = (f"{placement}, " if args.placement_axis else "") + (f"qk-norm {qk}, " if qk != "none" else "")
        lines += [f"## {where}depth {depth}, width {w} ({d}/{ffn}, {heads} heads), init {init}", "",
                  "| lr | " + " | ".join(norms) + " |", "|---" * (len(norms) + 1) + "|"]
        table = dict(placement=placement, qk=qk, depth=depth, width=w, init=init, rows=[])
        for lr in sorted(args.lrs, reverse=True):
            row = [f"{lr:g}"]
            entry = dict(lr=lr, norms={})
            for norm in norms:
                runs = [results.get(c["name"]) for c in members
                        if c["lr"] == lr and column_of(c) == norm]
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
    unprobed = [c["name"] for c in grid if c["name"] in results and read_probe(args, c) is None]
    if unprobed:
        lines += [f"Gradient norms at init are missing for {len(unprobed)} finished cell(s), whose init.json was "
                  f"removed or is unreadable (left out of init_grads.png): {', '.join(unprobed)}.", ""]
    figures = [f for f in ("init_grads.png", "loss.png", "landscape.png") if Path(args.out, f).exists()]
    if figures:
        lines += ["## figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
    study = dict(task=args.task, data=args.data_as_given, majority_loss=args.majority_loss,
                 converged_fraction=args.converged_fraction, tables=tables, seeds=seeds,
                 cells=[results.get(c["name"], dict(c, status="pending")) for c in grid])
    with atomic_path(Path(args.out, "study.json")) as tmp:  # strict JSON: a NaN or inf (diverged) as null
        Path(tmp).write_text(json.dumps(strict(study), indent=1, allow_nan=False))
    with atomic_path(Path(args.out, "study.md")) as tmp:
        Path(tmp).write_text("\n".join(lines))


def seed_report(args, grid, results, lines, metric_label, metric_fmt):
    """Mean ± sd over seeds per norm, each norm's paired difference to the
    first norm, and with ``--placements`` each placement's to the first
    placement with the same norm (rezero, whose only norm is none, to the
    first placement's first norm)."""
    if len(args.seeds) < 2:
        return []
    base, first = column(args.norms[0], switches_of(args)[0]), args.placements[0]
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
                values[c["placement"], c["qk"], column_of(c)][c["seed"]] = r["metric"]
        for placement, qk, norm in dict.fromkeys((c["placement"], c["qk"], column_of(c))
                                                 for c in grid):
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
