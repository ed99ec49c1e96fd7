"""Section 5: the launches of one step of each kind, and (``--device cuda``) the device-only time of a
step replayed in a CUDA graph beside its host time."""

import time

import torch

from common import _percent, measure_bandwidth, sig
from layers import layer_options
from powernorm_fairseq.norms import build_norm, kernels


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
    ("derf", "derf", {}),
]
LAUNCH_TARGETS = {"pn (Algorithm 2)": 4, "pn in warmup": 6, "pn-v": 6, "bn": 6, "bn --layer-scale": 6,
                  "scalenorm": 2, "rmsnorm": 3, "dyt": 3, "derf": 3}


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
            for kind in ["ln", "pn", "pn-v", "bn", "scalenorm", "rmsnorm", "dyt", "derf"]:
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
