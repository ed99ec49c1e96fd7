"""The fused norms as autograd functions, on whichever backend the dispatch
chose (``k``: the CPU C++ kernels or the GPU kernels, one interface): the same
math as the plain PyTorch code of each norm, in one or two passes over memory
per direction instead of one per elementary op.

With xs the input after the optional group scaling, N the real tokens and
xh = (xs - mean) * inv, every backward here is

    dL/dxs = (g - m * (A + B * xh)) * inv_bwd,   g = gamma * dL/dy,

with m = 1 at real tokens (and at padding only for the released code's
backward), and per mode:

* ``exact`` (BN, PN-V, PN during warmup; paper Eq. 3 and 6): inv from the batch,
  A = mean(g) for BN (0 without centring), B = mean(g * xh), the means taken
  over N with sums over every position, as autograd of the masked statistics
  gives. A first pass sums, a second applies. Under ``--norm-sync batch`` the
  first pass's sums are all-reduced between the two passes, and N is the
  global count: the exact gradient of the global statistics.
* ``paper`` (Algorithm 2): A = 0, B = nu_{t-1}, inv the running one.
* ``reference`` (the released code): A = 0, B = (1 - alpha_bwd) * nu, padding
  included, inv_bwd from the batch statistic.

Backend sums come back as float64 (C,) rows; per-channel vectors are kept in
the statistics dtype (float32 for half inputs), activations in their own.
"""

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ..stats import GROUP_EPS, stat_dtype, update_nu


def _same(t: Tensor) -> Tensor:
    return t


@dataclass
class Plan:
    """What one call needs beyond its tensors; the forward fills in the stats."""

    k: object  # the backend module
    groups: int
    center: bool
    mode: str
    n: int  # real tokens in this worker's batch
    inv: Optional[Tensor] = None  # the forward's 1 / sqrt(var + eps)
    mean: Optional[Tensor] = None
    inv_bwd: Optional[Tensor] = None
    nu: Optional[Tensor] = None
    rate: float = 0.0
    collect_stats: bool = False  # sum xs and xs^2 over real tokens in the forward pass
    stats: Optional[Tensor] = None  # (2, C) those sums, once collected
    # --norm-sync: the sum over workers of backward sums, and the global count
    reduce: Callable[[Tensor], Tensor] = _same
    n_global: Optional[int] = None
    exact_global: bool = True  # exact mode: the correction of the global batch (sync batch)


class FusedChannelNorm(torch.autograd.Function):
    """y = (xs - mean) * inv * gamma + beta in one pass; backward by ``plan.mode``."""

    @staticmethod
    def forward(ctx, x, keep, weight, bias, plan):
        # x: (N, C) contiguous; keep: (N,) real-token weights or None
        y, scale, plan.stats = plan.k.forward(
            x, _opt(keep), plan.groups, GROUP_EPS, _opt(plan.mean), plan.inv, weight, bias, True,
            plan.collect_stats)
        ctx.save_for_backward(x, keep, scale, weight)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, keep, scale, weight = ctx.saved_tensors
        p, k = ctx.plan, ctx.plan.k
        sd = stat_dtype(x)
        grad_y = grad_y.contiguous()
        n_all = p.n if p.n_global is None else p.n_global
        w = weight.to(sd)
        A = B = None
        if p.mode == "exact":  # first pass: the batch terms of Eq. 3 / Eq. 6
            _, sums = k.backward(x, _opt(keep), _opt(scale), grad_y, weight, _opt(p.mean), p.inv, p.inv,
                                 _none(), _none(), p.groups, False, False, True)
            first, n = (p.reduce(sums[:2]), n_all) if p.exact_global else (sums[:2], max(p.n, 1))
            B = w * (first[0] / n).to(sd)
            A = w * (first[1] / n).to(sd) if p.center else None
        elif p.mode == "paper":
            B = p.nu.to(sd).clone()  # nu_{t-1}
        else:
            B = p.rate * p.nu.to(sd)
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
                    nu.add_(((weight.double() * sums[0] - B.double() * sums[4]) / x.size(0)).to(nu))
                else:  # Algorithm 2 over the (global) batch: Lambda_t = sums[2] / N, Gamma_t = sums[3] / N
                    terms = p.reduce(sums[2:4])
                    update_nu(nu, p.rate, gamma_t=terms[1] / n_all, lambda_t=terms[0] / n_all)
        grad_weight, grad_bias = sums[0].to(weight.dtype), sums[1].to(weight.dtype)
        return grad_x, None, grad_weight, grad_bias, None


def _opt(t):
    return t if t is not None else _none()


def _none():
    return torch.empty(0)


def rows(x: Tensor, pad_mask: Optional[Tensor]):
    """x as contiguous (N, C) rows, per-row real-token weights (or None), and N real."""
    T, B, C = x.shape
    x2 = x.contiguous().view(T * B, C)
    if pad_mask is None:
        return x2, None, T * B
    keep, n = _real_rows(pad_mask, stat_dtype(x))
    return x2, keep, n


_last = (None, None, None, None)  # (the mask, its version, dtype, (keep, n))


def _real_rows(pad_mask: Tensor, dtype: torch.dtype):
    """Per-row weights of a (B, T) mask, None when nothing is padded, and the
    real-token count. The count is read to the host once per mask, not once
    per norm: every norm of an encoder sees the same mask, and on a GPU each
    read waits for the work queued before it."""
    global _last
    ref, version, dt, value = _last
    if ref is not None and ref() is pad_mask and version == pad_mask._version and dt == dtype:
        return value
    keep = (~pad_mask).t().reshape(-1).to(dtype)
    n = int(keep.sum().item())
    value = (keep if n < keep.numel() else None, n)
    _last = (weakref.ref(pad_mask), pad_mask._version, dtype, value)
    return value


def batch_sums(k, x2, keep, groups, shift=None):
    """(2, C) float64 sums of d and d^2 over the real (group-scaled) rows, d =
    xs - shift: one read of x."""
    _, _, sums = k.forward(x2, _opt(keep), groups, GROUP_EPS, _none(), _none(), _none(), _none(), False, True,
                           shift)
    return sums


def a_real_row(x2: Tensor, keep: Optional[Tensor]) -> Tensor:
    """One real token's channels (C,), chosen on the device: the shift that
    keeps the one-pass variance accurate when a channel's mean is large next
    to its spread (the shifted-data algorithm; Chan, Golub & LeVeque, 1983)."""
    row = torch.zeros(1, dtype=torch.long, device=x2.device) if keep is None else keep.argmax().view(1)
    return x2.index_select(0, row)[0].to(stat_dtype(x2))


def moments(sums: Tensor, n: int, center: bool, like: Tensor, shift: Optional[Tensor] = None):
    """(mean or None, variance or psi^2) in the statistics dtype of ``like``
    from batch_sums over n rows taken with ``shift``."""
    sd = stat_dtype(like)
    d1, d2 = sums[0] / n, sums[1] / n
    if center:
        mean = d1 if shift is None else d1 + shift.double()
        return mean.to(sd), (d2 - d1 * d1).clamp(min=0).to(sd)
    return None, d2.to(sd)


class FusedScaleNorm(torch.autograd.Function):
    """ScaleNorm in one pass each way."""

    @staticmethod
    def forward(ctx, x, scale, eps, k):
        y, norms = k.scalenorm_forward(x, scale, eps)
        ctx.save_for_backward(x, norms, scale)
        ctx.eps, ctx.k = eps, k
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, norms, scale = ctx.saved_tensors
        grad_x, grad_scale = ctx.k.scalenorm_backward(x, norms, grad_y.contiguous(), scale, ctx.eps)
        return grad_x, grad_scale.reshape(()).to(scale.dtype), None, None


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm in one pass each way (GPU kernels only)."""

    @staticmethod
    def forward(ctx, x, weight, eps, k):
        y, rstd = k.rmsnorm_forward(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.k = k
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, rstd, weight = ctx.saved_tensors
        grad_x, grad_weight = ctx.k.rmsnorm_backward(x, rstd, grad_y.contiguous(), weight)
        return grad_x, grad_weight.to(weight.dtype), None, None
