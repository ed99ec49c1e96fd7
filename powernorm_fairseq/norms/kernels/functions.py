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


MODES = ("exact", "paper", "reference")


@dataclass(frozen=True)
class Plan:
    """Everything one :class:`FusedChannelNorm` call needs beyond its tensors,
    fixed before the call: the forward and backward read it, never write it."""

    k: object  # the backend module (contract.py)
    groups: int  # group scaling of each row in this many channel groups (0: none)
    center: bool  # subtract the mean (BN), or not (PN-V, PN)
    mode: str  # one of MODES: which backward (module doc)
    n: int  # real tokens in this worker's batch
    inv: Tensor  # the forward's 1 / sqrt(var + eps)
    mean: Optional[Tensor] = None
    nu: Optional[Tensor] = None  # PN's running nu, updated by the backward
    rate: float = 0.0  # 1 - alpha_bwd
    collect_stats: bool = False  # the forward also sums xs and xs^2 over the real tokens (its second output)
    # ``reference``: the backward scales by the batch's own 1 / sqrt(psi_B^2 + eps),
    # from the forward's sums when it collected them, else ``inv``
    eps: float = 0.0
    # --norm-sync: the sum over workers of the backward's sums, and the global
    # real-token count; None when the forward did not know it (the backward
    # then sums the count with its own sums, in the same all-reduce)
    reduce: Callable[[Tensor], Tensor] = _same
    n_global: Optional[int] = None
    exact_global: bool = True  # exact mode: the correction of the global batch (sync batch)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")


class FusedChannelNorm(torch.autograd.Function):
    """y = (xs - mean) * inv * gamma + beta in one pass; backward by ``plan.mode``."""

    @staticmethod
    def forward(ctx, x, keep, weight, bias, plan: Plan):
        """x: (N, C) contiguous; keep: (N,) real-token weights or None. Returns
        y (N, C) and, with ``plan.collect_stats``, the (2, C) float64 sums of xs
        and xs^2 over the real tokens (else an empty tensor)."""
        y, scale, stats = plan.k.forward(
            x=x, keep=_opt(keep), groups=plan.groups, gs_eps=GROUP_EPS, mean=_opt(plan.mean), inv=plan.inv,
            weight=weight, bias=bias, want_y=True, want_stats=plan.collect_stats, shift=_none())
        stats = _opt(stats)
        ctx.save_for_backward(x, keep, scale, weight, stats)
        ctx.mark_non_differentiable(stats)
        ctx.plan = plan
        return y, stats

    @staticmethod
    def backward(ctx, grad_y, _grad_stats):
        x, keep, scale, weight, stats = ctx.saved_tensors
        p, k = ctx.plan, ctx.plan.k
        sd = stat_dtype(x)
        grad_y = grad_y.contiguous()
        w = weight.to(sd)
        A = B = None
        args = dict(x=x, keep=_opt(keep), scale=_opt(scale), grad_y=grad_y, weight=weight, mean=_opt(p.mean),
                    inv_fwd=p.inv, groups=p.groups)
        if p.mode == "exact":  # first pass: the batch terms of Eq. 3 / Eq. 6
            _, sums = k.backward(**args, inv_bwd=p.inv, A=_none(), B=_none(), correct_pads=False, want_gx=False,
                                 want_sums=True)
            first, n = _with_count(p, sums[:2]) if p.exact_global else (sums[:2], max(p.n, 1))
            B = w * (first[0] / n).to(sd)
            A = w * (first[1] / n).to(sd) if p.center else None
        elif p.mode == "paper":
            B = p.nu.to(sd).clone()  # nu_{t-1}
        else:
            B = p.rate * p.nu.to(sd)
        inv_bwd = p.inv
        if p.mode == "reference" and stats.numel():  # the batch's own scale, from the forward's sums
            inv_bwd = torch.rsqrt(moments(stats, p.n, False, x)[1] + p.eps)
        # the second pass of an exact gradient sums again only where nu needs the real-token terms
        want_sums = p.mode != "exact" or p.nu is not None
        grad_x, second = k.backward(**args, inv_bwd=inv_bwd, A=_opt(A), B=B, correct_pads=p.mode == "reference",
                                    want_gx=True, want_sums=want_sums)
        sums = second if want_sums else sums
        if p.nu is not None:
            with torch.no_grad():
                nu = p.nu
                if p.mode == "reference":
                    # mean over every position of g' * z = g * z - (1 - a) nu z^2
                    nu.add_(((weight.double() * sums[0] - B.double() * sums[4]) / x.size(0)).to(nu))
                else:  # Algorithm 2 over the (global) batch: Lambda_t = sums[2] / N, Gamma_t = sums[3] / N
                    terms, n_all = _with_count(p, sums[2:4])
                    update_nu(nu, p.rate, gamma_t=terms[1] / n_all, lambda_t=terms[0] / n_all)
        grad_weight, grad_bias = sums[0].to(weight.dtype), sums[1].to(weight.dtype)
        return grad_x, None, grad_weight, grad_bias, None


def _with_count(p: Plan, t: Tensor):
    """(the sum of ``t`` over the workers, the global real-token count): the
    plan's count where the forward knew it, else this worker's count summed
    with ``t`` in one all-reduce (a tensor: the device is not waited for)."""
    if p.n_global is not None or p.reduce is _same:
        return p.reduce(t), (p.n if p.n_global is None else p.n_global)
    packed = p.reduce(torch.cat([t.reshape(-1), t.new_tensor([float(p.n)])]))
    return packed[:-1].view_as(t), packed[-1]


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
    _, _, sums = k.forward(x=x2, keep=_opt(keep), groups=groups, gs_eps=GROUP_EPS, mean=_none(), inv=_none(),
                           weight=_none(), bias=_none(), want_y=False, want_stats=True, shift=_opt(shift))
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
        y, norms = k.scalenorm_forward(x=x, scale=scale, eps=eps)
        ctx.save_for_backward(x, norms, scale)
        ctx.eps, ctx.k = eps, k
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, norms, scale = ctx.saved_tensors
        grad_x, grad_scale = ctx.k.scalenorm_backward(x=x, norms=norms, grad_y=grad_y.contiguous(), scale=scale,
                                                      eps=ctx.eps)
        return grad_x, grad_scale.reshape(()).to(scale.dtype), None, None


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm in one pass each way (GPU kernels only)."""

    @staticmethod
    def forward(ctx, x, weight, eps, k):
        y, rstd = k.rmsnorm_forward(x=x, weight=weight, eps=eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.k = k
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, rstd, weight = ctx.saved_tensors
        grad_x, grad_weight = ctx.k.rmsnorm_backward(x=x, rstd=rstd, grad_y=grad_y.contiguous(), weight=weight)
        return grad_x, grad_weight.to(weight.dtype), None, None
