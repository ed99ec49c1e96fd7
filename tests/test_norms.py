"""The norm library against independent references of its formulas."""

import copy

import pytest
import torch

import reference as ref
from support import backend_or_fail
from powernorm_fairseq.norms import GAIN_TYPES, NORM_TYPES, RUNNING_STAT_TYPES, build_norm, kernels

pytestmark = pytest.mark.fast

T, B, C = 9, 4, 8


@pytest.fixture(autouse=True, params=kernels.BACKENDS)
def path(request):
    """Every check runs on each backend: the plain PyTorch path, the CPU C++
    kernels and the GPU (Triton) kernels, the latter under Triton's interpreter."""
    backend_or_fail(request.param)
    with kernels.use(request.param):
        yield request.param


def batch(seed, dtype=torch.float64, T=T, B=B):
    """x (T, B, C) with ragged padding, its mask (B, T) and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, C, generator=g, dtype=dtype) * 2 + 0.5
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    grad_y = torch.randn(T, B, C, generator=g, dtype=dtype)
    grad_y[pad.t()] = 0  # the loss never sees padded positions
    return x, pad, grad_y


def affine(norm, seed=0):
    """Random gamma/beta so that their gradients matter in the checks."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if isinstance(getattr(norm, "scale", None), torch.nn.Parameter):  # ScaleNorm: one scalar
            norm.scale.mul_(1.3)
        if hasattr(norm, "weight"):
            norm.weight.copy_(1 + 0.3 * torch.randn(C, generator=g, dtype=norm.weight.dtype))
        if hasattr(norm, "bias"):
            norm.bias.copy_(0.1 * torch.randn(C, generator=g, dtype=norm.bias.dtype))
        if hasattr(norm, "shift"):  # Derf's, off its start of 0
            norm.shift.fill_(0.2)
    return norm


def run(norm, x, pad, grad_y):
    x = x.clone().requires_grad_(True)
    y = norm(x, pad)
    y.backward(grad_y)
    return y.detach(), x.grad


def test_registry_is_the_source_of_kinds_options_and_running_statistics():
    """Each norm class declares its options from the flags and whether it keeps
    running statistics; the model, the diagnostics and these tests derive from that."""
    from argparse import Namespace

    from powernorm_fairseq.models.diagnostics import NormDiagnostics
    from powernorm_fairseq.modules.transformer_layer import norm_options

    assert RUNNING_STAT_TYPES == ("bn", "pn", "pn-v", "bn-original", "rbn")
    assert {cls for cls in NormDiagnostics.PROBED} == {build_norm(k, C).__class__ for k in RUNNING_STAT_TYPES}
    cfg = Namespace(norm_sync=None, norm_momentum=None, layer_scale=None, pn_group_scaling=None, pn_eps=1e-5,
                    pn_alpha_fwd=0.9, pn_alpha_bwd=0.9, pn_warmup_updates=3, pn_backward="paper",
                    adanorm_scale=1.0, detachnorm_detach="both", layernorm_simple_std="biased", norm_groups=None)
    for kind in NORM_TYPES:  # every kind builds from its declared options
        build_norm(kind, C, **norm_options(cfg, kind, heads=2))
    assert norm_options(cfg, "groupnorm", heads=2) == {"groups": 2}
    weights = norm_options(Namespace(**vars(cfg), rbn_penalty_mean=60.0, rbn_penalty_var=0.0), "rbn", heads=2)
    assert (weights["penalty_mean"], weights["penalty_var"]) == (60.0, 0.0)  # rbn's own flags reach it
    assert norm_options(cfg, "pn", heads=2)["layer_scale"] and not norm_options(cfg, "bn", heads=2)["layer_scale"]
    with pytest.raises(ValueError, match="unknown norm type 'rms'"):
        norm_options(cfg, "rms", heads=2)


def test_registry_and_unknown_kind():
    assert set(NORM_TYPES) == {"ln", "bn", "pn", "pn-v", "bn-original", "rbn", "scalenorm", "rmsnorm",
                               "layernorm-simple", "detachnorm", "adanorm", "groupnorm", "dyt", "derf", "none"}
    with pytest.raises(ValueError, match="unknown norm type 'rms'.*ln, bn, pn, pn-v, bn-original, rbn, scalenorm"):
        build_norm("rms", C)


@pytest.mark.parametrize("option, value", [("alpha_fwd", 1.0), ("alpha_bwd", 0.0), ("alpha_fwd", -0.5)])
def test_pn_rejects_alpha_outside_unit_interval(option, value):
    with pytest.raises(ValueError, match=rf"{option} must be in \(0, 1\)"):
        build_norm("pn", C, **{option: value})


def test_pn_rejects_bad_backward_and_groups():
    with pytest.raises(ValueError, match="backward must be 'paper' or 'reference'"):
        build_norm("pn", C, backward="exact")
    with pytest.raises(ValueError, match="groups must divide"):
        build_norm("pn", C, layer_scale=True, groups=3)


def test_layer_norm_matches_reference():
    norm = affine(build_norm("ln", C).double())
    x, pad, _ = batch(1)
    torch.testing.assert_close(norm(x, pad), ref.layer_norm(x, norm.weight, norm.bias))


def test_scale_norm_matches_reference_and_initial_scale():
    norm = build_norm("scalenorm", C).double()
    assert norm.scale.item() == pytest.approx(C ** 0.5)
    x, pad, _ = batch(2)
    x[0, 0] = 0  # the eps floor keeps a zero vector finite
    torch.testing.assert_close(norm(x, pad), ref.scale_norm(x, norm.scale))


def test_batch_norm_matches_reference_over_steps():
    norm = affine(build_norm("bn", C, momentum=0.2).double()).train()
    mean, var = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    for step in range(4):
        x, pad, grad_y = batch(10 + step)
        y, gx = run(norm, x, pad, grad_y)
        xr = x.clone().requires_grad_(True)
        y_ref, mu, unbiased = ref.batch_norm(xr, pad, norm.weight.detach(), norm.bias.detach())
        (gx_ref,) = torch.autograd.grad(y_ref, xr, grad_y)
        mean, var = 0.8 * mean + 0.2 * mu.detach(), 0.8 * var + 0.2 * unbiased.detach()
        torch.testing.assert_close(y, y_ref.detach())
        torch.testing.assert_close(gx, gx_ref)
        torch.testing.assert_close(norm.running_mean, mean)
        torch.testing.assert_close(norm.running_var, var)


def test_pn_v_matches_reference_over_steps():
    norm = affine(build_norm("pn-v", C, momentum=0.1).double()).train()
    psi2 = torch.ones(C, dtype=torch.float64)
    for step in range(4):
        x, pad, grad_y = batch(20 + step)
        y, gx = run(norm, x, pad, grad_y)
        xr = x.clone().requires_grad_(True)
        y_ref, psi_b2 = ref.pn_v(xr, pad, norm.weight.detach(), norm.bias.detach())
        (gx_ref,) = torch.autograd.grad(y_ref, xr, grad_y)
        psi2 = 0.9 * psi2 + 0.1 * psi_b2.detach()
        torch.testing.assert_close(y, y_ref.detach())
        torch.testing.assert_close(gx, gx_ref)
        torch.testing.assert_close(norm.running_psi2, psi2)


@pytest.mark.parametrize("warmup", [0, 2])
def test_pn_paper_backward_matches_algorithm_2(warmup):
    norm = affine(build_norm("pn", C, alpha_fwd=0.8, alpha_bwd=0.7, warmup_updates=warmup)).double()
    paper = ref.PaperPN(C, alpha_fwd=0.8, alpha_bwd=0.7, warmup=warmup)
    for step in range(6):
        x, pad, grad_y = batch(30 + step)
        norm.weight.grad = None
        y, gx = run(norm, x, pad, grad_y)
        y_ref, gx_ref, gw_ref = paper.step(x, pad, norm.weight.detach(), norm.bias.detach(), grad_y)
        torch.testing.assert_close(y, y_ref.detach())
        torch.testing.assert_close(gx, gx_ref)
        torch.testing.assert_close(norm.weight.grad, gw_ref)
        torch.testing.assert_close(norm.running_psi2, paper.psi2)
        torch.testing.assert_close(norm.running_nu, paper.nu)
    assert int(norm.num_steps) == 6
    assert norm.running_nu.abs().sum() > 0  # nu really moved


@pytest.mark.parametrize("warmup", [0, 3])
def test_pn_reference_backward_matches_released_code(warmup):
    norm = affine(build_norm("pn", C, warmup_updates=warmup, backward="reference")).double()
    released = ref.ReferencePN(C, warmup=warmup)
    for step in range(6):
        x, pad, grad_y = batch(40 + step)
        norm.weight.grad = None
        y, gx = run(norm, x, pad, grad_y)
        y_ref, gx_ref, gw_ref = released.step(x, pad, norm.weight.detach(), norm.bias.detach(), grad_y)
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(gx, gx_ref)
        torch.testing.assert_close(norm.weight.grad, gw_ref)
        torch.testing.assert_close(norm.running_psi2, released.psi2)
        torch.testing.assert_close(norm.running_nu, released.nu)


def test_pn_paper_and_reference_differ():
    """The two backward variants are not the same computation in disguise."""
    x, pad, grad_y = batch(50)
    grads = []
    for variant in ("paper", "reference"):
        norm = build_norm("pn", C, backward=variant).double()
        for _ in range(3):
            _, gx = run(norm, x, pad, grad_y)
        grads.append(gx)
    assert not torch.allclose(*grads)


@pytest.mark.parametrize("backward", ["paper", "reference"])
def test_pn_group_scaling_is_applied_before_pn(backward):
    groups = 4
    norm = build_norm("pn", C, layer_scale=True, groups=groups, backward=backward).double()
    plain = build_norm("pn", C, backward=backward).double()
    x, pad, grad_y = batch(60)
    xs = x.clone().requires_grad_(True)
    scaled = ref.group_scale(xs, groups)
    y_plain = plain(scaled, pad)
    y_plain.backward(grad_y)
    y, gx = run(norm, x, pad, grad_y)
    torch.testing.assert_close(y, y_plain.detach())
    torch.testing.assert_close(gx, xs.grad)
    torch.testing.assert_close(norm.running_psi2, plain.running_psi2)


@pytest.mark.parametrize("kind", ["bn", "pn-v"])
def test_layer_scale_is_applied_before_the_batch_statistics(kind):
    """--layer-scale for bn and pn-v (the paper's Appendix A): the norm of the
    group-scaled input, its gradient back through the scaling, and in eval the
    running statistics of the scaled input."""
    groups = 4
    norm = affine(build_norm(kind, C, layer_scale=True, groups=groups, momentum=0.1).double()).train()
    formula = ref.batch_norm if kind == "bn" else ref.pn_v
    for step in range(2):
        x, pad, grad_y = batch(61 + step)
        xs = x.clone().requires_grad_(True)
        y_ref, *stats = formula(ref.group_scale(xs, groups), pad, norm.weight.detach(), norm.bias.detach())
        y_ref.backward(grad_y)
        y, gx = run(norm, x, pad, grad_y)
        torch.testing.assert_close(y, y_ref.detach())
        torch.testing.assert_close(gx, xs.grad)
    norm.eval()
    x, _, _ = batch(63)
    xs = ref.group_scale(x, groups)
    if kind == "bn":
        expected = (xs - norm.running_mean) / torch.sqrt(norm.running_var + 1e-5)
    else:
        expected = xs / torch.sqrt(norm.running_psi2 + 1e-5)
    torch.testing.assert_close(norm(x, None), expected * norm.weight + norm.bias)
    with pytest.raises(ValueError, match="groups must divide"):
        build_norm(kind, C, layer_scale=True, groups=3)


def test_reference_nu_is_the_papers_scaled_by_one_over_one_minus_alpha():
    """Without padding or warmup the released update of nu is Algorithm 2's
    (Eq. 13) on another scale: (1 - alpha_bwd) nu_reference = nu_paper."""
    paper, released = (build_norm("pn", C, alpha_bwd=0.7, backward=b).double() for b in ("paper", "reference"))
    no_pad = torch.zeros(B, T, dtype=torch.bool)
    for step in range(6):
        x, _, grad_y = batch(160 + step)
        run(paper, x, no_pad, grad_y)
        run(released, x, no_pad, grad_y)
    assert paper.running_nu.abs().max() > 1e-3
    torch.testing.assert_close(0.3 * released.running_nu, paper.running_nu, rtol=1e-12, atol=1e-15)


def test_running_nu_is_converted_between_the_two_backwards():
    """The released code stores nu / (1 - alpha_bwd): a checkpoint of one
    backward loaded under the other gets its nu on the right scale, and a
    state dict from before the scale was recorded loads as it is."""
    paper = build_norm("pn", C, alpha_bwd=0.8).double()
    for step in range(3):
        run(paper, *batch(150 + step))
    state = paper.state_dict()
    assert float(state["nu_scale"]) == 1.0 and state["running_nu"].abs().sum() > 0
    released = build_norm("pn", C, alpha_bwd=0.8, backward="reference").double()
    released.load_state_dict(state)
    torch.testing.assert_close(released.running_nu, paper.running_nu / 0.2)
    assert float(released.nu_scale) == pytest.approx(5.0)
    back = build_norm("pn", C, alpha_bwd=0.8).double()
    back.load_state_dict(released.state_dict())
    torch.testing.assert_close(back.running_nu, paper.running_nu)
    older = {k: v for k, v in state.items() if k != "nu_scale"}
    as_saved = build_norm("pn", C, alpha_bwd=0.8, backward="reference").double()
    as_saved.load_state_dict(older)
    torch.testing.assert_close(as_saved.running_nu, paper.running_nu)


@pytest.mark.parametrize("kind", [k for k in NORM_TYPES if k != "bn-original"])
def test_padding_changes_nothing_for_real_tokens(kind):
    """Longer padding, filled with junk, gives the same real outputs and gradients."""
    x, pad, grad_y = batch(80)
    extra = 3
    x_long = torch.cat([x, 100 * torch.randn(extra, B, C, dtype=x.dtype)])
    pad_long = torch.cat([pad, torch.ones(B, extra, dtype=torch.bool)], dim=1)
    grad_long = torch.cat([grad_y, torch.zeros(extra, B, C, dtype=x.dtype)])
    outs = []
    for xi, pi, gi in ((x, pad, grad_y), (x_long, pad_long, grad_long)):
        torch.manual_seed(0)
        norm = affine(build_norm(kind, C).double()).train()
        for _ in range(3):  # several steps: running statistics and nu must agree too
            y, gx = run(norm, xi, pi, gi)
        keep = ~pi.t()
        outs.append((y[:T][keep[:T]], gx[:T][keep[:T]], {k: v.clone() for k, v in norm.state_dict().items()}))
    (y0, g0, s0), (y1, g1, s1) = outs
    torch.testing.assert_close(y0, y1)
    torch.testing.assert_close(g0, g1)
    for key in s0:
        torch.testing.assert_close(s0[key], s1[key])


@pytest.mark.parametrize("kind", RUNNING_STAT_TYPES)
def test_state_dict_round_trip_and_eval_uses_running_stats(kind):
    norm = affine(build_norm(kind, C).double()).train()
    for step in range(3):
        run(norm, *batch(90 + step))
    copy = build_norm(kind, C).double()
    copy.load_state_dict(norm.state_dict())
    norm.eval(), copy.eval()
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    x, pad, _ = batch(99)
    y = norm(x, pad)
    torch.testing.assert_close(copy(x, pad), y)
    for key, value in norm.state_dict().items():
        assert torch.equal(value, before[key]), f"eval changed {key}"
    # eval is per token: a token's output does not depend on the rest of the batch
    torch.testing.assert_close(norm(x[:, :1], pad[:1]), y[:, :1])


@pytest.mark.parametrize("kind", RUNNING_STAT_TYPES)
def test_all_padding_batch_leaves_state_and_gives_no_nan(kind):
    norm = build_norm(kind, C).train()
    run(norm, *batch(100, dtype=torch.float32))
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    x = torch.randn(T, B, C, requires_grad=True)
    y = norm(x, torch.ones(B, T, dtype=torch.bool))
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    for key, value in norm.state_dict().items():
        assert torch.equal(value, before[key]), f"all-pad batch changed {key}"


@pytest.mark.parametrize("kind", NORM_TYPES)
def test_half_precision_input_keeps_float32_statistics(kind):
    norm = build_norm(kind, C).train()
    x, pad, _ = batch(110, dtype=torch.float32)
    y32 = build_norm(kind, C).train()(x, pad)
    y = norm(x.to(torch.bfloat16), pad)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), y32, atol=0.05, rtol=0.05)
    for name, buf in norm.named_buffers():
        if buf.is_floating_point():
            assert buf.dtype == torch.float32, name



@pytest.mark.parametrize("kind", RUNNING_STAT_TYPES)
def test_batch_of_one_token(kind):
    """One real token: finite output and gradient; BN's output is its bias (the
    token is its own mean) and its running variance keeps its value (one token
    has no variance estimate), while the mean and psi^2 statistics update."""
    norm = affine(build_norm(kind, C).double().train())
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    x = (torch.randn(T, B, C, dtype=torch.float64) * 3).requires_grad_(True)
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[1, 4] = False
    y = norm(x, pad)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    token = x[4, 1].detach()
    if kind == "bn-original":  # every position holds the token: zero variance over T*B rows
        torch.testing.assert_close(y, norm.bias.detach().expand_as(y))
        torch.testing.assert_close(norm.running_var, 0.95 * before["running_var"])
    elif kind in ("bn", "rbn"):
        torch.testing.assert_close(y[4, 1], norm.bias.detach())
        assert torch.equal(norm.running_var, before["running_var"])
        m = norm.momentum
        torch.testing.assert_close(norm.running_mean, (1 - m) * before["running_mean"] + m * token)
        if kind == "rbn":  # no variance estimate: no penalty either
            from powernorm_fairseq.norms.rbn import regularization

            assert regularization(norm).item() == 0
    else:
        torch.testing.assert_close(norm.running_psi2, 0.9 * before["running_psi2"] + 0.1 * token ** 2)


def test_original_batch_norm_matches_the_released_code_over_steps():
    """bn-original against a transcription of the authors' MaskSyncBatchNorm:
    outputs, input and affine gradients and running buffers over training
    steps with different padding, then eval."""
    norm = affine(build_norm("bn-original", C).double()).train()
    w = norm.weight.detach().clone().requires_grad_(True)
    b = norm.bias.detach().clone().requires_grad_(True)
    mean, var = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    for step in range(4):
        x, pad, grad_y = batch(130 + step)
        norm.zero_grad()
        y, gx = run(norm, x, pad, grad_y)
        xr = x.clone().requires_grad_(True)
        y_ref = ref.original_batch_norm(xr, pad, w, b, mean, var)
        gx_ref, gw_ref, gb_ref = torch.autograd.grad(y_ref, (xr, w, b), grad_y)
        torch.testing.assert_close(y, y_ref.detach())
        torch.testing.assert_close(gx, gx_ref)
        torch.testing.assert_close(norm.weight.grad, gw_ref)
        torch.testing.assert_close(norm.bias.grad, gb_ref)
        torch.testing.assert_close(norm.running_mean, mean)
        torch.testing.assert_close(norm.running_var, var)
    assert norm.num_batches_tracked.item() == 4
    norm.eval()
    x, pad, _ = batch(139)
    torch.testing.assert_close(norm(x, pad), ref.original_batch_norm(x, pad, w, b, mean, var, training=False))
    torch.testing.assert_close(norm.running_var, var)


def test_original_batch_norm_depends_on_padding_where_bn_does_not():
    """The pad filling shrinks the batch variance: more padding, other outputs for
    the same real tokens (test_padding_changes_nothing_for_real_tokens shows bn does not)."""
    x, pad, _ = batch(140)
    x_long = torch.cat([x, torch.randn(3, B, C, dtype=x.dtype)])
    pad_long = torch.cat([pad, torch.ones(B, 3, dtype=torch.bool)], dim=1)
    keep = ~pad.t()
    y = build_norm("bn-original", C).double().train()(x, pad)[keep]
    y_long = build_norm("bn-original", C).double().train()(x_long, pad_long)[:T][keep]
    ratio = (y_long.std(0) / y.std(0)).mean().item()
    assert ratio > 1.05  # a smaller variance to divide by: larger outputs
    with pytest.raises(ValueError, match="never synchronised.*sync='none'"):
        build_norm("bn-original", C, sync="batch")


@pytest.mark.parametrize("layout, mask, groups", [("tbc", "bool", 0), ("btc", "bool", 0), ("tbc", "0/1", 0),
                                                   ("btc", "0/1", 2)])
def test_rbn_is_bn_with_the_penalty_of_its_reference(layout, mask, groups):
    """Regularized BN: bn's output, running statistics and gradients, and the penalty that
    regularization() hands the loss, with its gradient through the batch statistics (of the
    layer-scaled input with ``groups``); two steps, so that the second starts from running statistics
    of the first."""
    from powernorm_fairseq.norms.rbn import regularization

    scale = dict(layer_scale=True, groups=groups) if groups else {}
    norm = affine(build_norm("rbn", C, penalty_mean=0.3, penalty_var=0.2, **scale).double()).train()
    assert norm.momentum == 0.05 and regularization(norm) is None
    for seed in (130, 131):
        x, pad, grad_y = batch(seed)
        rm, rv = norm.running_mean.clone(), norm.running_var.clone()
        xr = x.clone().requires_grad_(True)
        given = pad if mask == "bool" else pad.long()
        y = norm(xr.transpose(0, 1), given, batch_first=True).transpose(0, 1) if layout == "btc" else norm(xr, given)
        assert regularization(copy.deepcopy(norm)) is None  # a copy (an EMA's) takes no graph along
        penalty = regularization(norm)
        assert regularization(norm) is None  # taken once
        (gx,) = torch.autograd.grad((y * grad_y).sum() + penalty, xr)

        xs = x.clone().requires_grad_(True)
        xg = ref.group_scale(xs, groups) if groups else xs
        y_ref, _, _ = ref.batch_norm(xg, pad, norm.weight.detach(), norm.bias.detach())
        p_ref, mean, var = ref.rbn_penalty(xg, pad, rm, rv, 0.05, 0.3, 0.2)
        (gx_ref,) = torch.autograd.grad((y_ref * grad_y).sum() + p_ref, xs)
        torch.testing.assert_close(y.detach(), y_ref.detach())
        torch.testing.assert_close(penalty.detach(), p_ref.detach())
        torch.testing.assert_close(gx, gx_ref)
        torch.testing.assert_close((norm.running_mean, norm.running_var), (mean, var))
    norm.eval()(x, pad)
    assert regularization(norm) is None  # eval adds nothing


@pytest.mark.parametrize("kind, reference", [
    ("rmsnorm", lambda n, x: ref.rms_norm(x, n.weight)),
    ("layernorm-simple", lambda n, x: ref.layer_norm_simple(x)),
    ("detachnorm", lambda n, x: ref.layer_norm_simple(x, detach="both")),
    ("layernorm-simple:unbiased", lambda n, x: ref.layer_norm_simple(x, unbiased=True)),
    ("detachnorm:unbiased", lambda n, x: ref.layer_norm_simple(x, detach="both", unbiased=True)),
    ("adanorm", lambda n, x: ref.ada_norm(x)),
    ("groupnorm", lambda n, x: ref.group_norm(x, 4, n.weight, n.bias)),
    ("dyt", lambda n, x: ref.dyt(x, n.alpha, n.weight, n.bias)),
    ("derf", lambda n, x: ref.derf(x, n.alpha, n.shift, n.weight, n.bias)),
    ("none", lambda n, x: x * 1),
])
def test_per_token_norms_match_references(kind, reference):
    """Outputs and input gradients, the detached factors included."""
    kind, _, std = kind.partition(":")
    norm = affine(build_norm(kind, C, **({"std": std} if std else {})).double()).train()
    x, pad, grad_y = batch(120)
    y, gx = run(norm, x, pad, grad_y)
    xr = x.clone().requires_grad_(True)
    y_ref = reference(norm, xr)
    (gx_ref,) = torch.autograd.grad(y_ref, xr, grad_y)
    torch.testing.assert_close(y, y_ref.detach())
    torch.testing.assert_close(gx, gx_ref)


@pytest.mark.parametrize("detach", ["mean", "var"])
def test_detachnorm_options(detach):
    norm = build_norm("detachnorm", C, detach=detach).double()
    x, pad, grad_y = batch(121)
    _, gx = run(norm, x, pad, grad_y)
    xr = x.clone().requires_grad_(True)
    (gx_ref,) = torch.autograd.grad(ref.layer_norm_simple(xr, detach=detach), xr, grad_y)
    torch.testing.assert_close(gx, gx_ref)
    (gx_both,) = torch.autograd.grad(ref.layer_norm_simple(xr, detach="both"), xr, grad_y)
    assert not torch.allclose(gx, gx_both)  # each option is its own gradient
    with pytest.raises(ValueError, match="detach must be one of both, mean, var"):
        build_norm("detachnorm", C, detach="std")
    with pytest.raises(ValueError, match="std must be one of biased, unbiased"):
        build_norm("layernorm-simple", C, std="sample")


def test_adanorm_scale_and_rms_init():
    x, pad, _ = batch(122)
    torch.testing.assert_close(build_norm("adanorm", C, scale=2.5).double()(x, pad), 2.5 * ref.ada_norm(x))
    assert torch.equal(build_norm("rmsnorm", C).weight, torch.ones(C))
    dyt = build_norm("dyt", C, alpha_init=0.7)
    with torch.no_grad():
        dyt.alpha.fill_(3.0)
    dyt.reset_parameters()
    assert dyt.alpha.item() == pytest.approx(0.7) and torch.equal(dyt.weight, torch.ones(C))
    with pytest.raises(ValueError, match="alpha_init must be positive"):
        build_norm("dyt", C, alpha_init=0.0)
    derf = build_norm("derf", C, alpha_init=0.7)
    with torch.no_grad():
        derf.alpha.fill_(3.0), derf.shift.fill_(1.0)
    derf.reset_parameters()
    assert (derf.alpha.item(), derf.shift.item()) == (pytest.approx(0.7), 0.0)
    assert torch.equal(derf.bias, torch.zeros(C))
    with pytest.raises(ValueError, match="groups must divide"):
        build_norm("groupnorm", C, groups=3)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("kind", NORM_TYPES)
def test_an_empty_batch_gives_the_plain_paths_result(kind):
    """T = 0 (a batch of empty sentences) in training and eval: an empty
    output and gradient, the state the plain path leaves, and no warning."""
    for training in (True, False):
        torch.manual_seed(0)
        norm = build_norm(kind, C).double().train(training)
        torch.manual_seed(0)
        with kernels.use("plain"):
            plain = build_norm(kind, C).double().train(training)
        x = torch.randn(0, B, C, dtype=torch.float64, requires_grad=True)
        pad = torch.zeros(B, 0, dtype=torch.bool)
        y = norm(x, pad)
        y.sum().backward()
        with kernels.use("plain"):
            plain(x.detach(), pad)
        assert y.shape == x.shape and x.grad.shape == x.shape
        assert all(torch.equal(a, b) for a, b in zip(norm.state_dict().values(), plain.state_dict().values()))



def test_torch_s_fused_rmsnorm_serves_only_where_it_matches_eq_4(monkeypatch):
    """On a GPU, RMSNorm runs torch's fused RMSNorm where it matches Eq. 4 on a
    probe (output in x's dtype, both gradients), per device and dtypes, once;
    a torch whose RMSNorm is off, or a mixed dtype it does not fuse, keeps the
    plugin's kernels. The check itself runs on any device."""
    import torch.nn.functional as F

    from powernorm_fairseq.norms import rmsnorm

    monkeypatch.setattr(rmsnorm, "_TORCH_FUSED", {})
    x = torch.randn(2, 3, 8)
    for dtype in (torch.float32, torch.bfloat16):
        assert rmsnorm.torch_fused(x.to(dtype), torch.ones(8, dtype=dtype))
    assert not rmsnorm.torch_fused(x.half(), torch.ones(8))  # amp's float16 x, float32 weight
    monkeypatch.setattr(rmsnorm, "_TORCH_FUSED", {})
    rms_norm = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda x, shape, w, eps: rms_norm(x, shape, w, eps) * (1 + 1e-3))
    assert not rmsnorm.torch_fused(x, torch.ones(8))
    monkeypatch.setattr(F, "rms_norm", lambda x, shape, w, eps: rms_norm(x, shape, w, eps).float())
    assert not rmsnorm.torch_fused(x, torch.ones(8))  # the verdict kept: asked once per device and dtypes
    assert not rmsnorm.torch_fused(x.double(), torch.ones(8, dtype=torch.float64))  # output not in x's dtype


def _unit_offset_reference(kind, norm, x, pad, leaves, state):
    """y of ``kind``'s reference formula (reference.py) with the gain read as stored + offset: ``leaves``
    holds the gain ``G`` and every other parameter by name; ``state``: what a reference keeps over steps."""
    G, p = leaves["G"], leaves
    if kind == "ln":
        return ref.layer_norm(x, G, p["bias"])
    if kind in ("bn", "rbn"):
        return ref.batch_norm(x, pad, G, p["bias"])[0]
    if kind == "pn-v":
        return ref.pn_v(x, pad, G, p["bias"])[0]
    if kind == "bn-original":
        return ref.original_batch_norm(x, pad, G, p["bias"], state["mean"], state["var"])
    if kind == "scalenorm":
        return ref.scale_norm(x, G)
    if kind == "rmsnorm":
        return ref.rms_norm(x, G)
    if kind == "groupnorm":
        return ref.group_norm(x, norm.groups, G, p["bias"])
    if kind == "dyt":
        return ref.dyt(x, p["alpha"], G, p["bias"])
    return ref.derf(x, p["alpha"], p["shift"], G, p["bias"])


@pytest.mark.parametrize("kind", GAIN_TYPES)
def test_a_unit_offset_gain_is_stored_at_zero_and_applied_as_one_plus_gamma(kind):
    """--norm-unit-offset (x-transformers' norm_add_unit_offset): every gain starts at 0 (ScaleNorm's g
    at 0 for sqrt(C)), the output at initialisation is the kind's own, and over two training steps, in
    (T, B, C) with a bool mask and then (B, T, C) with a 0/1 attention mask, y, dL/dx and every
    parameter's gradient are those of the kind's reference formula with the gain 1 + gamma (sqrt(C) + g)."""
    options = {"pn": dict(warmup_updates=1)}.get(kind, {})
    norm = build_norm(kind, C, unit_offset=True, **options).double().train()
    plain_norm = build_norm(kind, C, **options).double().train()
    gain = norm.GAIN
    assert float(getattr(norm, gain).detach().abs().max()) == 0.0 and norm.w_offset == plain_norm.initial_gain()
    x, pad, grad_y = batch(130)
    torch.testing.assert_close(norm.eval()(x, pad), plain_norm.eval()(x, pad))  # ScaleNorm's: sqrt(C) rounded once
    norm.train()
    g = torch.Generator().manual_seed(131)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    state = {"mean": torch.zeros(C, dtype=torch.float64), "var": torch.ones(C, dtype=torch.float64)}
    paper = ref.PaperPN(C, warmup=1)
    for step in range(2):
        x, pad, grad_y = batch(132 + step)
        norm.zero_grad()
        xi = x.clone().requires_grad_(True)
        if step == 0:
            y = norm(xi, pad)
            y.backward(grad_y)
        else:
            xb = xi.transpose(0, 1)
            y = norm(xb, batch_first=True, attention_mask=(~pad).long()).transpose(0, 1)
            y.backward(grad_y)
        leaves = {name: p.detach().clone().requires_grad_(True) for name, p in norm.named_parameters()}
        leaves["G"] = (leaves[gain].detach() + norm.w_offset).requires_grad_(True)
        xr = x.clone().requires_grad_(True)
        if kind == "pn":
            y_ref, gx_ref, g_ref = paper.step(x, pad, leaves["G"].detach(), leaves["bias"].detach(), grad_y)
            grads = {"G": g_ref, "bias": grad_y.sum((0, 1))}
        else:
            y_ref = _unit_offset_reference(kind, norm, xr, pad, leaves, state)
            names = [n for n in leaves if n != gain]
            gx_ref, *rest = torch.autograd.grad(y_ref, [xr] + [leaves[n] for n in names], grad_y, allow_unused=True)
            grads = dict(zip(names, rest))
        torch.testing.assert_close(y.detach(), y_ref.detach(), msg=f"{kind} step {step}: y")
        torch.testing.assert_close(xi.grad, gx_ref, msg=f"{kind} step {step}: dL/dx")
        for name, p in norm.named_parameters():
            want = grads["G" if name == gain else name]
            torch.testing.assert_close(p.grad, want, msg=f"{kind} step {step}: dL/d{name}")
    norm.reset_parameters()
    assert float(getattr(norm, gain).detach().abs().max()) == 0.0 and norm.unit_offset
