"""What every section of the benchmark shares: the checkout, the targets, the timers, the machine's
record and the plots' helpers."""

import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

if "cuda" not in sys.argv:  # --sections launches runs the Triton kernels under Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from powernorm_fairseq.norms import NORM_TYPES, kernels  # noqa: E402

BIN = Path(sys.executable).parent
#: layer time / F.layer_norm's, forward + backward: on the CPU by dtype, on a GPU for every dtype;
#: words/s and memory of a training run / stock's
TARGETS = {"layers": {"float32": {"pn": 1.0, "bn": 1.2, "pn-v": 1.2, "scalenorm": 1.0, "rmsnorm": 1.0},
                      "bfloat16": dict.fromkeys(("pn", "bn", "pn-v", "scalenorm", "rmsnorm"), 1.5),
                      "cuda": {"pn": 1.3, "bn": 1.5, "pn-v": 1.5, "scalenorm": 1.0, "rmsnorm": 1.0, "dyt": 1.1,
                               "derf": 1.1}},
           "throughput": 0.95, "memory": 1.05,
           #: a kind's layer time over a neighbour's in the same run, on the CPU in float32
           "beside": {"derf": ("dyt", 1.2)}}


def layer_target(device: str, dtype: torch.dtype, kind: str):
    """The most a ``kind`` layer may take against ``F.layer_norm``, or None."""
    return TARGETS["layers"]["cuda" if device == "cuda" else str(dtype).replace("torch.", "")].get(kind)


def sig(x, digits=4):
    """``x`` to ``digits`` significant digits: tiny sizes on a loaded machine
    give small numbers that a fixed number of decimals would round to 0."""
    return float(f"{x:.{digits}g}")


GPU_CALLS = 10  # calls per GPU sample: one call of a small layer is mostly launch latency


def timed(f, device="cpu"):
    if device == "cuda":  # CUDA events around GPU_CALLS calls, per call
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(GPU_CALLS):
            f()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / GPU_CALLS
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def timed_fresh(f, x, device="cpu"):
    """Time ``f`` from a fresh x.grad each call (no accumulation pass)."""
    def fresh():
        x.grad = None
        f()
    return timed(fresh, device)


def measure_bandwidth(device="cpu", n=None):
    """Bytes per second of a copy of ``n`` bytes (read + write; default a
    large one, out of the caches), the best of 10."""
    if n is None:
        n = 64 * 2**20 * (4 if device == "cuda" else 1)
    src, dst = torch.empty(n // 4, device=device), torch.empty(n // 4, device=device)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src), device) for _ in range(10))
    return 2 * n / best


def gpu_machine():
    import triton

    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, python=platform.python_version(), date=time.strftime("%Y-%m-%d"),
                backend=kernels.describe(torch.empty(1, device="cuda")))


def ran_on(results, sections, machine):
    """Record the machine that measured each of ``sections``: a run of some
    sections keeps the others' rows, which another machine may have measured."""
    results.setdefault("machines", {}).update(dict.fromkeys(sections, machine))


def _machine_line(results, section):
    m = results.get("machines", {}).get(section)
    if m is None:
        return "Machine: not recorded."
    if "device" in m:
        return (f"Device: {m['device']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
                f"norms on the {m['backend']} backend, {m['date']}.")
    return (f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), torch {m['torch']}, "
            f"fused kernels {'on' if m['fused_kernels'] else 'OFF'}, {m['date']}.")


def _pyplot():
    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _layer_targets(ax, left, right, targets=TARGETS["layers"]["float32"]):
    """Each norm's target as red dashes over its bars, and LayerNorm's 1.0."""
    for j, k in enumerate(NORM_TYPES):
        if k in targets:
            ax.hlines(targets[k], j - left, j + right, colors="red", linestyles="dashed")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("norm type (red dashes: target)")


def _speed_and_memory(plt, labels, rows, memory_key, speed_title, memory_title, memory_name, xlabel, path,
                      rotation=0):
    """Words/s and peak memory of each run over the stock LN transformer's, side by side."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(labels, [r["wps_ratio"] for r in rows], color="tab:blue")
    axes[0].axhline(TARGETS["throughput"], color="red", linestyle="dashed", label="target for pn")
    axes[0].set_ylabel("words/s / stock LN transformer (ratio)")
    axes[0].set_title(speed_title)
    axes[1].bar(labels, [r[memory_key] for r in rows], color="tab:orange")
    axes[1].axhline(TARGETS["memory"], color="red", linestyle="dashed", label="target for pn")
    axes[1].set_ylabel(f"{memory_name} / stock LN transformer (ratio)")
    axes[1].set_title(memory_title)
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.legend(loc="lower right")
        ax.tick_params(axis="x", rotation=rotation)
    _save(plt, fig, path)


def merge_rows(old, new, key):
    """``old`` rows with those of ``new`` replacing the ones with the same key, in order."""
    fresh = {tuple(r[k] for k in key) for r in new}
    return [r for r in old if tuple(r[k] for k in key) not in fresh] + new


def machine():
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                python=platform.python_version(), fused_kernels=kernels.cpu.available(),
                date=time.strftime("%Y-%m-%d"))


def _met(value, target) -> str:
    """A table's target cell: empty without a target, else whether ``value`` meets it."""
    return "" if target is None else f"<= {target} " + ("met" if value <= target else "**missed**")


def _layer_rows(layers, digits, copy):
    """The layer table: time / LN and its target per dtype, shape and norm;
    ``copy``: with the copy bandwidth of a tensor of the layer's own size."""
    head = "| dtype | shape (T x B x C) | norm | time / LN | ms | LN ms | GB/s |" + (
        " copy GB/s | of copy | target |" if copy else " of copy bandwidth | target |")
    rows = [head, "|---" * head.count(" | ") + "|---|"]
    for r in layers:
        cells = [r["dtype"], r["shape"], r["norm"], f"{r['ratio_to_ln']:.2f}", f"{r['ms']:.{digits}f}",
                 f"{r['ln_ms']:.{digits}f}", r.get("gbps", r.get("gb_per_s"))]
        cells += [r.get("copy_gb_s", "")] if copy else []
        target = _met(r["ratio_to_ln"], r["target"])
        if r.get("beside"):  # (the neighbour, this time over its, the most it may be)
            other, ratio, most = r["beside"]
            target = f"{ratio:.2f} x {other}: " + _met(ratio, most)
        cells += [_percent(r["fraction_of_bandwidth"]), target]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return rows


def _percent(fraction) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def norm_list(parser, flag, text):
    """The norm types a comma-separated flag names, refused in one line if one is unknown."""
    norms = text.split(",")
    bad = set(norms) - set(NORM_TYPES)
    if bad:
        parser.error(f"{flag}: unknown {', '.join(sorted(bad))}; allowed: {', '.join(NORM_TYPES)}")
    return norms
