"""One step off the main path, every norm still gives the float64 reference's
numbers, or one clear error, on every backend: batches of padding, strided
masks, torch.compile and torch.export, a lone real token, double backward,
activation checkpointing, causal decoders, layouts and masks, concurrent or
aborted launches, long reductions, and torch's module conventions."""

import copy
import logging

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import reference as ref
from support import backend_or_fail
from powernorm_fairseq.norms import NORM_TYPES, RUNNING_STAT_TYPES, build_norm, kernels, padding_mask
from powernorm_fairseq.norms.base import Norm
from powernorm_fairseq.norms.kernels import launcher
from powernorm_fairseq.norms.kernels.contract import ROW_KINDS

pytestmark = pytest.mark.fast

BACKENDS = ["plain", "cpu", "triton"]
T, B, C = 9, 4, 16
#: the kinds with kernels, and the options that reach their distinct paths
FUSED = [("bn", {}), ("pn-v", {}), ("pn", {"warmup_updates": 2}), ("scalenorm", {}), ("rmsnorm", {}), ("dyt", {}),
         ("derf", {})]
FUSED_IDS = [k for k, _ in FUSED]
#: the fused kinds whose backward is differentiable again (their descriptors' ``twice``)
TWICE = sorted(k for k, kind in ROW_KINDS.items() if kind.twice is not None)
STATS = FUSED[:3]


def data(seed, dtype=torch.float64, pad_all=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, C, generator=g, dtype=torch.float64) * 1.5 + 0.3
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    if pad_all:
        pad[:] = True
    dy = torch.randn(T, B, C, generator=g, dtype=torch.float64)
    dy[pad.t()] = 0
    return x.to(dtype), pad, dy.to(dtype)


def run(norm, backend, batches, dtype=torch.float64):
    """y, dL/dx, parameter gradients and buffers after each training step."""
    out = []
    with kernels.use(backend):
        for x, pad, dy in batches:
            x = x.detach().to(dtype).clone().requires_grad_(True)
            norm.zero_grad()
            y = norm(x, pad)
            y.backward(dy.to(dtype))
            out.append([y.detach(), x.grad.clone()] + [p.grad.clone() for p in norm.parameters()]
                       + [b.clone() for b in norm.buffers()])
    return out


# 1: a batch of padding is not a step, anywhere; a resumed run is the uninterrupted one
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_of_padding_is_no_step_and_resuming_changes_nothing(backend):
    backend_or_fail(backend)
    batches = [data(0), data(1, pad_all=True), data(2), data(3), data(4)]
    reference = ref.PaperPN(C, warmup=2)
    norm = build_norm("pn", C, warmup_updates=2).double().train()
    with kernels.use(backend):
        for i, (x, pad, dy) in enumerate(batches):
            xr = x.clone().requires_grad_(True)
            y = norm(xr, pad)
            y.backward(dy)
            if pad.all():  # nothing updated, nothing counted; the running psi^2 normalises
                want = x / torch.sqrt(reference.psi2 + 1e-5)
            else:
                want, want_dx, want_dw = reference.step(x, pad, torch.ones(C, dtype=torch.float64),
                                                        torch.zeros(C, dtype=torch.float64), dy)
                torch.testing.assert_close(xr.grad, want_dx, rtol=1e-9, atol=1e-10, msg=f"dx step {i}")
            torch.testing.assert_close(y, want, rtol=1e-9, atol=1e-10, msg=f"y step {i}")
            torch.testing.assert_close(norm.running_psi2, reference.psi2, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(norm.running_nu, reference.nu, rtol=1e-9, atol=1e-12)
    assert int(norm.num_steps) == 4
    # the same run cut after the batch of padding and resumed from its state dict: bit for bit
    whole = build_norm("pn", C, warmup_updates=2).double().train()
    first = run(whole, backend, batches)
    cut = build_norm("pn", C, warmup_updates=2).double().train()
    run(cut, backend, batches[:2])
    resumed = build_norm("pn", C, warmup_updates=2).double().train()
    resumed.load_state_dict(cut.state_dict())
    again = run(resumed, backend, batches[2:])
    for a, b in zip(first[2:], again):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


# 2: a mask that is a slice of a larger one
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, options", STATS, ids=FUSED_IDS[:3])
def test_a_strided_mask_reads_as_its_contiguous_copy(backend, kind, options):
    backend_or_fail(backend)
    x, pad, dy = data(5)
    big = torch.ones(B, T + 5, dtype=torch.bool)
    big[:, :T] = pad
    outs = []
    for mask in (pad, big[:, :T]):
        norm = build_norm(kind, C, **options).double().train()
        outs.append(run(norm, backend, [(x, mask, dy)] * 3))
    for a, b in zip(*outs):
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-13)


# 3 and 9: torch.compile, one graph per phase and no break, whatever the mask's dtype
class Counting:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example):
        self.graphs += 1
        return gm.forward


# a compile takes a second: the fast tier keeps the bool mask of pn (its three phases), the full
# suite every kind with a bool mask, and the 0/1 masks (converted in Norm.forward, one code for every
# kind) where the kind reads the mask: the kinds with running statistics
COMPILED_MASKS = [pytest.param(kind, torch.bool, id=f"{kind}-bool", marks=() if kind == "pn" else pytest.mark.slow)
                  for kind in NORM_TYPES]
COMPILED_MASKS += [pytest.param(kind, dtype, id=f"{kind}-{name}", marks=pytest.mark.slow)
                   for kind in RUNNING_STAT_TYPES for dtype, name in ((torch.int64, "int"), (torch.float32, "float"))]


@pytest.mark.parametrize("kind, mask_dtype", COMPILED_MASKS)
def test_twenty_compiled_steps_compile_once_per_phase(kind, mask_dtype):
    torch._dynamo.reset()
    options = {"warmup_updates": 3} if kind == "pn" else {}
    norm = build_norm(kind, C, **options).train()
    counting = Counting()
    step = torch.compile(lambda x, m: norm(x, attention_mask=m, batch_first=True), backend=counting,
                         fullgraph=True)
    phases = []
    with kernels.use("cpu"):
        for i in range(20):
            x, pad, _ = data(i, torch.float32)
            xb = x.transpose(0, 1).contiguous().requires_grad_(True)
            step(xb, (~pad).to(mask_dtype)).sum().backward()
            phases.append(counting.graphs)
        norm.eval()
        for i in range(3):
            x, pad, _ = data(i, torch.float32)
            step(x.transpose(0, 1), (~pad).to(mask_dtype))
    phases.append(counting.graphs)
    assert counting.graphs <= (3 if kind == "pn" else 2), phases  # warmup, training, eval
    if kind == "pn":
        assert phases[2] == 1 and phases[3] == 2 and phases[19] == 2, phases  # the warmup's end, once
        assert int(norm.num_steps) == 20


#: 12 steps over 8 sequence lengths, as fairseq's batches come
LENGTHS = [5, 9, 6, 12, 7, 5, 10, 8, 11, 6, 12, 9]


class LinearThenNorm(torch.nn.Module):
    def __init__(self, kind, batch_first, **options):
        super().__init__()
        self.linear, self.norm, self.batch_first = torch.nn.Linear(C, C), build_norm(kind, C, **options), batch_first

    def forward(self, x, mask):
        if self.batch_first:  # (B, T, C) with HuggingFace's 0/1 attention mask
            return self.norm(self.linear(x), attention_mask=mask)
        return self.norm(self.linear(x), mask)


# the batch-statistic kinds and dyt (the newest fused kind) on every backend (the per-program sums once
# followed the row count), the per-row ones on one: a length is a dynamic dimension of the graph, not a new
# graph; pn also batch-first with a 0/1 mask, the other layout and mask Norm.forward takes
VARYING = [(kind, backend, "tbc-bool") for kind in ("pn", "bn", "pn-v", "dyt") for backend in BACKENDS]
VARYING += [("derf", backend, "tbc-bool") for backend in ("cpu", "triton")]
VARYING += [(kind, "cpu", "tbc-bool") for kind in ("ln", "scalenorm", "rmsnorm")]
VARYING += [("pn", backend, "btc-int") for backend in BACKENDS]
# rbn: bn's kernels and a penalty in plain PyTorch, whose value and gradient must be eager's too
VARYING += [("rbn", backend, "btc-int") for backend in BACKENDS]
# unit-offset gains (a constant of the graph): a channel kind, an entry kind and torch's ln
VARYING += [("pn", "triton", "btc-int-offset"), ("derf", "cpu", "tbc-bool-offset"), ("ln", "cpu", "tbc-bool-offset")]


@pytest.mark.slow
@pytest.mark.parametrize("kind, backend, layout", VARYING, ids=["-".join(v) for v in VARYING])
def test_compiled_steps_at_lengths_that_vary_compile_two_graphs_and_match_eager(kind, backend, layout):
    """torch.compile over 12 batches of 8 lengths: at most 2 graphs (the first
    length's, then a dynamic one), with eager's numbers, running statistics included
    (and rbn's penalty, with its gradient, in the loss)."""
    from powernorm_fairseq.norms.rbn import regularization

    backend_or_fail(backend)
    torch._dynamo.reset()
    torch.manual_seed(0)
    batch_first = layout.startswith("btc-int")
    compiled = LinearThenNorm(kind, batch_first, **({"unit_offset": True} if layout.endswith("offset") else {}))
    compiled.train()
    eager = copy.deepcopy(compiled)
    counting = Counting()
    step = torch.compile(compiled, backend=counting, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    with kernels.use(backend):
        for length in LENGTHS:
            x, dy = torch.randn(length, B, C, generator=g), torch.randn(length, B, C, generator=g)
            pad = torch.arange(length)[None, :] >= torch.randint(1, length + 1, (B,), generator=g)[:, None]
            mask = pad
            if batch_first:
                x, dy, mask = x.transpose(0, 1).contiguous(), dy.transpose(0, 1).contiguous(), (~pad).long()
            outs = []
            for model, call in ((eager, eager), (compiled, step)):
                xr = x.clone().requires_grad_(True)
                model.zero_grad()
                y = call(xr, mask)
                loss, penalty = (y * dy).sum(), regularization(model)
                assert (penalty is not None) == (kind == "rbn")
                (loss if penalty is None else loss + penalty).backward()
                outs.append([y.detach(), xr.grad] + [p.grad for p in model.parameters()] + list(model.buffers())
                            + ([penalty.detach()] if penalty is not None else []))
            for a, b in zip(*outs):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert counting.graphs <= 2, counting.graphs


@pytest.mark.slow
def test_a_model_of_twelve_pn_layers_runs_compiled():
    torch._dynamo.reset()
    model = torch.nn.Sequential(*[build_norm("pn", C, warmup_updates=2) for _ in range(12)]).train()
    counting = Counting()
    step = torch.compile(model, backend=counting, fullgraph=True)
    with kernels.use("cpu"):
        for i in range(8):
            x = data(i, torch.float32)[0].reshape(-1, C).requires_grad_(True)
            step(x).sum().backward()
    assert counting.graphs == 2 and all(int(m.num_steps) == 8 for m in model)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64], ids=["bool", "int"])
def test_torch_export_of_a_masked_norm(mask_dtype):
    norm = build_norm("bn", C).eval()

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def forward(self, x, m):
            return self.norm(x, attention_mask=m, batch_first=True)

    x, pad, _ = data(0, torch.float32)
    xb, m = x.transpose(0, 1).contiguous(), (~pad).to(mask_dtype)
    exported = torch.export.export(Masked(), (xb, m))
    torch.testing.assert_close(exported.module()(xb, m), Masked()(xb, m))
    if mask_dtype != torch.bool:
        with pytest.raises(Exception, match="values other than 0 and 1"):
            exported.module()(xb, m * 2)


# 4: one real token among many: a variance of 0, inv = 1 / sqrt(eps)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer_scale", [False, True], ids=["plain-bn", "layer-scale"])
def test_a_lone_real_token_gets_the_exact_gradient(backend, layer_scale):
    backend_or_fail(backend)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 1, 1000, generator=g) * 3
    pad = torch.ones(1, 20, dtype=torch.bool)
    pad[0, 7] = False
    dy = torch.randn(20, 1, 1000, generator=g)
    grads = []
    for dtype, be in ((torch.float64, "plain"), (torch.float32, backend)):
        norm = build_norm("bn", 1000, layer_scale=layer_scale, groups=4).to(dtype).train()
        xr = x.to(dtype).requires_grad_(True)
        with kernels.use(be):
            norm(xr, pad).backward(dy.to(dtype))
        grads.append(xr.grad.double())
    exact, got = grads
    assert float((got - exact).abs().max() / exact.abs().max()) < 1e-5


# 5: a second derivative raises, identically; DyT's and Derf's are PyTorch's own
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, options", [f for f in FUSED if f[0] not in TWICE],
                         ids=[k for k in FUSED_IDS if k not in TWICE])
def test_double_backward_raises_on_every_backend(backend, kind, options):
    backend_or_fail(backend)
    x, pad, _ = data(6)
    norm = build_norm(kind, C, **options).double().train()
    xr = x.requires_grad_(True)
    with kernels.use(backend), pytest.raises(RuntimeError, match=r"^\S.* ha(ve|s) no second derivative here"):
        torch.autograd.grad(norm(xr, pad).pow(2).sum(), xr, create_graph=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", TWICE)
def test_dyt_and_derf_have_their_second_derivative_on_every_backend(kind, backend):
    """The fused DyT's and Derf's backward, asked for a graph, is differentiable again: gradgradcheck
    in x, the scalars and the gain, the kernels' forward beneath it."""
    backend_or_fail(backend)
    norm = build_norm(kind, C).double().train()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(C, generator=g, dtype=torch.float64))
        if kind == "derf":
            norm.shift.fill_(0.2)
    x = data(6)[0][:3, :2].clone().requires_grad_(True)
    names = [n for n in ROW_KINDS[kind].params if n != "bias"]  # the bias's gradient is dy's sum: linear
    params = [getattr(norm, n).detach().clone().requires_grad_(True) for n in names]

    def layer(x, *params):
        return torch.func.functional_call(norm, dict(zip(names, params)), (x,))

    with kernels.use(backend):
        assert torch.autograd.gradgradcheck(layer, (x, *params), fast_mode=True)


# 6: activation checkpointing: the recomputation updates nothing and replays the first forward
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bn", "pn-v", "pn", "bn-original", "rbn", "rmsnorm", "dyt", "derf"])
def test_checkpointed_equals_not_checkpointed(kind, backend, reentrant):
    """rbn's penalty too, which the reentrant checkpoint's first forward computes without autograd:
    refused in one line, where the non-reentrant one keeps it. The second norm's gain has a unit offset."""
    from powernorm_fairseq.norms.rbn import regularization

    backend_or_fail(backend)
    options = {"warmup_updates": 2} if kind == "pn" else {}
    results = []
    for use in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(C, C).double()
        norms = [build_norm(kind, C, **options, unit_offset=i == 1).double().train() for i in range(2)]

        def block(x, pad):
            return norms[1](lin(norms[0](x, pad)), pad)

        with kernels.use(backend):
            for i in range(4):
                x, pad, dy = data(10 + i)
                x.requires_grad_(True)
                y = checkpoint.checkpoint(block, x, pad, use_reentrant=reentrant) if use else block(x, pad)
                loss = (y * dy).sum()
                if kind == "rbn" and use and reentrant:
                    with pytest.raises(RuntimeError, match="rbn: a penalty was computed without autograd"):
                        regularization(torch.nn.ModuleList(norms))
                    return
                (loss if kind != "rbn" else loss + regularization(torch.nn.ModuleList(norms))).backward()
        results.append([t.clone() for n in norms for t in (*n.buffers(), *(p.grad for p in n.parameters()))]
                       + [lin.weight.grad.clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


# 7: causal decoders
def leak(norm, backend):
    """The largest change of a training step's outputs at positions 0-7 when
    only positions >= 8 change (two steps from the same state)."""
    x, pad, _ = data(7)
    pad[:] = False
    x2 = x.clone()
    x2[8:] = torch.randn_like(x2[8:]) * 5
    with kernels.use(backend):
        a, b = copy.deepcopy(norm)(x, pad)[:8].detach(), copy.deepcopy(norm)(x2, pad)[:8].detach()
    return float((a - b).abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, options", STATS, ids=FUSED_IDS[:3])
def test_the_causal_mode_leaks_nothing(backend, kind, options):
    backend_or_fail(backend)
    leaky = build_norm(kind, C, **options).double().train()
    assert leak(leaky, backend) > 0.1  # batch statistics: the future reaches position 0
    causal = build_norm(kind, C, causal=True, **options).double().train()
    assert leak(causal, backend) == 0.0
    causal(data(1)[0], data(1)[1]).sum().backward()  # trains: running statistics follow the batches
    assert leak(causal, backend) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_pn_after_its_warmup_leaks_nothing(backend):
    backend_or_fail(backend)
    norm = build_norm("pn", C, warmup_updates=1).double().train()
    with kernels.use(backend):
        norm(*data(0)[:2]).sum().backward()
    assert leak(norm, backend) == 0.0


def test_a_leaking_norm_in_a_causal_decoder_warns_once(caplog):
    Norm._warned.discard("bn")
    norm = build_norm("bn", C).train()
    norm.in_causal_decoder = True
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            norm(*data(i, torch.float32)[:2])
    lines = [r.getMessage() for r in caplog.records if "causal decoder" in r.getMessage()]
    assert len(lines) == 1 and lines[0].count("\n") == 0 and "bn in a causal decoder" in lines[0]
    assert "--norm-causal" in lines[0]


# 8 and 10: layouts
@pytest.mark.parametrize("kind", NORM_TYPES)
def test_attention_mask_means_batch_first_and_a_square_input_is_refused(kind):
    norm = build_norm(kind, C).double().train()
    g = torch.Generator().manual_seed(0)
    square = torch.randn(6, 6, C, generator=g, dtype=torch.float64)
    attention = torch.ones(6, 6, dtype=torch.long)
    attention[1, 4:] = 0
    with pytest.raises(ValueError, match="pass batch_first=True .HuggingFace's layout. or batch_first=False"):
        norm(square, attention_mask=attention)
    torch.testing.assert_close(norm.eval()(square, attention_mask=attention, batch_first=True),
                               norm(square.transpose(0, 1), attention == 0).transpose(0, 1))
    wide = torch.randn(2, 6, C, generator=g, dtype=torch.float64)  # (B, T, C), B != T: HF's layout by default
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 5] = 0
    torch.testing.assert_close(norm(wide, attention_mask=mask),
                               norm(wide.transpose(0, 1), mask == 0).transpose(0, 1))


@pytest.mark.parametrize("kind", ["bn", "pn", "rmsnorm"])
def test_padding_mask_serves_both_layouts(kind):
    x, pad, _ = data(8)
    norms = [build_norm(kind, C).double().train() for _ in range(2)]
    want = norms[0](x, pad).transpose(0, 1)
    with padding_mask(norms[1], attention_mask=(~pad).long(), batch_first=True):
        got = norms[1](x.transpose(0, 1))
    torch.testing.assert_close(got, want)
    assert norms[1].pad_mask is None


# 11: each launch counts its own arrivals
#: where each finishing kernel takes its arrival ticket (the argument index)
TICKET_ARGUMENT = {"_finish_stats": 10, "_finish_backward": 10, "_scalenorm_backward": 7, "_rmsnorm_backward": 7,
                   "_dyt_backward": 9, "_derf_backward": 11}


@pytest.mark.parametrize("kind, options", FUSED, ids=FUSED_IDS)
def test_an_aborted_finishing_grid_leaves_later_steps_right(kind, options, monkeypatch):
    """After a step, each ticket its finishing kernels counted in is left as
    an aborted grid would leave it (one more arrival): the later steps still
    commit their statistics and gradients, as no later launch counts there."""
    backend_or_fail("triton")
    used, launch = {}, launcher.launch

    def noting(kernel, grid, *args, **constexprs):
        name = kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__
        if name in TICKET_ARGUMENT:
            used[name] = args[TICKET_ARGUMENT[name]]
        launch(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(launcher, "launch", noting)
    with launcher.watching():
        _aborted_grids(kind, options, used)


def _aborted_grids(kind, options, used):
    outs = []
    for backend in ("plain", "triton"):
        norm = build_norm(kind, C, **options).train()
        outs.append(run(norm, backend, [data(0, torch.float32)], torch.float32))
        for ticket in used.values():
            ticket += 1  # an arrival whose grid then died
        outs[-1] += run(norm, backend, [data(i, torch.float32) for i in range(1, 4)], torch.float32)
    assert used  # the finishing kernels ran
    for a, b in zip(*outs):
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


# 11b: the two routes: the eager one (the C++ autograd node) and the graph one (each pass through its op)
@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("kind, options", FUSED, ids=FUSED_IDS)
def test_the_eager_and_the_graph_route_give_the_same_step(backend, kind, options, monkeypatch):
    """The C++ node's step and the ops' step (what torch.compile, --norm-sync and a mode see), bit for
    bit, over PN's warmup and a batch of padding, on x and on its transposed (B, T, C) view."""
    from powernorm_fairseq.norms.kernels import functions

    backend_or_fail(backend)
    batches = [data(0), data(1, pad_all=True), data(2), data(3)]
    batches += [(x.transpose(0, 1).contiguous().transpose(0, 1), pad, dy) for x, pad, dy in batches[2:]]
    outs = [run(build_norm(kind, C, **options).double().train(), backend, batches)]
    monkeypatch.setattr(functions, "_eager", lambda values: None)
    outs.append(run(build_norm(kind, C, **options).double().train(), backend, batches))
    for step, (a, b) in enumerate(zip(*outs)):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), (kind, step)


# 11d: a module's step configuration (made once) follows every change of what it holds
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bn", "pn-v", "pn"])
def test_the_step_configuration_follows_each_change_of_the_module(backend, kind):
    """A setting set, a running buffer replaced, a state dict loaded, the module cast and moved back: the
    next step equals a fresh module's with the same settings and state, on the eager and the graph route."""
    backend_or_fail(backend)
    options = {"warmup_updates": 1} if kind == "pn" else {}
    buffer = {"bn": "running_var", "pn-v": "running_psi2", "pn": "running_psi2"}[kind]

    def fresh(norm):
        other = build_norm(kind, C, **options).double().train()
        other.load_state_dict(norm.state_dict())
        other.eps = norm.eps
        return other

    def set_eps(norm):
        norm.eps = 1e-2

    def replace_buffer(norm):
        setattr(norm, buffer, getattr(norm, buffer) * 2 + 0.5)

    def load(norm):
        other = build_norm(kind, C, **options).double().train()
        run(other, backend, [data(7), data(8)])
        norm.load_state_dict(other.state_dict())

    def cast(norm):
        norm.float().double()

    norm = build_norm(kind, C, **options).double().train()
    run(norm, backend, [data(0)])  # its configuration made
    for i, change in enumerate((set_eps, replace_buffer, load, cast), 1):
        change(norm)
        want = run(fresh(norm), backend, [data(i)])
        got = run(norm, backend, [data(i)])
        for u, v in zip(got[0], want[0]):
            torch.testing.assert_close(u, v, rtol=0, atol=0, msg=f"{kind} after {change.__name__}")
    # torch.func.functional_call swaps the entries of _buffers: the step updates the buffer it was given
    own, given = getattr(norm, buffer).clone(), getattr(norm, buffer) * 3
    before = given.clone()
    x, pad, _ = data(9)
    with kernels.use(backend):
        torch.func.functional_call(norm, {buffer: given}, (x, pad))
    assert torch.equal(getattr(norm, buffer), own) and not torch.equal(given, before), kind


# 11c: torch's convention: a norm's output takes in-place ops, with the gradient of their out-of-place form
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, options", FUSED, ids=FUSED_IDS)
def test_an_in_place_op_on_the_output_keeps_the_gradient(backend, kind, options):
    backend_or_fail(backend)
    x, pad, dy = data(0)
    grads = []
    for in_place in (False, True):
        norm = build_norm(kind, C, **options).double().train()
        xr = x.clone().requires_grad_(True)
        with kernels.use(backend):
            y = norm(xr, pad)
            y = y.mul_(3.0) if in_place else y * 3.0
        y.backward(dy)
        grads.append(xr.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


# 12: long reductions
@pytest.mark.slow
def test_triton_sums_a_long_row_range_in_float64():
    """No program sums more than gpu.MAX_ROWS rows in float32: a long input gets more programs, whose
    sums the finishing kernel adds in float64."""
    backend_or_fail("triton")
    g = torch.Generator().manual_seed(0)
    x = 1.0 + 1e-3 * torch.randn(30_000, 4, generator=g, dtype=torch.float64)
    P = torch.ops.powernorm
    none = torch.empty(0)
    _, _, part = P.forward("triton", x.float(), torch.empty(0, dtype=torch.bool), 0, 1e-5, none, none, -1.0, none,
                           0.0, none, False, True, False)
    assert part.size(0) - 1 >= 30_000 / 1024
    got, want = part[:-1, 2].double().sum(0), (x.float().double() ** 2).sum(0)
    # without the split (4 programs of 7,500 rows each, in float32): 2.2e-7
    assert float(((got - want) / want).abs().max()) < 3e-8


# 13: an unknown update or kind is refused by every backend
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unknown_update_is_refused(backend):
    backend_or_fail(backend)
    P = torch.ops.powernorm
    part, buf, none = torch.ones(1 + (backend == "triton"), 3, 4, dtype=torch.float64), torch.ones(4), torch.empty(0)
    with pytest.raises((ValueError, RuntimeError), match=r"unknown update 9 \(contract.py's Update: 0 to 5\)"):
        P.finish_stats(backend, part, none, buf, torch.zeros((), dtype=torch.long), 9, 0.1, 1e-5, 0, -1)
    with pytest.raises((ValueError, RuntimeError), match=r"unknown mode 7 \(contract.py's Mode: 0 to 3\)"):
        P.finish_backward(backend, torch.ones(1 + (backend == "triton"), 5, 4, dtype=torch.float64), buf, 0.0,
                          torch.ones(1, dtype=torch.float64), torch.zeros(4), 0.1, 7, False, 8)


# torch's conventions: device= and dtype=, reset_parameters(), reset_running_stats()
@pytest.mark.parametrize("kind", NORM_TYPES)
def test_torch_module_conventions(kind):
    norm = build_norm(kind, C, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in norm.parameters())
    fresh = {k: v.clone() for k, v in norm.state_dict().items()}
    norm.train()
    with kernels.use("plain"):
        for i in range(2):
            x, pad, _ = data(i)
            norm(x.requires_grad_(True), pad).sum().backward()
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.5)
    norm.reset_parameters()
    norm.reset_running_stats()
    for key, value in norm.state_dict().items():
        torch.testing.assert_close(value, fresh[key], msg=key)
