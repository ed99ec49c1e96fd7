"""The fused backends (CPU C++ kernels, GPU Triton kernels) against the plain
PyTorch path, and the dispatch that chooses between them.

The Triton kernels run here on CPU tensors under Triton's interpreter (set in
conftest.py); ``test_triton_kernels_compile_for_a_gpu`` compiles every kernel
as it was launched for an H100 (sm_90), which needs no GPU.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from support import ROOT, backend_or_fail, cli
from powernorm_fairseq.norms import RUNNING_STAT_TYPES, build_norm, kernels
from powernorm_fairseq.norms.kernels import gpu, plans

pytestmark = pytest.mark.fast

# not powers of two, several column chunks, several programs, groups of 50 channels
T, B, C = 23, 7, 200

KINDS = [
    ("bn", {}), ("pn-v", {}), ("scalenorm", {}), ("rmsnorm", {}), ("dyt", {}), ("derf", {}),
    ("rmsnorm", {"unit_offset": True}),  # the gain read as 1 + gamma (--norm-unit-offset)
    ("pn", {"warmup_updates": 2}),
    ("pn", {"warmup_updates": 2, "layer_scale": True, "groups": 4, "unit_offset": True}),
    ("pn", {"warmup_updates": 2, "backward": "reference", "layer_scale": True, "groups": 2}),
]
IDS = [f"{k}-{'-'.join(f'{a}={b}' for a, b in o.items())}" if o else k for k, o in KINDS]


def batch(seed, dtype, device="cpu", shape=(T, B, C)):
    T, B, C = shape
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, B, C, generator=g, dtype=torch.float64) * 2 + 0.5)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    grad_y = torch.randn(T, B, C, generator=g, dtype=torch.float64)
    grad_y[pad.t()] = 0
    return x.to(device, dtype), pad.to(device), grad_y.to(device, dtype)


def make(kind, options, dtype, C=C):
    norm = build_norm(kind, C, **options)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in norm.named_parameters():
            p.mul_(1.3).add_(0.2) if p.dim() == 0 else p.copy_(  # a scalar off its start: Derf's shift too
                (1.0 if name == "weight" else 0.0) + 0.3 * torch.randn(C, generator=g))
    return norm.to(dtype).train()


def steps(kind, options, backend, dtype, model_dtype=None, n=4, device="cpu", shape=(T, B, C)):
    """Outputs, input and parameter gradients and buffers over ``n`` training steps."""
    norm = make(kind, options, model_dtype or dtype, shape[-1]).to(device)
    out = []
    with kernels.use(backend):
        for step in range(n):
            x, pad, grad_y = batch(120 + step, dtype, device, shape)
            x.requires_grad_(True)
            norm.zero_grad()
            y = norm(x, pad)
            y.backward(grad_y)
            out.append([y.detach(), x.grad] + [p.grad.clone() for p in norm.parameters()]
                       + [b.clone() for b in norm.buffers() if b.is_floating_point()])
    return out


def scaled_error(got, want):
    """max |got - want| relative to the largest |want| (the output's scale)."""
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("kind", ["rmsnorm", "dyt", "derf"])
def test_the_row_parameter_sums_are_the_same_in_the_kernel_or_a_launch_of_their_own(kind, monkeypatch):
    """A row backward's parameter sums, added by its last program (few
    programs) or by _sum_columns over channel blocks (many): the same numbers
    as the plain path's, in float64, either way."""
    backend_or_fail("triton")
    exact = steps(kind, {}, "plain", torch.float64, n=2)
    for here in (True, False):
        monkeypatch.setattr(plans, "sums_here", lambda progs, per_prog: here)
        plans.forget()  # the passes ask their plans anew
        fast = steps(kind, {}, "triton", torch.float64, n=2)
        for e, f in zip(exact, fast):
            assert all(scaled_error(u, v) < 1e-12 for u, v in zip(f, e)), (kind, here)
    monkeypatch.undo()
    plans.forget()  # the plans as they are, for the tests after this one


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("kind, options", KINDS, ids=IDS)
def test_backends_match_the_plain_path_in_float32(backend, kind, options):
    backend_or_fail(backend)
    fast = steps(kind, options, backend, torch.float32)
    plain = steps(kind, options, "plain", torch.float32)
    for step, (a, b) in enumerate(zip(fast, plain)):
        for i, (u, v) in enumerate(zip(a, b)):
            assert scaled_error(u, v) < 1e-5, (step, i, scaled_error(u, v))


WIDE = [("scalenorm", {}), ("rmsnorm", {}), ("dyt", {}), ("derf", {}),
        ("pn", {"warmup_updates": 1, "layer_scale": True}), ("bn", {"layer_scale": True, "groups": 2})]
WIDE_IDS = ["scalenorm", "rmsnorm", "dyt", "derf", "pn-scaled", "bn-2-groups"]


@pytest.mark.slow  # the fast tier keeps the kernels' common widths
@pytest.mark.parametrize("kind, options", WIDE, ids=WIDE_IDS)
def test_triton_walks_wide_rows_and_groups_in_blocks_as_the_plain_path_computes_them(kind, options):
    """Rows wider than gpu.WIDEST_ROW and groups wider than gpu.WIDEST_GROUP
    (2304 channels: one whole-row group, or two of 1152) are walked in blocks of
    columns, the last one part-filled; float64, against the plain path."""
    backend_or_fail("triton")
    shape = (5, 3, 2304)
    assert shape[-1] // options.get("groups", 1) > gpu.WIDEST_GROUP and shape[-1] > gpu.WIDEST_ROW
    fast = steps(kind, options, "triton", torch.float64, n=2, shape=shape)
    plain = steps(kind, options, "plain", torch.float64, n=2, shape=shape)
    for step, (a, b) in enumerate(zip(fast, plain)):
        for i, (u, v) in enumerate(zip(a, b)):
            assert scaled_error(u, v) < 1e-12, (step, i, scaled_error(u, v))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("kind, options", KINDS, ids=IDS)
def test_half_precision_is_within_the_plain_paths_own_error(kind, options, dtype, backend):
    """Against float64, the kernels' error on half inputs (a half model, as
    under --fp16 or --bf16) is at most the plain path's own, with a small
    margin for rounding the other way: the C++ kernels read and write
    bfloat16 themselves and upcast float16. A shorter batch than the float32
    test's (60 rows, where Triton's interpreter runs half precision 2-3x
    slower) that the kernels launch on the same grids: the same column
    chunks, groups and row programs, the last block part-filled."""
    backend_or_fail(backend)
    shape = (12, 5, C)
    exact = steps(kind, options, "plain", torch.float64, shape=shape)
    fast = steps(kind, options, backend, dtype, shape=shape)
    plain = steps(kind, options, "plain", dtype, shape=shape)
    for step, (e, f, p) in enumerate(zip(exact, fast, plain)):
        for i, (u, v, w) in enumerate(zip(e, f, p)):
            assert v.dtype == w.dtype, (step, i)
            err_fast, err_plain = scaled_error(v, u), scaled_error(w, u)
            unit = torch.finfo(dtype).eps
            assert err_fast <= 1.5 * err_plain + 2 * unit, (step, i, err_fast, err_plain)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or gpu.interpreting(),
                    reason="the compiled kernels on a GPU: run `TRITON_INTERPRET=0 pytest -k cuda` on a GPU machine")
@pytest.mark.parametrize("kind", ["pn", "bn", "scalenorm", "dyt", "derf"])
def test_the_cuda_node_launches_on_the_current_stream_graph_and_device(kind):
    """The C++ node launches on torch's current stream: a step on a side
    stream, and one captured in a CUDA graph and replayed, give the default
    stream's eager step bit for bit; so does a step on a second device, where
    one is visible (each device's variants held apart)."""
    import copy

    def step(norm, device):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, B, C, generator=g).to(device).requires_grad_(True)
        pad = (torch.arange(T)[None, :] >= (T - 2 * (torch.arange(B) % 3))[:, None]).to(device)
        dy = torch.randn(T, B, C, generator=g).to(device)
        return lambda: (norm(x, pad), *torch.autograd.grad(norm(x, pad), [x, *norm.parameters()], dy))

    base = build_norm(kind, C).train()
    with kernels.use("triton"):
        for _ in range(2):  # the variants compiled and held
            step(copy.deepcopy(base).cuda(), "cuda")()
        eager = step(copy.deepcopy(base).cuda(), "cuda")()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = step(copy.deepcopy(base).cuda(), "cuda")()
        torch.cuda.current_stream().wait_stream(side)
        norm = copy.deepcopy(base).cuda()
        run = step(norm, "cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        for name, buf in norm.named_buffers():  # the replay starts where the eager step did
            buf.copy_(dict(base.named_buffers())[name])
        graph.replay()
        torch.cuda.synchronize()
        for got in (on_side, captured):
            assert all(torch.equal(a, b) for a, b in zip(eager, got)), kind
        if torch.cuda.device_count() > 1:
            on_second = step(copy.deepcopy(base).to("cuda:1"), "cuda:1")()
            assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(eager, on_second)), kind


@pytest.mark.slow  # Triton's driver starts processes (ldconfig, the compiler) on first use
@pytest.mark.skipif(not torch.cuda.is_available() or gpu.interpreting(),
                    reason="the compiled kernels on a GPU: run `TRITON_INTERPRET=0 pytest -k cuda` on a GPU machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind, options, shape", [(k, o, (T, B, C)) for k, o in KINDS]
                         + [(k, o, (9, 5, 16384)) for k, o in WIDE],
                         ids=IDS + [f"{i}-16384" for i in WIDE_IDS])
def test_triton_on_cuda_matches_the_plain_path(kind, options, shape, dtype):
    """The same checks as above with the kernels compiled for the GPU, and
    the widest rows and groups (C = 16384, walked in blocks of columns)."""
    backend_or_fail("triton")
    fast = steps(kind, options, "triton", dtype, device="cuda", shape=shape)
    plain = steps(kind, options, "plain", dtype, device="cuda", shape=shape)
    if dtype == torch.float32:
        for a, b in zip(fast, plain):
            assert all(scaled_error(u, v) < 1e-5 for u, v in zip(a, b))
        return
    exact = steps(kind, options, "plain", torch.float64, device="cuda", shape=shape)
    unit = torch.finfo(dtype).eps
    for e, f, p in zip(exact, fast, plain):
        for u, v, w in zip(e, f, p):
            assert scaled_error(v, u) <= 1.5 * scaled_error(w, u) + 2 * unit


@pytest.mark.slow
def test_triton_writes_half_outputs_and_float32_statistics():
    backend_or_fail("triton")
    norm = make("pn", {"warmup_updates": 1}, torch.float16)
    with kernels.use("triton"):
        for step in range(3):
            x, pad, grad_y = batch(step, torch.float16)
            x.requires_grad_(True)
            y = norm(x, pad)
            y.backward(grad_y)
            assert y.dtype == x.grad.dtype == torch.float16
    assert norm.running_psi2.dtype == norm.running_nu.dtype == torch.float32
    assert bool(torch.isfinite(norm.running_nu).all()) and bool(norm.running_nu.abs().sum() > 0)


def test_dispatch_by_device_and_override():
    x = torch.randn(3, 2, 8)
    assert kernels.describe(x) == "cpu"  # automatic: the CPU kernels for a CPU tensor
    for name in kernels.BACKENDS:
        with kernels.use(name):
            assert kernels.describe(x) == name
    with pytest.raises(ValueError, match="unknown backend 'cuda'; choose one of plain, cpu, triton"):
        with kernels.use("cuda"):
            pass


def _python(code, timeout=600, **env):
    """``python -c code`` in a process of its own (a fork that has imported
    torch alone: the plugin and triton import afresh), without this
    process's backend settings, with ``env``."""
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "POWERNORM_BACKEND")}
    return cli("python", "-c", code, check=False, timeout=timeout, environ={**base, **env})


@pytest.mark.slow
def test_kernels_can_be_switched_off_and_a_run_says_which_backend_it_uses():
    code = ("import logging, torch\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "from powernorm_fairseq.norms import kernels, build_norm\n"
            "for _ in range(3):\n"
            "    y = build_norm('pn', 8).train()(torch.randn(3, 2, 8))\n"
            "assert torch.isfinite(y).all()\n"
            "print(kernels.describe(y))\n")
    for env, name in (({"POWERNORM_KERNELS": "0"}, "plain PyTorch path"), ({}, "cpu kernels"),
                      ({"POWERNORM_BACKEND": "plain"}, "plain PyTorch path")):
        proc = _python(code, **env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said = [line for line in proc.stderr.splitlines() if "norms run on" in line]
        assert said == [f"powernorm_fairseq: norms run on the {name}"], proc.stderr[-2000:]


@pytest.mark.fast
def test_the_backend_variables_are_read_once_per_process_and_use_switches_after(monkeypatch):
    """The first choice reads POWERNORM_KERNELS and POWERNORM_BACKEND; a later
    change of the environment leaves the choice as it was, kernels.use switches."""
    backend_or_fail("cpu")
    x = torch.randn(3, 2, 8)
    monkeypatch.setattr(kernels, "_environment", None)  # as in a new process (restored after)
    monkeypatch.setenv("POWERNORM_BACKEND", "plain")
    assert kernels.describe(x) == "plain"
    monkeypatch.setenv("POWERNORM_BACKEND", "cpu")
    assert kernels.describe(x) == "plain"
    with kernels.use("cpu"):
        assert kernels.describe(x) == "cpu"
        y = build_norm("pn", 8).train()(x)
    assert kernels.describe(x) == "plain" and torch.isfinite(y).all()
    monkeypatch.setattr(kernels, "_environment", None)
    assert kernels.describe(x) == "cpu"  # read anew
    monkeypatch.setattr(kernels, "_environment", None)
    monkeypatch.setenv("POWERNORM_KERNELS", "0")
    assert kernels.describe(x) == "plain"


@pytest.mark.parametrize("env, message", [
    ({"POWERNORM_BACKEND": "gpu"}, "POWERNORM_BACKEND='gpu': choose one of plain, cpu, triton"),
    ({"POWERNORM_BACKEND": "triton"}, "POWERNORM_BACKEND=triton: the triton kernels do not take cpu tensors"),
])
@pytest.mark.slow
def test_a_backend_that_cannot_run_fails_in_one_line(env, message):
    proc = _python("import torch\nfrom powernorm_fairseq.norms import build_norm\n"
                   "build_norm('bn', 8).train()(torch.randn(3, 2, 8))\n", **env)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].endswith(message), proc.stderr[-2000:]


def test_the_triton_backend_needs_the_compiled_module(monkeypatch, caplog):
    """The Triton path's passes live in the compiled module: without it (no compiler) the norms take the
    plain path with a warning that names why, and a forced triton backend is refused in one line."""
    from powernorm_fairseq.norms.kernels import compiled

    backend_or_fail("triton")
    monkeypatch.setattr(compiled, "load", lambda: None)
    monkeypatch.setattr(compiled, "NODE", None)
    monkeypatch.setattr(compiled, "failure", "RuntimeError: no C++ compiler")
    monkeypatch.setattr(gpu, "_NODE", None)
    monkeypatch.setattr(gpu, "failure", None)
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "_said", set())
    x = torch.randn(3, 2, 8)
    why = "the compiled module is unavailable (RuntimeError: no C++ compiler)"
    with kernels.use("triton"), pytest.raises(RuntimeError, match=rf"^POWERNORM_BACKEND=triton: the triton "
                                                                    rf"kernels are unavailable \({re.escape(why)}\)$"):
        build_norm("pn", 8).train()(x)
    assert not gpu.available() and gpu.failure_reason() == why


def test_the_kernels_are_bound_by_name_and_each_missing_or_unknown_one_refused():
    """bind_gpu takes the kernels by name: a missing or an unknown name is one line, and the binding
    in force is left as it was."""
    from powernorm_fairseq.norms.kernels import compiled, launcher

    backend_or_fail("triton")
    node = compiled.load()
    given = {name: (k, gpu._parameters(k)) for name, k in gpu.KERNELS.items()}
    missing = dict(given)
    del missing["_dyt_backward"]
    with pytest.raises(RuntimeError, match=r"bind_gpu: no kernel _dyt_backward \(gpu.py binds 13 by name\)"):
        node.bind_gpu(missing, plans, launcher.from_node)
    with pytest.raises(RuntimeError, match=r"bind_gpu: no kernel of the passes is named _extra"):
        node.bind_gpu({**given, "_extra": given["_sum_columns"]}, plans, launcher.from_node)
    y = build_norm("rmsnorm", 8).train()
    with kernels.use("triton"):
        y(torch.randn(3, 2, 8)).sum().backward()  # the binding in force still launches


def sweep_kinds(C, groups=(2, 4, 5, 8)):
    """Every mode of every kernel norm, with the group scalings a model of C channels can have."""
    kinds = [("pn", {}), ("pn", {"warmup_updates": 1}), ("pn", {"warmup_updates": 1, "backward": "reference"}),
             ("pn-v", {}), ("bn", {}), ("scalenorm", {}), ("rmsnorm", {}), ("dyt", {}), ("derf", {})]
    for g in groups:
        if C % g == 0:
            kinds += [("pn", {"layer_scale": True, "groups": g}),
                      ("pn", {"warmup_updates": 1, "layer_scale": True, "groups": g}),
                      ("bn", {"layer_scale": True, "groups": g})]
    return kinds


@pytest.mark.slow
def test_triton_kernels_compile_for_a_gpu_without_spilling_and_fit_their_grid():
    """Every kernel variant a training run launches, compiled for an H100
    (sm_90) through triton's own specialisation: none spills, and each one's
    registers let the programs per multiprocessor that its grid launches be
    resident at once. The sweep, over two steps of every mode with padding
    (a padded variant is the unpadded one plus the mask's load and its
    registers): C = 1000 (group scalings over 2, 4 and 8 heads, chunks of 500
    to 125 channels; 5 heads' 200 would take the blocks of 4's 250) and C =
    200 over 8 heads (chunks of 25), in float16, float32 and the --amp mix
    (float16 activations, float32 parameters); and the widths of large
    models, C = 4096, 8192 and 16384, with a whole-row group and groups of
    128 channels, in float16, bfloat16 and float32 (rows and groups walked
    in blocks). Not float64: no training run uses it, and its kernels are held to the
    plain path's numbers elsewhere, not to a GPU's registers. The input is
    the model's, fairseq's transposed residual stream (a contiguous one is
    the strided one without the row arithmetic). Only distinct
    specialisations are compiled: the wide row kernels and the wide groups
    are one variant for every width, the other groups one per group width."""
    backend_or_fail("triton")
    from powernorm_fairseq.measure import sm90

    T, Bn = 91, 9  # 819 rows: not a multiple of 16
    half, f32, amp = (torch.float16,) * 2, (torch.float32,) * 2, (torch.float16, torch.float32)
    sweep = [(1000, kind, options, (half, f32, amp)) for kind, options in sweep_kinds(1000, groups=(2, 4, 8))]
    sweep += [(200, kind, options, (half, f32, amp)) for kind, options in sweep_kinds(200, groups=(8,))]
    # channels a multiple of 16 (the benchmark's 512): Triton vectorises those loads otherwise
    sweep += [(512, kind, options, (half,)) for kind, options in sweep_kinds(512, groups=(4,))]
    for C in (4096, 8192, 16384):
        sweep += [(C, kind, options, (half, (torch.bfloat16,) * 2, f32))
                  for kind, options in sweep_kinds(C, groups=(1, C // 128))]
    pad = torch.zeros(Bn, T, dtype=torch.bool)
    pad[1, T - 3:] = True
    from powernorm_fairseq.measure.standin import MULTIPROCESSORS

    gpu.stand_in(MULTIPROCESSORS)  # planned as for an H100, whose grids choose some variants (plans.sums_here)
    try:
        with sm90.recording(run=False) as launched, kernels.use("triton"):
            for C, kind, options, dtypes in sweep:
                for dtype, model_dtype in dtypes:
                    norm = build_norm(kind, C, **options).to(model_dtype).train()
                    # the per-row kinds also on a small batch: few programs add their parameters' sums themselves
                    small = () if kind in RUNNING_STAT_TYPES else ((3, 2, None),)
                    for t, b, p in ((T, Bn, pad), (T, Bn, pad), *small):
                        # fairseq's residual stream: a (B, T, C) tensor seen as (T, B, C)
                        x = torch.empty(b, t, C, dtype=dtype).transpose(0, 1).requires_grad_(True)
                        norm(x, p).backward(torch.empty_like(x))
    finally:
        gpu.stand_in(None)
    built = sm90.build_in_fresh_process(sm90.distinct(launched))
    assert {b["kernel"] for b in built} == {
        "_channel_forward", "_finish_stats", "_channel_backward", "_finish_backward", "_scalenorm_forward",
        "_scalenorm_backward", "_rmsnorm_forward", "_rmsnorm_backward", "_dyt_forward", "_dyt_backward",
        "_derf_forward", "_derf_backward", "_sum_columns"}
    assert any(b["signature"].get("W") == "*fp32" and b["signature"].get("X") == "*fp16" for b in built)  # --amp
    spilled = [b for b in built if b["spill_bytes"]]
    assert not spilled, spilled[:3]
    # the C++ node holds every variant, and passes each the parameters its PTX .entry declares, of the kinds
    # gpu.py's passes give (launcher.layout: sizes against the PTX; scratch pointers after them)
    for variant, b in zip(sm90.distinct(launched), built):
        assert b["layout"] is not None, b
        where, types, scratch = b["layout"]
        kinds = [next(iter(variant["args"][i])) for i in where]
        assert all((k == "tensor") == t.startswith("*") and (k == "float") == t.startswith("fp")
                   for k, t in zip(kinds, types)), (b["kernel"], kinds, types)
        assert scratch == len(b["ptx_sizes"]) - len(where) and scratch in (0, 1, 2), b
    crowded = [b for b in built if b.get("resident_per_sm", 1) < b.get("launched_per_sm", 1)]
    assert not crowded, crowded[:3]
    # every wide group width was launched, and compiled once for all of them (its width a run-time argument)
    def wide(variants):
        return [v for v in variants if v["kernel"].startswith("_channel") and v["constexprs"]["WIDE"]]
    assert {a.get("int") for v in wide(launched) for a in v["args"]} >= {4096, 8192, 16384}
    assert {b["constexprs"]["CW"] for b in wide(built)} == {0}


@pytest.mark.parametrize("backend", kernels.BACKENDS)
def test_real_token_count_follows_the_mask(backend):
    """The real tokens are those of the mask as it is at each step, also when
    the same mask object changes in place."""
    backend_or_fail(backend)
    x = torch.randn(5, 3, 4)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 2:] = True
    norm = build_norm("bn", 4).train()
    with kernels.use(backend):
        norm(x, pad)
        first = x[~pad.t()].mean(0)
        pad[0, 1:] = True  # the same mask object, now with fewer real tokens
        norm(x, pad)
        second = x[~pad.t()].mean(0)
    torch.testing.assert_close(norm.running_mean, 0.9 * 0.1 * first + 0.1 * second)


@pytest.mark.parametrize("backend", kernels.BACKENDS)
def test_pn_step_counter_is_read_again_after_a_load(backend):
    backend_or_fail(backend)
    norm, other = build_norm("pn", 8, warmup_updates=3).train(), build_norm("pn", 8, warmup_updates=3).train()
    with kernels.use(backend):
        for _ in range(2):
            norm(torch.randn(3, 2, 8))
        for _ in range(5):
            other(torch.randn(3, 2, 8))
        norm.load_state_dict(other.state_dict())
        norm(torch.randn(3, 2, 8))
    assert int(norm.num_steps) == 6


#: the tests of the build on first use: not the kernels pip install built
JIT = {**os.environ, "POWERNORM_JIT": "1"}
#: an unoptimised build: these tests are of the build's lock and directory, not its code (-O3: 45 s, -O0: 14 s)
QUICK_CFLAGS = ["-O0", "-fopenmp"]
QUICK = f"from powernorm_fairseq.norms.kernels import compiled, cpu\ncompiled.JIT_CFLAGS = {QUICK_CFLAGS!r}\n"
LOAD = QUICK + "assert cpu.available(), compiled.failure\nprint('loaded')\n"


@pytest.mark.slow
def test_the_kernels_pip_install_built_load_without_a_build(tmp_path):
    """setup.py builds the kernels (kernels._C) at install: a run uses them and builds nothing."""
    fresh = tmp_path / "torch_extensions"
    run = ("import torch\nfrom powernorm_fairseq.norms import build_norm, kernels\n"
           "from powernorm_fairseq.norms.kernels import compiled\n"
           "build_norm('pn', 8).train()(torch.randn(3, 2, 8)).sum().backward()\n"
           "print(kernels.describe(torch.randn(1)), compiled.load().__name__)\n")
    proc = _python(run, timeout=120, TORCH_EXTENSIONS_DIR=str(fresh))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["cpu", "powernorm_fairseq.norms.kernels._C"]
    assert not fresh.exists() or not any(fresh.rglob("*.so"))  # nothing built


@pytest.mark.slow
def test_a_fresh_pip_install_runs_on_the_kernels_it_built(tmp_path):
    """``pip install .`` (not editable, into a directory of its own) builds the
    kernels; a run from there uses them and compiles nothing."""
    target, fresh = tmp_path / "site", tmp_path / "torch_extensions"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    assert list((target / "powernorm_fairseq" / "norms" / "kernels").glob("_C*.so"))
    run = ("import torch, powernorm_fairseq\nfrom powernorm_fairseq.norms import build_norm\n"
           "from powernorm_fairseq.norms.kernels import compiled\n"
           "build_norm('bn', 8).train()(torch.randn(3, 2, 8)).sum().backward()\n"
           "print(powernorm_fairseq.__file__, compiled.load().__name__)\n")
    proc = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(target), "TORCH_EXTENSIONS_DIR": str(fresh)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, module = proc.stdout.split()
    assert where.startswith(str(target)) and module == "powernorm_fairseq.norms.kernels._C"
    assert not fresh.exists()  # nothing built on first use


@pytest.mark.fast
def test_installed_kernels_of_another_source_are_not_used(monkeypatch, caplog):
    from powernorm_fairseq.norms.kernels import compiled

    backend_or_fail("cpu")
    assert compiled.installed() is not None  # scripts/setup.sh built them
    monkeypatch.setattr(compiled, "source_digest", lambda: "srcanother")
    with caplog.at_level("INFO"):
        assert compiled.installed() is None
    assert "built from another csrc/" in caplog.text
    monkeypatch.undo()
    monkeypatch.setenv("POWERNORM_JIT", "1")  # asks for a build for this machine
    assert compiled.installed() is None


def fresh_build_directory(root, monkeypatch):
    """(a JIT environment with its extensions directory under ``root``, the
    kernels' build directory there, made), for this process and its children,
    whose builds are unoptimised (their code strings start with QUICK)."""
    from powernorm_fairseq.norms.kernels import compiled

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.setattr(compiled, "JIT_CFLAGS", QUICK_CFLAGS)
    build = compiled.build_directory()
    build.mkdir(parents=True)
    return {**JIT, "TORCH_EXTENSIONS_DIR": str(root)}, build


@pytest.mark.slow
def test_a_stale_lock_is_cleared_and_a_run_waits_for_another_build(tmp_path, monkeypatch):
    """In a fresh extensions directory: a build killed before its first
    success left torch's ``lock`` (torch's loader would wait for it forever);
    the next run removes it, builds, and the norm runs on the kernels. Then a
    run that finds another process building says so, waits, and proceeds once
    the build is done. (One test: the second needs the first's build.)"""
    import fcntl
    import time

    backend_or_fail("cpu")
    env, build = fresh_build_directory(tmp_path, monkeypatch)
    (build / "lock").touch()
    norm_run = (QUICK + "import torch\nfrom powernorm_fairseq.norms import build_norm, kernels\n"
                "x = torch.randn(3, 2, 8)\n"
                "build_norm('pn', 8).train()(x).sum().backward()\n"
                "print(kernels.describe(x))\n")
    first = subprocess.run([sys.executable, "-c", norm_run], capture_output=True, text=True, env=env, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "left by a kernel build that was interrupted" in first.stderr and not (build / "lock").exists()
    assert first.stdout.strip().splitlines()[-1] == "cpu", first.stderr[-2000:]  # built, and used

    with open(build / "powernorm-build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process "building"
        proc = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        line, deadline = "", time.time() + 120
        while "waiting" not in line and time.time() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
        assert "waiting for another process to build the CPU kernels (lock" in line, line
        assert proc.poll() is None  # still waiting while the lock is held
    out, err = proc.communicate(timeout=300)  # released: it proceeds
    assert proc.returncode == 0 and out.strip() == "loaded", err[-2000:]


@pytest.mark.slow
def test_a_build_that_never_ends_is_waited_for_a_bounded_time_then_the_norm_runs_plain(tmp_path, monkeypatch):
    """In an extensions directory of its own, where only the hanging build is under way."""
    import fcntl

    env, build = fresh_build_directory(tmp_path, monkeypatch)
    norm_run = (QUICK + "import torch\nfrom powernorm_fairseq.norms import build_norm\n"
                "print(build_norm('bn', 8).train()(torch.randn(3, 2, 8)).shape)\n")
    with open(build / "powernorm-build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build that hangs
        proc = cli("python", "-c", norm_run, check=False, timeout=300, environ={**env, "POWERNORM_BUILD_WAIT": "2"})
    assert proc.returncode == 0 and "torch.Size([3, 2, 8])" in proc.stdout, proc.stderr[-2000:]
    assert "at most 2 s" in proc.stderr
    assert "norms run on the plain PyTorch path (cpu kernels unavailable: TimeoutError" in proc.stderr


@pytest.mark.parametrize("backend", kernels.BACKENDS)
@pytest.mark.parametrize("mean", [100.0, 1000.0])
def test_float32_bn_statistics_hold_off_centre(backend, mean):
    """Channels whose mean is large next to their spread (std 1): float32 BN
    is at most twice as far from float64 as torch's own F.batch_norm on the
    same input, in output and input gradient (a one-pass E[x^2] - mean^2 was
    100 to 1000 times worse)."""
    backend_or_fail(backend)
    g = torch.Generator().manual_seed(3)
    x64 = torch.randn(40, 16, 24, generator=g, dtype=torch.float64) + mean
    grad64 = torch.randn(40, 16, 24, generator=g, dtype=torch.float64)
    pad = torch.zeros(16, 40, dtype=torch.bool)
    pad[4:, 30:] = True
    grad64[pad.t()] = 0

    def ours(x):
        x = x.clone().requires_grad_(True)
        with kernels.use(backend if x.dtype == torch.float32 else "plain"):
            y = build_norm("bn", 24).to(x.dtype).train()(x, pad)
        y.backward(grad64.to(x.dtype))
        return y.detach(), x.grad

    def torchs(x):
        rows = x[~pad.t()].clone().requires_grad_(True)
        y = F.batch_norm(rows, None, None, training=True)
        y.backward(grad64[~pad.t()].to(x.dtype))
        return y.detach(), rows.grad

    (y64, g64), (y32, g32) = ours(x64), ours(x64.float())
    (t64, tg64), (t32, tg32) = torchs(x64), torchs(x64.float())
    real = ~pad.t()
    assert scaled_error(y32[real], y64[real]) <= 2 * scaled_error(t32, t64)
    assert scaled_error(g32[real], g64[real]) <= 2 * scaled_error(tg32, tg64)


def test_every_backend_keeps_the_contract():
    """The CPU module (as compiled), the GPU backend and the plain one take
    the contract's arguments by name (the compiled one with their types), and
    the C++ enumerations have the contract's values; a backend that drifts is
    refused, naming the function."""
    import re
    import types

    from powernorm_fairseq.norms.kernels import compiled, contract, plain

    backend_or_fail("cpu")
    contract.check(compiled.load(), "compiled cpu")
    contract.check(gpu, "triton")
    contract.check(plain, "plain")
    source = (Path(compiled.__file__).parent / "csrc" / "cpu_channel.h").read_text()
    for enum in (contract.Update, contract.Mode):
        body = re.search(rf"enum {enum.__name__} : int64_t {{(.*?)}};", source).group(1)
        names = {n.strip(): int(v) for n, v in (item.split("=") for item in body.split(","))}
        assert names == {("REFERENCE_RUN" if m.name == "REFERENCE" and enum is contract.Update else m.name): m.value
                         for m in enum}
    typed = types.SimpleNamespace(**{name: getattr(compiled.load(), name) for name in contract.CONTRACT})
    typed.finish_stats = type("Compiled", (), {"__doc__": compiled.load().finish_stats.__doc__.replace(
        "update: typing.SupportsInt | typing.SupportsIndex", "update: str").replace("update: int", "update: str")})()
    with pytest.raises(TypeError, match=r"the typed kernels' finish_stats takes types .*'str'.* the contract"):
        contract.check(typed, "typed")
    assert contract.argument_names(compiled.load().backward) == contract.CONTRACT["backward"]
    drifted = types.SimpleNamespace(**{name: getattr(plain, name) for name in contract.CONTRACT})
    drifted.backward = lambda x, mask, scale, grad_y, weight, mean, inv_fwd, inv_bwd, B, A, b_scale, groups, \
        correct_pads, want_gx, want_sums: None  # A and B swapped
    with pytest.raises(TypeError, match=r"the drifted kernels' backward takes .*'B', 'A'.* the contract"):
        contract.check(drifted, "drifted")
