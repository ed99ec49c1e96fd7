"""Channel-statistics norms (BN, PN-V, PN) and ScaleNorm through the fused
C++ kernels: the same math as the plain PyTorch code of each norm, in one or
two passes over memory per direction instead of one per elementary op.

With xs the input after the optional group scaling, N the real tokens and
xh = (xs - mean) * inv, every backward here is

    dL/dxs = (g - m * (A + B * xh)) * inv_bwd,   g = gamma * dL/dy,

with m = 1 at real tokens (and at padding only for the released code's
backward), and per mode:

* ``exact`` (BN, PN-V, PN during warmup; paper Eq. 3 and 6): inv from the batch,
  A = mean(g) for BN (0 without centring), B = mean(g * xh), the means taken
  over N with sums over every position, as autograd of the masked statistics
  gives. A first pass sums, a second applies.
* ``paper`` (Algorithm 2): A = 0, B = nu_{t-1}, inv the running one.
* ``reference`` (the released code): A = 0, B = (1 - alpha_bwd) * nu, padding
  included, inv_bwd from the batch statistic.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import kernels


@dataclass
class Plan:
    """What one call needs beyond its tensors; the forward fills in the stats."""

    groups: int
    center: bool
    mode: str
    n: int
    inv: Tensor  # the forward's 1 / sqrt(var + eps)
    mean: Optional[Tensor] = None
    inv_bwd: Optional[Tensor] = None
    nu: Optional[Tensor] = None
    rate: float = 0.0
    collect_stats: bool = False  # sum xs and xs^2 over real tokens in the forward pass
    stats: Optional[Tensor] = None  # (2, C) those sums, once collected


GROUP_EPS = 1e-5  # the original code's group-scaling epsilon


class FusedChannelNorm(torch.autograd.Function):
    """y = (xs - mean) * inv * gamma + beta in one pass; backward by ``plan.mode``."""

    @staticmethod
    def forward(ctx, x, keep, weight, bias, plan):
        # x: (N, C) contiguous; keep: (N,) real-token weights or None
        y, scale, plan.stats = kernels.load().forward(
            x, _opt(keep), plan.groups, GROUP_EPS, _opt(plan.mean), plan.inv, weight, bias, True,
            plan.collect_stats)
        ctx.save_for_backward(x, keep, scale, weight)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, keep, scale, weight = ctx.saved_tensors
        p, k = ctx.plan, kernels.load()
        grad_y = grad_y.contiguous()
        A = B = None
        if p.mode == "exact":  # first pass: the batch terms of Eq. 3 / Eq. 6
            _, sums = k.backward(x, _opt(keep), _opt(scale), grad_y, weight, _opt(p.mean), p.inv, p.inv,
                                 _none(), _none(), p.groups, False, False, True)
            first = sums.to(x.dtype)
            B = weight * first[0] / p.n
            A = weight * first[1] / p.n if p.center else None
        elif p.mode == "paper":
            B = p.nu.to(x.dtype).clone()  # nu_{t-1}
        else:
            B = p.rate * p.nu.to(x.dtype)
        inv_bwd = p.inv if p.inv_bwd is None else p.inv_bwd
        # the second pass of an exact gradient sums again only where nu needs the real-token terms
        want_sums = p.mode != "exact" or p.nu is not None
        grad_x, second = k.backward(x, _opt(keep), _opt(scale), grad_y, weight, _opt(p.mean), p.inv, inv_bwd,
                                    _opt(A), B, p.groups, p.mode == "reference", True, want_sums)
        sums = second if want_sums else sums
        if p.nu is not None:
            with torch.no_grad():
                nu = p.nu
                if p.mode == "reference":
                    # mean over every position of g' * z = g * z - (1 - a) nu z^2
                    n_all = x.size(0)
                    nu.add_(((weight.double() * sums[0] - B.double() * sums[4]) / n_all).to(nu))
                else:  # Algorithm 2: nu_t = nu_{t-1} (1 - (1 - a) Lambda_t) + (1 - a) Gamma_t
                    from .powernorm import update_nu

                    update_nu(nu, p.rate, sums[2] / p.n, sums[3] / p.n)
        grad_weight, grad_bias = sums[0].to(weight.dtype), sums[1].to(weight.dtype)
        return grad_x, None, grad_weight, grad_bias, None


def _opt(t):
    return t if t is not None else _none()


def _none():
    return torch.empty(0)


def usable(x: Tensor) -> bool:
    return kernels.usable(x)


def rows(x: Tensor, pad_mask: Optional[Tensor]):
    """x as contiguous (N, C) rows, per-row real-token weights (or None), and N real."""
    T, B, C = x.shape
    x2 = x.contiguous().view(T * B, C)
    if pad_mask is None or not pad_mask.any():
        return x2, None, T * B
    keep = (~pad_mask).t().reshape(T * B).to(x.dtype)
    return x2, keep, int(keep.sum().item())


def batch_stats(x2, keep, n, groups, center):
    """(mean or None, variance or psi^2) of the (group-scaled) real rows, in x's dtype."""
    _, _, sums = kernels.load().forward(x2, _opt(keep), groups, GROUP_EPS, _none(), _none(), _none(),
                                        _none(), False, True)
    mean = sums[0] / n
    second = sums[1] / n
    if center:
        return mean.to(x2.dtype), (second - mean * mean).clamp(min=0).to(x2.dtype)
    return None, second.to(x2.dtype)


class FusedScaleNorm(torch.autograd.Function):
    """ScaleNorm in one pass each way."""

    @staticmethod
    def forward(ctx, x, scale, eps):
        y, norms = kernels.load().scalenorm_forward(x, float(scale), eps)
        ctx.save_for_backward(x, norms, scale)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, norms, scale = ctx.saved_tensors
        grad_x, grad_scale = kernels.load().scalenorm_backward(x, norms, grad_y.contiguous(), float(scale), ctx.eps)
        return grad_x, grad_scale.reshape(()).to(scale.dtype), None
