"""The benchmark suite: norm layers, training throughput, translation quality
and memory, each norm side by side with LayerNorm in one run.

    python bench/run.py [--sections layers,throughput,quality] [--out bench/results]

Writes OUT/results.json, OUT/results.md and one PNG per section. Timings on a
shared machine are noisy, so every comparison is a ratio of runs interleaved
with their LayerNorm baseline, and the median is reported.
"""

import argparse
import ctypes
import json
import logging
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if "cuda" not in sys.argv:  # --sections launches runs the Triton kernels under Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from powernorm_fairseq.norms import NORM_TYPES, build_norm, kernels  # noqa: E402

BIN = Path(sys.executable).parent
#: layer time / F.layer_norm's, forward + backward: on the CPU by dtype, on a GPU for every dtype;
#: words/s and memory of a training run / stock's
TARGETS = {"layers": {"float32": {"pn": 1.0, "bn": 1.2, "pn-v": 1.2, "scalenorm": 1.0, "rmsnorm": 1.0},
                      "bfloat16": dict.fromkeys(("pn", "bn", "pn-v", "scalenorm", "rmsnorm"), 1.5),
                      "cuda": {"pn": 1.3, "bn": 1.5, "pn-v": 1.5, "scalenorm": 1.0, "rmsnorm": 1.0, "dyt": 1.1}},
           "throughput": 0.95, "memory": 1.05}


def layer_target(device: str, dtype: torch.dtype, kind: str):
    """The most a ``kind`` layer may take against ``F.layer_norm``, or None."""
    return TARGETS["layers"]["cuda" if device == "cuda" else str(dtype).replace("torch.", "")].get(kind)


# ---------------------------------------------------------------- 1. layers
def layer_options(kind, C):
    # as the model builds them: PN with the authors' group scaling over 4 heads
    return dict(layer_scale=True, groups=4) if kind == "pn" else {}


def steady_allocator() -> bool:
    """Fix glibc's thresholds for returning memory to the system. By default
    they move with what was freed before (its dynamic mmap threshold), so an
    output tensor is either reused from the heap or mapped anew, with a page
    fault per 4 KiB on first touch, depending on the layer timed before it:
    a layer's time then swung by 2x from run to run. With both thresholds at
    1 GiB every layer, F.layer_norm's included, allocates from the heap.
    Returns whether the allocator took the setting (glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30))


#: torch's own layers timed beside the norms (rows without a target)
TORCH_REFERENCES = ("torch BatchNorm1d", "torch F.rms_norm")


def bench_layers(shapes, reps, dtypes, device="cpu"):
    """Forward+backward time of every norm over F.layer_norm, interleaved."""
    rows = []
    if device == "cpu":
        steady_allocator()
    bandwidth = measure_bandwidth(device)
    for dtype in dtypes:
        for T, B, C in shapes:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(T, B, C, generator=g).to(device, dtype).requires_grad_(True)
            grad = torch.randn(T, B, C, generator=g).to(device, dtype)
            lengths = T - (torch.rand(B, generator=g) * 0.4 * T).long()  # 20% padding on average
            pad = (torch.arange(T)[None, :] >= lengths[:, None]).to(device)
            w = torch.ones(C, dtype=dtype, device=device, requires_grad=True)
            b = torch.zeros(C, dtype=dtype, device=device, requires_grad=True)

            def ln():
                F.layer_norm(x, (C,), w, b).backward(grad)

            norms = {k: build_norm(k, C, **layer_options(k, C)).to(device, dtype).train() for k in NORM_TYPES}
            calls = {k: (lambda m=m: m(x, pad).backward(grad)) for k, m in norms.items()}
            # torch's own, beside the kinds they resemble: BatchNorm1d over the same (T * B, C) rows (padding
            # included: it takes no mask), and F.rms_norm (the route for RMSNorm on a GPU, where faster)
            batchnorm = torch.nn.BatchNorm1d(C).to(device, dtype).train()
            calls[TORCH_REFERENCES[0]] = lambda: batchnorm(x.view(T * B, C)).backward(grad.view(T * B, C))
            calls[TORCH_REFERENCES[1]] = lambda: F.rms_norm(x, (C,), w, 1e-5).backward(grad)
            for f in [ln, *calls.values()] * 3:  # warm-up
                f()
            ratios = {k: [] for k in calls}
            ln_times = []
            order = random.Random(0)
            for _ in range(reps):
                for k, f in calls.items():
                    # back to back, in random order, each from a fresh x.grad (no accumulation pass)
                    first_ln = order.random() < 0.5
                    t_a = timed_fresh(ln if first_ln else f, x, device)
                    t_b = timed_fresh(f if first_ln else ln, x, device)
                    t_ln, t_k = (t_a, t_b) if first_ln else (t_b, t_a)
                    ratios[k].append(t_k / t_ln)
                    ln_times.append(t_ln)
            t_ln = statistics.median(ln_times)
            bytes_moved = 5 * x.numel() * x.element_size()  # read x, write y; read x, dy, write dx
            # the copy baseline at the layer's own size: a layer whose tensors stay in the caches
            # is not held to the bandwidth of memory (a large copy's), which it would exceed
            same_size = measure_bandwidth(device, x.numel() * x.element_size())
            for k in calls:
                ratio = statistics.median(ratios[k])
                seconds = ratio * t_ln
                rows.append(dict(
                    dtype=str(dtype).replace("torch.", ""), shape=f"{T}x{B}x{C}", norm=k,
                    ratio_to_ln=sig(ratio), ms=sig(seconds * 1e3), ln_ms=sig(t_ln * 1e3),
                    gbps=None if k == "none" else sig(bytes_moved / seconds / 1e9),
                    copy_gb_s=sig(same_size / 1e9),
                    # "none" (the identity) moves nothing: the byte model is not its
                    fraction_of_bandwidth=None if k == "none" else sig(bytes_moved / seconds / same_size),
                    target=layer_target(device, dtype, k),
                ))
    return rows, bandwidth


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


# ---------------------------------------------------------------- 6. host
#: the fused kinds and what each may cost the host against nn.LayerNorm's step (calls, time)
HOST_KINDS = ["pn", "bn", "pn-v", "scalenorm", "rmsnorm", "dyt"]
HOST_TARGETS = {"calls": 2.0, "time": {"pn": 1.3, "scalenorm": 1.3, "rmsnorm": 1.3, "dyt": 1.3, "bn": 1.5,
                                       "pn-v": 1.5}}


#: the CPU gate under the stand-in driver: a step / nn.LayerNorm's step, and Python calls / LayerNorm's
STANDIN_TARGETS = {"step": {"pn": 1.5, "bn": 1.7, "pn-v": 1.7, "scalenorm": 1.2, "rmsnorm": 1.2, "dyt": 1.2},
                   "calls": 1.3}


def bench_host_standin(rounds=3, reps=50):
    """Each fused kind's training step on Triton's real CUDA launch path with
    a stand-in driver (measure/standin.py), beside nn.LayerNorm's step, at
    4 x 4 x 64 and 8 x 8 x 64, the least of ``rounds``: in a fresh process,
    which does not interpret the kernels."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "powernorm_fairseq.measure.standin", "--rounds", str(rounds),
                           "--reps", str(reps), "--kinds", *HOST_KINDS], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"bench: the stand-in driver's run failed: {proc.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(proc.stdout)
    for r in rows:
        r.update(step_target=STANDIN_TARGETS["step"][r["kind"]], calls_target=STANDIN_TARGETS["calls"])
    return rows


def bench_host(rounds=7, reps=50):
    """A training step's host cost (measure/host.py): the Triton path with
    every launch replaced by nothing, and the CPU backend as it runs, each
    beside nn.LayerNorm's step in the same harness, at 4 x 4 x 64."""
    from powernorm_fairseq.measure import host

    rows = []
    for backend in ("triton", "cpu"):
        measured = host.measure(HOST_KINDS, backend, rounds, reps)
        ln_calls = measured["nn.LayerNorm"][0]
        for kind in HOST_KINDS:
            calls, time_ratio = measured[kind]
            rows.append(dict(backend=backend, norm=kind, calls=calls, ln_calls=ln_calls,
                             calls_ratio=round(calls / ln_calls, 2), time_ratio=round(time_ratio, 2),
                             calls_target=HOST_TARGETS["calls"], time_target=HOST_TARGETS["time"][kind]))
    return rows


# ---------------------------------------------------------------- 5. launches
#: (label, norm, options) of the launches section: each norm in each of its modes
LAUNCH_ROWS = [
    ("ln (F.layer_norm)", "ln", {}),
    ("pn (Algorithm 2)", "pn", {"layer_scale": True, "groups": 4}),
    ("pn in warmup", "pn", {"layer_scale": True, "groups": 4, "warmup_updates": 10}),
    ("pn reference backward", "pn", {"layer_scale": True, "groups": 4, "backward": "reference"}),
    ("pn-v", "pn-v", {}),
    ("bn", "bn", {}),
    ("bn --layer-scale", "bn", {"layer_scale": True, "groups": 4}),
    ("scalenorm", "scalenorm", {}),
    ("rmsnorm", "rmsnorm", {}),
    ("dyt", "dyt", {}),
]
LAUNCH_TARGETS = {"pn (Algorithm 2)": 4, "pn in warmup": 6, "pn-v": 6, "bn": 6, "bn --layer-scale": 6,
                  "scalenorm": 2, "rmsnorm": 3, "dyt": 3}


def bench_launches(T=512, B=8, C=512):
    """Per norm and mode, one training step of one layer (forward + backward,
    20% padding, float16 on the Triton path): launches and host waits as a GPU
    would receive them (measure/launches.py), the activation tensors the
    kernels move against LayerNorm's five, and registers and spills of the
    sm_90 build of what was launched (measure/sm90.py). Runs on a CPU."""
    from powernorm_fairseq.measure import launches, sm90
    from powernorm_fairseq.measure.standin import MULTIPROCESSORS
    from powernorm_fairseq.norms.kernels import gpu

    g = torch.Generator().manual_seed(0)
    pad = torch.arange(T)[None, :] >= (T - (torch.rand(B, generator=g) * 0.4 * T).long())[:, None]
    rows, variants = [], {}
    for label, kind, options in LAUNCH_ROWS:
        counts = {}
        for backend, dtype in (("triton", torch.float16), ("cpu", torch.float32)):
            if not getattr(kernels, "gpu" if backend == "triton" else "cpu").available():
                continue
            norm = build_norm(kind, C, **options).to(dtype).train()
            x = torch.randn(T, B, C, generator=g).to(dtype).requires_grad_(True)
            grad = torch.randn(T, B, C, generator=g).to(dtype)

            def step():
                x.grad = None
                norm.zero_grad(set_to_none=True)
                norm(x, pad).backward(grad)

            # the Triton kernels are noted, not run: the interpreter would take minutes at this size,
            # and the host never reads what they write; their grids are planned for an H100's multiprocessors
            gpu.stand_in(MULTIPROCESSORS if backend == "triton" else None)
            try:
                with kernels.use(backend), sm90.recording(run=backend != "triton") as launched:
                    step()  # the first step may read PN's step counter after a load; the ones after never wait
                    launched.clear()
                    with launches.counting() as seen:
                        step()
            finally:
                gpu.stand_in(None)
            counts[backend] = (seen, launched)
        seen, launched = counts.get("triton", (None, []))
        variants[label] = launched
        row = dict(norm=label, launches=len(seen.launches) if seen else None,
                   kernels=len(seen.kernels()) if seen else None, host_waits=len(seen.waits) if seen else None,
                   cpu_host_waits=len(counts["cpu"][0].waits) if "cpu" in counts else None,
                   activation_tensors=sum(map(sm90.activation_tensors, launched)) if launched else 5,
                   target=LAUNCH_TARGETS.get(label))
        rows.append(row)
    if gpu.available():
        labels = [label for label, vs in variants.items() for _ in vs]
        built = sm90.build_in_fresh_process([v for vs in variants.values() for v in vs])
        for row in rows:
            mine = [b for label, b in zip(labels, built) if label == row["norm"]]
            if mine:
                row["max_registers"] = max(b["registers"] for b in mine)
                row["spill_bytes"] = max(b["spill_bytes"] for b in mine)
                main = [b for b in mine if "resident_per_sm" in b]
                row["programs_per_sm"] = "/".join(map(str, sorted({b["launched_per_sm"] for b in main})))
                row["all_resident"] = all(b["resident_per_sm"] >= b["launched_per_sm"] for b in main)
                row["resident_warps"] = min(b["resident_warps"] for b in mine)
    for row in rows:  # the grid of each launch, in order
        row["programs"] = "/".join(str(v["programs"]) for v in variants.get(row["norm"], []))
    if gpu.available():  # the busiest program against the mean, of each launch of a step at 128 x 128 x 1024
        for row, (_, kind, options) in zip(rows, LAUNCH_ROWS):
            ratios = list(map(sm90.balance, planned_step(kind, options, (128, 128, 1024))))
            row["busiest_to_mean"] = round(max(ratios), 2) if ratios else None
    return rows


def planned_step(kind, options, shape):
    """The Triton launches of one float16 training step at ``shape`` (20% padding), planned for an H100 and
    noted, not run (measure/sm90.py)."""
    from powernorm_fairseq.measure import sm90
    from powernorm_fairseq.measure.standin import MULTIPROCESSORS
    from powernorm_fairseq.norms.kernels import gpu

    T, B, C = shape
    pad = torch.arange(T)[None, :] >= (T - (torch.rand(B, generator=torch.Generator().manual_seed(0)) * 0.4 * T)
                                       .long())[:, None]
    norm = build_norm(kind, C, **options).half().train()
    x = torch.empty(T, B, C, dtype=torch.float16).requires_grad_(True)
    gpu.stand_in(MULTIPROCESSORS)
    try:
        with kernels.use("triton"), sm90.recording(run=False) as launched:
            norm(x, pad).backward(torch.empty_like(x))
            launched.clear()
            norm(x, pad).backward(torch.empty_like(x))
    finally:
        gpu.stand_in(None)
    return launched


def bench_device(shapes, dtypes, replays=50):
    """On a GPU, per fused kind and LayerNorm: the host time of an eager
    training step of one layer (issued, not waited for), and the device time
    of the same step replayed in a CUDA graph, with the GB/s it moves (5 x the
    tensor, as the layer rows count) and its share of copy bandwidth at the
    layer's size."""
    rows = []
    for dtype in dtypes:
        for T, B, C in shapes:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(T, B, C, generator=g).to("cuda", dtype).requires_grad_(True)
            grad = torch.randn(T, B, C, generator=g).to("cuda", dtype)
            pad = (torch.arange(T)[None, :] >= (T - (torch.rand(B, generator=g) * 0.4 * T).long())[:, None]).cuda()
            copy = measure_bandwidth("cuda", x.numel() * x.element_size())
            for kind in ["ln", "pn", "pn-v", "bn", "scalenorm", "rmsnorm", "dyt"]:
                norm = build_norm(kind, C, **layer_options(kind, C)).to("cuda", dtype).train()
                params = [x, *norm.parameters()]

                def step():
                    return torch.autograd.grad(norm(x, pad), params, grad)

                for _ in range(3):  # compiles, and the C++ node holds each variant
                    step()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(replays):
                    step()
                host_us = (time.perf_counter() - start) / replays * 1e6
                torch.cuda.synchronize()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    step()  # a warm-up on the side stream, as capture asks
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                seconds = begin.elapsed_time(end) / 1e3 / replays
                moved = 5 * x.numel() * x.element_size()
                rows.append(dict(dtype=str(dtype).replace("torch.", ""), shape=f"{T}x{B}x{C}", norm=kind,
                                 host_us=sig(host_us), device_ms=sig(seconds * 1e3), gbps=sig(moved / seconds / 1e9),
                                 of_copy=sig(moved / seconds / copy)))
    return rows


def device_markdown(rows) -> list:
    out = ["### Device-only: a training step of one layer replayed in a CUDA graph", "",
           "Forward + backward (torch.autograd.grad), 20% padding; device ms: CUDA events over 50 replays of "
           "the captured step; GB/s: 5 x the tensor's bytes over that time; of copy bandwidth: against a copy "
           "of the layer's size. The target: >= 50% of copy bandwidth for every fused kind at 128x128x1024.", "",
           "| dtype | shape | norm | device ms | GB/s | of copy bandwidth |", "|---|---|---|---|---|---|"]
    for r in rows:
        share = _percent(r["of_copy"])
        if r["shape"] == "128x128x1024" and r["norm"] != "ln":
            share += " (met)" if r["of_copy"] >= 0.5 else " **(missed)**"
        out.append(f"| {r['dtype']} | {r['shape']} | {r['norm']} | {r['device_ms']} | {r['gbps']} | {share} |")
    out += ["", "Host us per eager step (issued, not waited for), the same steps:", "",
            "| dtype | shape | norm | host us |", "|---|---|---|---|"]
    out += [f"| {r['dtype']} | {r['shape']} | {r['norm']} | {r['host_us']} |" for r in rows]
    return out + [""]


# ------------------------------------------------------ 2./4. throughput, memory
def model_flags(dims):
    layers, d, ffn, heads = dims
    return ["--encoder-layers", layers, "--decoder-layers", layers, "--encoder-embed-dim", d,
            "--decoder-embed-dim", d, "--encoder-ffn-embed-dim", ffn, "--decoder-ffn-embed-dim", ffn,
            "--encoder-attention-heads", heads, "--decoder-attention-heads", heads]


def train_command(data, save_dir, variant, dims, seed, extra):
    if variant == "stock-ln":
        arch = ["--arch", "transformer_iwslt_de_en", "--encoder-normalize-before", "--decoder-normalize-before"]
    else:
        arch = ["--user-dir", str(ROOT / "powernorm_fairseq"), "--arch", "powernorm_transformer_iwslt_de_en",
                "--norm-type", variant]
    return [str(BIN / "fairseq-train"), str(data), *arch, *map(str, model_flags(dims)),
            "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.002",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "300", "--dropout", "0.2",
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "2048",
            "--seed", str(seed), "--save-dir", str(save_dir), "--log-format", "json", "--log-interval", "10",
            "--num-workers", "0", "--cpu", *map(str, extra)]


def run_training(cmd, cuda=False):
    """Run fairseq-train in a child process; return its log and its peak memory (MiB):
    resident memory on the CPU, torch.cuda.max_memory_allocated on a GPU."""
    peak_kib = ("torch.cuda.max_memory_allocated() // 1024" if cuda
                else "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss")
    code = ("import resource, sys\n"
            "import torch\n"
            "from fairseq_cli.train import cli_main\n"
            # the plugin's clean exit also for stock runs (see powernorm_fairseq/patches/shutdown.py)
            "from powernorm_fairseq.patches.shutdown import install\n"
            "install()\n"
            f"sys.argv = {cmd!r}\n"
            "try:\n    cli_main()\n"
            f"finally:\n    print('PEAK_KIB', {peak_kib}, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-train failed:\n{proc.stderr[-3000:]}")
    peak = int(re.search(r"PEAK_KIB (\d+)", proc.stdout).group(1)) / 1024
    return proc.stdout + proc.stderr, peak


def words_per_second(log, skip=1):
    """Median words/s of the logged intervals after the first (start-up), or the epoch's."""
    rows = [json.loads(m) for m in re.findall(r"\| train_inner \| (\{.*\})", log)]
    rows = rows[skip:] or [json.loads(m) for m in re.findall(r"\| train \| (\{.*\})", log)]
    return statistics.median(float(r.get("wps", r.get("train_wps"))) for r in rows)


#: what a throughput run of PN measures: its Algorithm-2 phase, which is most of a
#: training run. Runs this short would otherwise fall wholly in its warmup
#: (``--pn-warmup-updates``, by default ``--warmup-updates``), where PN's forward
#: uses the batch's statistics as pn-v's does: the pn-v row is that phase's cost.
PN_STEADY = ("--pn-warmup-updates", "0")


def throughput_flags(variant):
    """fairseq-train flags of one throughput run beyond its model's."""
    return PN_STEADY if variant == "pn" else ()


def _run_name(name, row):
    """A throughput row's name, with the flags its run added (older rows record none)."""
    return f"{name} (`{row['flags']}`)" if row.get("flags") else name


def bench_throughput(data, work, variants, dims, updates, rounds):
    """Words/s and peak memory of fairseq-train per norm, interleaved with stock LN."""
    results = {v: {"wps": [], "peak_mib": []} for v in variants}
    for r in range(rounds):
        order = variants[:]
        random.Random(r).shuffle(order)
        for v in order:
            cmd = train_command(data, work / f"tp-{v}-{r}", v, dims, 1,
                                ["--max-update", updates, "--no-save", "--disable-validation",
                                 *throughput_flags(v)])
            log, peak = run_training(cmd)
            results[v]["wps"].append(words_per_second(log))
            results[v]["peak_mib"].append(peak)
    base_wps = statistics.median(results["stock-ln"]["wps"])
    base_mem = statistics.median(results["stock-ln"]["peak_mib"])
    return [dict(variant=v, flags=" ".join(throughput_flags(v)),
                 wps=round(statistics.median(r["wps"]), 1),
                 wps_ratio=round(statistics.median(r["wps"]) / base_wps, 3),
                 peak_mib=round(statistics.median(r["peak_mib"]), 1),
                 memory_ratio=round(statistics.median(r["peak_mib"]) / base_mem, 3))
            for v, r in results.items()]


def gpu_train_command(data, save_dir, variant, max_tokens, updates):
    """The paper's IWSLT14 model at full size, --fp16, on one GPU."""
    if variant == "stock-ln":
        arch = ["--arch", "transformer_iwslt_de_en", "--encoder-normalize-before", "--decoder-normalize-before"]
    else:
        arch = ["--user-dir", str(ROOT / "powernorm_fairseq"), "--arch", "powernorm_transformer_iwslt_de_en",
                "--norm-type", variant]
    return [str(BIN / "fairseq-train"), str(data), *arch, "--share-all-embeddings", "--fp16",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.0015",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "8000", "--dropout", "0.3",
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", str(max_tokens), "--max-update", str(updates), "--seed", "1",
            "--save-dir", str(save_dir), "--no-save", "--disable-validation", "--log-format", "json",
            "--log-interval", "10", "--num-workers", "0", *throughput_flags(variant)]


def bench_train_gpu(data, work, variants, token_sizes, updates, rounds):
    """fairseq-train --fp16 words/s (median over the second half of the logged
    intervals) and peak GPU memory of each variant over stock LN, runs
    interleaved in shuffled order, each round repeating every pair."""
    rows = []
    for max_tokens in token_sizes:
        runs = {v: {"wps": [], "peak_mib": []} for v in variants}
        for r in range(rounds):
            order = variants[:]
            random.Random(r).shuffle(order)
            for v in order:
                cmd = gpu_train_command(data, work / f"gpu-{v}-{max_tokens}-{r}", v, max_tokens, updates)
                log, peak = run_training(cmd, cuda=True)
                intervals = [json.loads(m) for m in re.findall(r"\| train_inner \| (\{.*\})", log)]
                if len(intervals) < 2:
                    raise RuntimeError(f"{v} at {max_tokens} tokens logged {len(intervals)} intervals")
                second_half = intervals[len(intervals) // 2:]
                runs[v]["wps"].append(statistics.median(float(i["wps"]) for i in second_half))
                runs[v]["peak_mib"].append(peak)
        base = {key: statistics.median(runs["stock-ln"][key]) for key in ("wps", "peak_mib")}
        for v in variants:
            if v == "stock-ln":
                continue
            wps, mem = statistics.median(runs[v]["wps"]), statistics.median(runs[v]["peak_mib"])
            rows.append(dict(norm=v, flags=" ".join(throughput_flags(v)), max_tokens=max_tokens,
                             precision="fp16", updates=updates, rounds=rounds,
                             wps=sig(wps), stock_wps=sig(base["wps"]), wps_ratio=sig(wps / base["wps"]),
                             peak_mib=sig(mem), stock_peak_mib=sig(base["peak_mib"]),
                             mem_ratio=sig(mem / base["peak_mib"])))
    return rows


# ---------------------------------------------------------------- 3. quality
def bench_quality(corpus, work, norms, seeds, minutes, dims, extra=()):
    """BLEU of each encoder norm after a fixed CPU time budget, several seeds."""
    data = prepare(corpus, work / "data")
    rows = []
    for seed in seeds:
        for norm in norms:
            save = work / f"q-{norm}-seed{seed}"
            cmd = train_command(data / "bin", save, norm, dims, seed,
                                ["--stop-time-hours", minutes / 60, "--keep-last-epochs", "3", *extra])
            log, _ = run_training(cmd)
            updates = max([int(m) for m in re.findall(r'"(?:train_)?num_updates": "(\d+)"', log)] or [0])
            epochs = sorted(save.glob("checkpoint[0-9]*.pt"))
            average = min(3, len(epochs)) or 1
            ev = subprocess.run(["bash", str(ROOT / "scripts/evaluate.sh"), "--dataset", "quickstart",
                                 "--data", str(data / "bin"), "--save-dir", str(save), "--average", str(average),
                                 "--cpu"], capture_output=True, text=True,
                                env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
            if ev.returncode != 0:
                raise RuntimeError(f"evaluate.sh failed:\n{ev.stderr[-2000:]}")
            result = json.loads((save / "bleu-test.json").read_text())
            rows.append(dict(norm=norm, seed=seed, updates=updates, bleu=result["bleu"][0],
                             sacrebleu=result["sacrebleu"][0], checkpoints_averaged=average,
                             signature=result["sacrebleu_signature"]))
    summary = []
    for norm in norms:
        scores = [r["sacrebleu"] for r in rows if r["norm"] == norm]
        tok = [r["bleu"] for r in rows if r["norm"] == norm]
        summary.append(dict(norm=norm, seeds=len(scores), sacrebleu_mean=round(statistics.mean(scores), 2),
                            sacrebleu_std=round(statistics.stdev(scores), 2) if len(scores) > 1 else 0.0,
                            bleu_mean=round(statistics.mean(tok), 2),
                            bleu_std=round(statistics.stdev(tok), 2) if len(tok) > 1 else 0.0))
    return rows, summary


def prepare(corpus, out):
    """Tokenize, BPE and binarize a raw {train,valid,test}.{de,en} directory."""
    subprocess.run(["bash", str(ROOT / "data-prep/prepare-quickstart.sh"), "--src-dir", str(corpus),
                    "--out", str(out)], check=True, capture_output=True,
                   env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    return out


# ---------------------------------------------------------------- report
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


def gpu_markdown(results):
    out = []
    if results.get("layers"):
        out += ["### 1. Norm layer on the GPU, forward + backward, relative to `F.layer_norm`", "",
                _machine_line(results, "layers"), "",
                f"20% padding; median of interleaved pairs, each the mean of {GPU_CALLS} calls timed with CUDA "
                f"events; copy bandwidth {results['copy_bandwidth_gb_s']} GB/s; bytes = 5 x tensor.", "",
                *_layer_rows(results["layers"], 3, copy=False), ""]
    if results.get("device"):
        out += [_machine_line(results, "device"), "", *device_markdown(results["device"])]
    if results.get("train"):
        out += ["### 2. `fairseq-train --fp16` words/s and peak GPU memory, relative to stock "
                "`transformer_iwslt_de_en` (pre-norm LN)", "",
                _machine_line(results, "train"), "",
                "Full-size model (6+6 layers, 512 dims); words/s is the median of the logged intervals over the "
                "second half of each run; peak memory is `torch.cuda.max_memory_allocated`; runs interleaved in "
                "shuffled order, median over rounds.", "",
                "| encoder norm | tokens per batch | updates x rounds | words/s | / stock | peak MiB | / stock "
                "| target (pn) |",
                "|---|---|---|---|---|---|---|---|"]
        for r in results["train"]:
            met = ""
            if r["norm"] == "pn":
                ok = r["wps_ratio"] >= TARGETS["throughput"] and r["mem_ratio"] <= TARGETS["memory"]
                met = f">= {TARGETS['throughput']}, <= {TARGETS['memory']} " + ("met" if ok else "**missed**")
            out.append(f"| {_run_name(r['norm'], r)} | {r['max_tokens']} | {r['updates']} x {r['rounds']} | "
                       f"{r['wps']} | {r['wps_ratio']:.3f} | {r['peak_mib']} | {r['mem_ratio']:.3f} | {met} |")
        out.append("")
    return "\n".join(out)


def gpu_plots(results, out):
    plt = _pyplot()
    if results.get("layers"):
        rows = results["layers"]
        panels = sorted({(r["dtype"], r["shape"]) for r in rows})
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.5), sharey=True, squeeze=False)
        for ax, (dtype, shape) in zip(axes[0], panels):
            vals = [next(r["ratio_to_ln"] for r in rows if (r["dtype"], r["shape"], r["norm"]) == (dtype, shape, k))
                    for k in NORM_TYPES]
            ax.bar(range(len(NORM_TYPES)), vals, color="tab:blue")
            _layer_targets(ax, 0.4, 0.4)
            ax.set_xticks(range(len(NORM_TYPES)), NORM_TYPES, rotation=60, fontsize=8)
            ax.set_title(f"{dtype}, {shape}")
        axes[0][0].set_ylabel("forward + backward time / LayerNorm (ratio)")
        device = results.get("machines", {}).get("layers", {}).get("device", "a GPU not recorded")
        fig.suptitle(f"Norm layer cost on {device}, 20% padding")
        _save(plt, fig, out / "layers-cuda.png")
    if results.get("train"):
        rows = results["train"]
        _speed_and_memory(plt, [f"{r['norm']}\n{r['max_tokens']}" for r in rows], rows, "mem_ratio",
                          "fairseq-train --fp16 throughput", "peak GPU memory (max_memory_allocated)",
                          "peak GPU memory", "encoder norm, tokens per batch", out / "train-cuda.png")


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


def main_gpu(p, args, out):
    """``--device cuda``: layer timings and fairseq-train --fp16 runs on the GPU."""
    if not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    sections = set(args.sections.split(","))
    unknown = sections - {"layers", "throughput", "device"}
    if unknown:
        p.error(f"--sections: {', '.join(sorted(unknown))} not available with --device cuda; allowed: layers, "
                "throughput, device (GPU quality runs are the recipes': scripts/train.sh and evaluate.sh)")
    previous = out / "results-cuda.json"
    results = json.loads(previous.read_text()) if previous.exists() else {}
    for key in ("device", "torch", "triton", "cuda", "python", "date", "backend"):
        results.pop(key, None)  # before each section named its own
    if "layers" in sections:
        shapes = [(64, 64, 512), (128, 128, 1024)]
        dtypes = [torch.float32, torch.float16, torch.bfloat16]
        rows, bw = bench_layers(shapes, max(30, args.reps), dtypes, device="cuda")
        results["layers"], results["copy_bandwidth_gb_s"] = rows, round(bw / 1e9, 1)
        ran_on(results, ["layers"], gpu_machine())
    if "device" in sections:
        results["device"] = bench_device([(64, 64, 512), (128, 128, 1024)],
                                         [torch.float32, torch.float16, torch.bfloat16])
        ran_on(results, ["device"], gpu_machine())
    if "throughput" in sections:
        data = prepare(args.corpus, out / "work" / "data")
        sizes = [int(t) for t in args.gpu_tokens.split(",")]
        rows = bench_train_gpu(data / "bin", out / "work", ["stock-ln", "ln", "pn", "pn-v", "bn"],
                               sizes, args.updates or 500, args.rounds)
        results["train"] = merge_rows(results.get("train", []), rows, ("norm", "max_tokens"))
        ran_on(results, ["train"], gpu_machine())
    (out / "results-cuda.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results-cuda.md").write_text(gpu_markdown(results) + "\n")
    gpu_plots(results, out)
    print(gpu_markdown(results))
    print(f"\nwritten: {out}/results-cuda.json, results-cuda.md, *-cuda.png")


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
        cells += [_percent(r["fraction_of_bandwidth"]), _met(r["ratio_to_ln"], r["target"])]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return rows


def _percent(fraction) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def markdown(results):
    out = []
    if "layers" in results:
        bw = results["layers_bandwidth_gb_s"]
        out += ["### 1. Norm layer, forward + backward, relative to `F.layer_norm`", "",
                _machine_line(results, "layers"), "",
                "20% padding, median of interleaved pairs, glibc's allocator thresholds fixed (steady_allocator); "
                f"memory bandwidth (large copy) {bw} GB/s; "
                "bytes = 5 x tensor (read x, write y; read x and dy, write dx); 'of copy' is against "
                "the best copy of a tensor of the layer's own size (copy GB/s).", "",
                *_layer_rows(results["layers"], 2, copy=True), ""]
    if "launches" in results:
        out += ["### 5. Launches, host waits, bytes and registers per training step of one layer", "",
                _machine_line(results, "launches"), "",
                f"Forward + backward, T x B x C = {results.get('launches_shape', '512x8x512')}, 20% padding, "
                "float16 on the Triton path "
                "(counted under Triton's interpreter: what a GPU would be sent; measure/launches.py), "
                "after the first step. Activation tensors: (N, C) tensors the kernels read or write "
                "(LayerNorm's minimum: 5). Registers and spills: the largest over the sm_90 builds of "
                "the kernels launched (measure/sm90.py); programs/SM: how many the grid launches per "
                "multiprocessor; all resident: whether every kernel's registers allow that many at once. "
                "Busiest / mean: the bytes the busiest program moves over the mean program's, the largest "
                "over the launches of a step at 128 x 128 x 1024, modelled from the plans (sm90.balance).", "",
                "| norm | launches | Triton kernels | host waits (triton / cpu) | activation tensors | "
                "registers | spill bytes | programs/SM | all resident | resident warps/SM (least) | "
                "programs per launch | busiest / mean | launch target |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["launches"]:
            met = _met(r["launches"], r["target"])
            resident = {True: "yes", False: "**no**"}.get(r.get("all_resident"), "")
            warps = r.get("resident_warps")
            warps = "" if warps is None else f"{warps}" + (" **< 32**" if warps < 32 else "")
            busiest = r.get("busiest_to_mean")
            busiest = "" if busiest is None else f"{busiest}" + (" **> 2**" if busiest > 2 else "")
            out.append(f"| {r['norm']} | {r['launches']} | {r['kernels']} | {r['host_waits']} / "
                       f"{r['cpu_host_waits']} | {r['activation_tensors']} | {r.get('max_registers', '')} | "
                       f"{r.get('spill_bytes', '')} | {r.get('programs_per_sm', '')} | {resident} | {warps} | "
                       f"{r.get('programs', '')} | {busiest} | {met} |")
        out.append("")
    if "host" in results:
        out += ["### 6. Host cost of a training step of one layer, relative to `nn.LayerNorm`'s", "",
                _machine_line(results, "host"), "",
                "Forward + backward at 4 x 4 x 64 (T x B x C), one token of padding (measure/host.py): "
                "the Triton path under Triton's interpreter with every launch replaced by nothing (the host "
                "code that drives a GPU), the CPU backend as it runs. Calls: sys.setprofile's call and c_call "
                "events of one step; time: median over interleaved rounds.", "",
                "| backend | norm | calls | / LN | time / LN | calls target | time target |",
                "|---|---|---|---|---|---|---|"]
        for r in results["host"]:
            out.append(f"| {r['backend']} | {r['norm']} | {r['calls']} | {r['calls_ratio']:.2f} | "
                       f"{r['time_ratio']:.2f} | {_met(r['calls_ratio'], r['calls_target'])} | "
                       f"{_met(r['time_ratio'], r['time_target'])} |")
        out.append("")
    if "host_standin" in results:
        rows = results["host_standin"]
        out += ["#### The Triton path on Triton's real launch code, under a stand-in driver", "",
                "Forward + backward of one layer, one token of padding, on Triton's CUDA launch path with a "
                "stand-in libcuda that records each launch and runs nothing (measure/standin.py; kernels "
                "compiled for sm_90), beside `nn.LayerNorm`'s step in the same run; the least of the rounds.", "",
                "| kind | shape | step / LN | python calls / LN |", "|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['kind']} | {r['shape']} | {r['step_ratio']:.2f} | {r['calls_ratio']:.2f} |")
        missed = [f"{r['kind']} {r['shape']}" for r in rows
                  if r["step_ratio"] > r["step_target"] or r["calls_ratio"] > r["calls_target"]]
        out += ["", "The gate: a step within " + ", ".join(f"{k} {v}x" for k, v in STANDIN_TARGETS["step"].items())
                + f" of LayerNorm's, and calls within {STANDIN_TARGETS['calls']}x: "
                + (f"missed by {', '.join(missed)}." if missed else "met by every row."), ""]
    if "throughput" in results:
        out += ["### 2 and 4. `fairseq-train` words/s and peak memory, relative to stock "
                "`transformer_iwslt_de_en` (LN)", "",
                _machine_line(results, "throughput"), "",
                f"Model {results['dims']}, interleaved runs, median; peak memory is the process's peak RSS.", "",
                "| variant | words/s | / stock LN | peak MiB | / stock LN |", "|---|---|---|---|---|"]
        for r in results["throughput"]:
            out.append(f"| {_run_name(r['variant'], r)} | {r['wps']} | {r['wps_ratio']:.3f} | {r['peak_mib']} | "
                       f"{r['memory_ratio']:.3f} |")
        out += ["", f"Targets: `--norm-type pn` words/s >= {TARGETS['throughput']} x stock, "
                    f"memory <= {TARGETS['memory']} x stock.", ""]
    if "quality" in results:
        q = results["quality"]
        out += ["### 3. Translation quality at a fixed CPU budget", "",
                _machine_line(results, "quality"), "",
                f"Corpus {q['corpus']}, {q['minutes']} CPU minutes per run, seeds {q['seeds']}, "
                f"last <= 3 epoch checkpoints averaged; mean +- standard deviation over seeds.", "",
                "| encoder norm | sacreBLEU | tokenized BLEU (case-insens.) |", "|---|---|---|"]
        for r in q["summary"]:
            out.append(f"| {r['norm']} | {r['sacrebleu_mean']:.2f} +- {r['sacrebleu_std']:.2f} | "
                       f"{r['bleu_mean']:.2f} +- {r['bleu_std']:.2f} |")
        out += ["", "| norm | seed | updates | sacreBLEU | tokenized BLEU |", "|---|---|---|---|---|"]
        for r in q["runs"]:
            out.append(f"| {r['norm']} | {r['seed']} | {r['updates']} | {r['sacrebleu']} | {r['bleu']} |")
        out += ["", f"sacreBLEU signature: `{q['runs'][0]['signature']}`", ""]
    return "\n".join(out)


def plots(results, out):
    plt = _pyplot()
    if "layers" in results:
        rows = [r for r in results["layers"] if r["dtype"] == "float32"]
        shapes = sorted({r["shape"] for r in rows})
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / len(shapes)
        for i, shape in enumerate(shapes):
            vals = [next(r["ratio_to_ln"] for r in rows if r["shape"] == shape and r["norm"] == k) for k in NORM_TYPES]
            ax.bar([j + i * width for j in range(len(NORM_TYPES))], vals, width, label=f"(T, B, C) = {shape}")
        _layer_targets(ax, 0.1, 0.8, TARGETS["layers"]["cuda"])
        ax.set_yscale("log")  # the per-token norms of the plain path sit an order of magnitude above the rest
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(NORM_TYPES))], NORM_TYPES, rotation=45, ha="right")
        ax.set_ylabel("fwd + bwd time / LayerNorm (log scale)")
        ax.set_title("Norm layer cost on the CPU, float32, 20% padding")
        ax.legend()
        _save(plt, fig, out / "layers.png")
    if "throughput" in results:
        rows = results["throughput"]
        _speed_and_memory(plt, [r["variant"] for r in rows], rows, "memory_ratio", "fairseq-train throughput",
                          "fairseq-train peak memory (RSS)", "peak memory",
                          "encoder norm (stock-ln: fairseq's transformer)", out / "throughput_memory.png", 20)
    if "quality" in results:
        q = results["quality"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        names = [r["norm"] for r in q["summary"]]
        ax.bar(names, [r["sacrebleu_mean"] for r in q["summary"]],
               yerr=[r["sacrebleu_std"] for r in q["summary"]], capsize=6, color="tab:green", alpha=0.7,
               label="mean +- std over seeds")
        for r in q["runs"]:
            ax.plot(names.index(r["norm"]), r["sacrebleu"], "ko", markersize=4)
        ax.plot([], [], "ko", markersize=4, label="one seed")
        ax.set_xlabel("encoder norm (decoder: LN)")
        ax.set_ylabel("sacreBLEU (detokenized)")
        ax.set_title(f"BLEU after {q['minutes']} CPU minutes per run")
        ax.legend()
        _save(plt, fig, out / "quality.png")


def norm_list(parser, flag, text):
    """The norm types a comma-separated flag names, refused in one line if one is unknown."""
    norms = text.split(",")
    bad = set(norms) - set(NORM_TYPES)
    if bad:
        parser.error(f"{flag}: unknown {', '.join(sorted(bad))}; allowed: {', '.join(NORM_TYPES)}")
    return norms


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--sections", default="layers,throughput,quality,launches,host",
                   help="comma-separated subset of layers,throughput,quality,launches,host (memory comes with "
                        "throughput)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--corpus", default=str(ROOT / "data-prep" / "quickstart"),
                   help="raw {train,valid,test}.{de,en} for throughput and quality "
                        "(e.g. ../shared/data/l10n-de-en; default: the shipped quickstart corpus)")
    p.add_argument("--seeds", default="1,2", help="seeds of the quality runs")
    p.add_argument("--quality-norms", default="ln,bn,pn-v,pn", help="encoder norms of the quality runs")
    p.add_argument("--throughput-norms", default=",".join(NORM_TYPES),
                   help="encoder norms of the throughput runs (each beside fairseq's stock transformer)")
    p.add_argument("--minutes", type=float, default=3.0, help="CPU minutes per quality run")
    p.add_argument("--reps", type=int, default=60, help="interleaved repetitions per layer timing")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the throughput runs")
    p.add_argument("--updates", type=int, default=None,
                   help="updates per throughput run (default 60 on the CPU, 500 with --device cuda)")
    p.add_argument("--gpu-tokens", default="4096,16384",
                   help="tokens per batch of the --device cuda training rows; a run with some sizes replaces "
                        "those rows in results-cuda.json and keeps the others")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: layer timings in float32/16/bfloat16 and fairseq-train --fp16 runs on the GPU, "
                        "written to results-cuda.{md,json} and *-cuda.png")
    p.add_argument("--tiny", action="store_true", help="tiny sizes, to check that every benchmark runs")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        return main_gpu(p, args, out)
    work = out / "work"
    sections = set(args.sections.split(","))
    unknown = sections - {"layers", "throughput", "quality", "launches", "host"}
    if unknown:
        p.error(f"--sections: unknown {', '.join(sorted(unknown))}; allowed: layers, throughput, quality, launches, "
                "host")
    dims = (1, 32, 64, 4) if args.tiny else (3, 256, 512, 4)
    # a run of some sections updates those in an existing results.json and keeps the others
    previous = out / "results.json"
    results = json.loads(previous.read_text()) if previous.exists() else {}
    results.pop("machine", None)  # before each section named its own
    ran_on(results, sections, machine())
    if "throughput" in sections:  # the model of its rows
        results["dims"] = "layers {} + {}, {} dims, FFN {}, {} heads".format(dims[0], *dims)
    if "layers" in sections:
        shapes = [(8, 4, 64)] if args.tiny else [(64, 64, 512), (128, 32, 1024)]
        rows, bw = bench_layers(shapes, 3 if args.tiny else args.reps, [torch.float32, torch.bfloat16])
        results["layers"], results["layers_bandwidth_gb_s"] = rows, round(bw / 1e9, 1)
    if "launches" in sections:
        shape = (16, 4, 64) if args.tiny else (512, 8, 512)
        results["launches"], results["launches_shape"] = bench_launches(*shape), "x".join(map(str, shape))
    if "host" in sections:
        results["host"] = bench_host(*((2, 3) if args.tiny else (7, 50)))
        results["host_standin"] = bench_host_standin(*((1, 3) if args.tiny else (3, 50)))
    if "throughput" in sections or "quality" in sections:
        data = prepare(args.corpus, work / "data")
    if "throughput" in sections:
        variants = ["stock-ln", *norm_list(p, "--throughput-norms", args.throughput_norms)]
        results["throughput"] = bench_throughput(data / "bin", work, variants, dims,
                                                 4 if args.tiny else args.updates or 60,
                                                 1 if args.tiny else args.rounds)
    if "quality" in sections:
        seeds = [int(s) for s in args.seeds.split(",")]
        norms = norm_list(p, "--quality-norms", args.quality_norms)
        minutes = 0.2 if args.tiny else args.minutes
        extra = ["--max-update", 5] if args.tiny else []  # tiny: whichever comes first
        runs, summary = bench_quality(args.corpus, work, norms, seeds, minutes, dims, extra)
        corpus = Path(args.corpus).resolve()  # named relative to the checkout: results name no machine's path
        corpus = corpus.relative_to(ROOT) if corpus.is_relative_to(ROOT) else corpus.name
        results["quality"] = dict(corpus=str(corpus), minutes=minutes, seeds=seeds, runs=runs, summary=summary)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results) + "\n")
    plots(results, out)
    print(markdown(results))
    print(f"\nwritten: {out}/results.json, results.md, *.png")


if __name__ == "__main__":
    main()
