"""Section 1: each norm layer's forward + backward beside LayerNorm's, and torch's own norms."""

import ctypes
import random
import statistics

import torch
import torch.nn.functional as F

from common import TARGETS, layer_target, measure_bandwidth, sig, timed_fresh

from powernorm_fairseq.norms import NORM_TYPES, build_norm


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
            for r in rows[-len(calls):]:  # a kind held to a neighbour's time (common.TARGETS["beside"])
                other, most = TARGETS["beside"].get(r["norm"], (None, None))
                if other and device == "cpu" and dtype == torch.float32:
                    ratio = statistics.median(ratios[r["norm"]]) / statistics.median(ratios[other])
                    r["beside"] = (other, sig(ratio), most)
    return rows, bandwidth
