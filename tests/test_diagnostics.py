"""--norm-diagnostics against the statistics and gradients of independent references."""

import math

import pytest
import torch
from fairseq.logging import metrics
from torch import nn

import reference as ref
from powernorm_fairseq.models.diagnostics import NormDiagnostics, short_name
from powernorm_fairseq.norms import build_norm

pytestmark = pytest.mark.fast

T, B, C = 7, 3, 8


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, C, generator=g, dtype=torch.float64) * 1.5 + 0.3
    pad = torch.arange(T)[None, :] >= torch.tensor([T, 4, 2])[:, None]
    grad_y = torch.randn(T, B, C, generator=g, dtype=torch.float64)
    grad_y[pad.t()] = 0
    return x, pad, grad_y


def probed(kind, interval=1, **options):
    """A norm inside a container, as in a model, with diagnostics attached."""
    model = nn.ModuleDict({"encoder": nn.ModuleDict({"layer_norm": build_norm(kind, C, **options)})})
    model.double()
    norm = model["encoder"]["layer_norm"]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(C, generator=g, dtype=torch.float64))
        for buf in norm.buffers():  # running statistics away from their init
            if buf.is_floating_point() and buf.dim() == 1:
                buf.copy_(0.5 + torch.rand(C, generator=g, dtype=torch.float64))
    return model, norm, NormDiagnostics(model, interval)


def logged(norm, x, pad, grad_y, diagnostics, step=0):
    diagnostics.set_num_updates(step)
    with metrics.aggregate(new_root=True) as agg:
        x = x.clone().requires_grad_(True)
        norm(x, pad).backward(grad_y)
    return {k: v for k, v in agg.get_smoothed_values().items() if k.startswith("diag/")}


def stat_grads(y_of, stats, grad_y):
    """Gradients of <y, grad_y> with respect to each statistic, by autograd."""
    for s in stats:
        s.retain_grad()
    (y_of() * grad_y).sum().backward()
    return [s.grad.norm().item() for s in stats]


def test_batchnorm_distances_and_gradient_terms():
    model, norm, diag = probed("bn")
    x, pad, grad_y = batch(1)
    running = norm.running_mean.clone(), norm.running_var.clone()
    got = logged(norm, x, pad, grad_y, diag)

    X = ref.real(x, pad)
    xr = x.clone().requires_grad_(True)
    keep = (~pad.t()).unsqueeze(-1).double()
    mu = (xr * keep).sum((0, 1)) / X.shape[0]
    var = (((xr - mu) ** 2) * keep).sum((0, 1)) / X.shape[0]
    g_mu, g_var = stat_grads(lambda: (xr - mu) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias,
                             [mu, var], grad_y)
    assert set(got) == {f"diag/bn/enc.final/{m}" for m in ("dist_mu", "dist_var", "grad_mu", "grad_var", "tid_mu",
                                                           "tid_sigma")}
    sigma_b = torch.sqrt(X.var(0, unbiased=False) + 1e-5)
    assert got["diag/bn/enc.final/tid_mu"] == pytest.approx(((running[0] - X.mean(0)).abs() / sigma_b).mean().item(),
                                                            rel=1e-9)
    assert got["diag/bn/enc.final/tid_sigma"] == pytest.approx(
        (torch.sqrt(running[1] + 1e-5) / sigma_b - 1).abs().mean().item(), rel=1e-9)
    assert got["diag/bn/enc.final/dist_mu"] == pytest.approx((X.mean(0) - running[0]).norm().item() / C, rel=1e-9)
    assert got["diag/bn/enc.final/dist_var"] == pytest.approx((X.var(0, unbiased=False) - running[1]).norm().item() / C,
                                                              rel=1e-9)
    assert got["diag/bn/enc.final/grad_mu"] == pytest.approx(g_mu, rel=1e-9)
    assert got["diag/bn/enc.final/grad_var"] == pytest.approx(g_var, rel=1e-9)


@pytest.mark.parametrize("kind", ["bn", "pn-v"])
def test_layer_scale_is_measured_on_the_scaled_input(kind):
    """With --layer-scale the statistics are those of the group-scaled input
    the norm normalises."""
    model, norm, diag = probed(kind, layer_scale=True, groups=2)
    x, pad, _ = batch(4)
    running = norm.running_var.clone() if kind == "bn" else norm.running_psi2.clone()
    got = logged(norm, x, pad, torch.zeros_like(x), diag)
    X = ref.real(ref.group_scale(x, 2), pad)
    batch_stat = X.var(0, unbiased=False) if kind == "bn" else (X ** 2).mean(0)
    key = f"diag/{kind}/enc.final/" + ("dist_var" if kind == "bn" else "dist_psi2")
    assert got[key] == pytest.approx((batch_stat - running).norm().item() / C, rel=1e-9)


def test_original_batchnorm_measures_its_filled_batch():
    """bn-original's statistics are those of every position of its layer-scaled,
    pad-filled input, the batch it normalises."""
    model, norm, diag = probed("bn-original")
    x, pad, grad_y = batch(7)
    running = norm.running_mean.clone(), norm.running_var.clone()
    got = logged(norm, x, pad, grad_y, diag)

    xr = x.clone().requires_grad_(True)
    xs = xr / torch.sqrt((xr ** 2).mean(-1, keepdim=True) + 1e-5)
    keep = ~pad.t()
    rows = torch.where(keep.unsqueeze(-1), xs, xs[keep].mean(0)).reshape(T * B, C)
    mu = rows.mean(0)
    var = ((rows - mu) ** 2).mean(0)
    g_mu, g_var = stat_grads(lambda: (rows - mu) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias,
                             [mu, var], grad_y.reshape(T * B, C))
    prefix = "diag/bn-original/enc.final"
    assert set(got) == {f"{prefix}/{m}" for m in ("dist_mu", "dist_var", "grad_mu", "grad_var", "tid_mu",
                                                  "tid_sigma")}
    sigma_b = torch.sqrt(var.detach() + 1e-5)  # Wang et al.'s TID, as their code measures it
    assert got[f"{prefix}/tid_mu"] == pytest.approx(((running[0] - mu.detach()).abs() / sigma_b).mean().item(),
                                                    rel=1e-9)
    assert got[f"{prefix}/tid_sigma"] == pytest.approx(
        (torch.sqrt(running[1] + 1e-5) / sigma_b - 1).abs().mean().item(), rel=1e-9)
    assert got[f"{prefix}/dist_mu"] == pytest.approx((mu - running[0]).norm().item() / C, rel=1e-9)
    assert got[f"{prefix}/dist_var"] == pytest.approx((var - running[1]).norm().item() / C, rel=1e-9)
    assert got[f"{prefix}/grad_mu"] == pytest.approx(g_mu, rel=1e-9)
    assert got[f"{prefix}/grad_var"] == pytest.approx(g_var, rel=1e-9)


def test_pn_v_distance_and_gradient_term():
    model, norm, diag = probed("pn-v")
    x, pad, grad_y = batch(2)
    running = norm.running_psi2.clone()
    got = logged(norm, x, pad, grad_y, diag)

    xr = x.clone().requires_grad_(True)
    keep = (~pad.t()).unsqueeze(-1).double()
    psi2 = (xr * xr * keep).sum((0, 1)) / keep.sum()
    (g_psi2,) = stat_grads(lambda: xr / torch.sqrt(psi2 + 1e-5) * norm.weight + norm.bias, [psi2], grad_y)
    assert set(got) == {"diag/pn-v/enc.final/dist_psi2", "diag/pn-v/enc.final/grad_psi2",
                        "diag/pn-v/enc.final/tid_psi"}
    psi2_b = (ref.real(x, pad) ** 2).mean(0)
    assert got["diag/pn-v/enc.final/tid_psi"] == pytest.approx(
        (torch.sqrt(running + 1e-5) / torch.sqrt(psi2_b + 1e-5) - 1).abs().mean().item(), rel=1e-9)
    assert got["diag/pn-v/enc.final/dist_psi2"] == pytest.approx(
        ((ref.real(x, pad) ** 2).mean(0) - running).norm().item() / C, rel=1e-9)
    assert got["diag/pn-v/enc.final/grad_psi2"] == pytest.approx(g_psi2, rel=1e-9)


@pytest.mark.parametrize("warmup", [0, 5])
def test_pn_measures_the_scale_its_forward_used(warmup):
    model, norm, diag = probed("pn", warmup_updates=warmup, layer_scale=True, groups=2)
    x, pad, grad_y = batch(3)
    running = norm.running_psi2.clone()
    got = logged(norm, x, pad, grad_y, diag)

    xs = ref.group_scale(x, 2)
    psi2_batch = (ref.real(xs, pad) ** 2).mean(0)
    # the forward divides by the batch psi^2 in warmup, by the running one after
    scale = (psi2_batch.clone() if warmup else running.clone()).requires_grad_(True)
    (g_psi2,) = stat_grads(lambda: xs / torch.sqrt(scale + 1e-5) * norm.weight + norm.bias, [scale], grad_y)
    assert got["diag/pn/enc.final/dist_psi2"] == pytest.approx((psi2_batch - running).norm().item() / C, rel=1e-9)
    assert got["diag/pn/enc.final/grad_psi2"] == pytest.approx(g_psi2, rel=1e-9)
    assert all(math.isfinite(v) and v > 0 for v in got.values())


def test_layernorm_and_scalenorm_log_nothing():
    for kind in ("ln", "scalenorm"):
        model = nn.ModuleDict({"n": build_norm(kind, C)}).double()
        diag = NormDiagnostics(model)
        x, pad, grad_y = batch(4)
        assert logged(model["n"], x, pad, grad_y, diag) == {} and diag.handles == []


def test_interval_skips_other_updates_and_eval():
    model, norm, diag = probed("bn", interval=3)
    x, pad, grad_y = batch(5)
    assert logged(norm, x, pad, grad_y, diag, step=4) == {}
    assert len(logged(norm, x, pad, grad_y, diag, step=6)) == 6
    norm.eval()
    with metrics.aggregate(new_root=True) as agg:
        norm(x, pad)
    assert not [k for k in agg.get_smoothed_values() if k.startswith("diag/")]


def test_hooks_only_read():
    x, pad, grad_y = batch(6)
    outs = []
    for with_diag in (False, True):
        model, norm, diag = probed("pn", warmup_updates=1)
        if not with_diag:
            diag.remove()
        for step in range(3):
            xr = x.clone().requires_grad_(True)
            diag.set_num_updates(step)
            with metrics.aggregate(new_root=True):
                y = norm(xr, pad)
                y.backward(grad_y)
            outs.append((y.detach(), xr.grad, norm.running_psi2.clone(), norm.running_nu.clone()))
    for a, b in zip(outs[:3], outs[3:]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("name, short", [
    ("encoder.layers.3.final_layer_norm", "enc3.ffn"),
    ("encoder.layers.0.self_attn_layer_norm", "enc0.attn"),
    ("decoder.layers.5.encoder_attn_layer_norm", "dec5.cross"),
    ("decoder.layer_norm", "dec.final"),
    ("something.else", "something.else"),
])
def test_short_names(name, short):
    assert short_name(name) == short
