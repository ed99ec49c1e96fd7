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
  gives. A first pass sums, a second applies.
* ``paper`` (Algorithm 2): A = 0, B = nu_{t-1}, inv the running one.
* ``reference`` (the released code): A = 0, B = (1 - alpha_bwd) * nu, padding
  included, inv_bwd from the batch statistic.
* ``fixed`` (the causal mode's running statistics): A = B = 0, the statistics
  constants of the gradient; PN's nu still follows Algorithm 2.

Every backward here gives first derivatives only: a backward asked to build
a graph through one of these norms (``create_graph=True``) raises, on every
backend.

Per-channel vectors are kept in the statistics dtype (float32 for half
inputs), activations in their own; per-program sums are added in float64.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from .. import sync as sync_mod
from ..stats import GROUP_EPS, update_nu
from . import ops  # registers torch.ops.powernorm

P = torch.ops.powernorm

#: how ``finish_stats`` updates the running statistics, by norm and phase:
#: BN's mean and unbiased variance (EMA), PN-V's psi^2 (EMA), PN's psi^2 as a
#: cumulative mean in warmup and Algorithm 2's EMA after, and the released
#: PN's (a cumulative mean that stops a step before its warmup, an EMA on top)
UPDATES = ("bn", "pn-v", "pn-warm", "pn", "reference-warm", "reference")
#: the updates after which the forward normalised with the running psi^2_{t-1}
RUNNING_SCALE = ("pn", "reference")
MODES = ("exact", "paper", "reference", "fixed")


class Step(NamedTuple):
    """What one :class:`FusedChannelNorm` call does beyond its tensors."""

    backend: str  # "plain", "cpu" or "triton" (ops.py)
    groups: int  # group scaling of each row in this many channel groups (0: none)
    center: bool  # subtract the mean (BN), or not (PN-V, PN)
    update: str  # one of UPDATES
    mode: str  # one of MODES: which backward (module doc)
    momentum: float  # of the running statistics' EMA
    eps: float
    warmup: int = 0  # the released PN's warmup (reference updates)
    rate: float = 0.0  # PN's 1 - alpha_bwd
    sync: str = "none"  # --norm-sync where workers are synchronised: "batch" or "running" (sync.py)
    clock: int = -1  # the key of PN's warmup clock, advanced once the step is committed (norms/clock.py)


class FusedChannelNorm(torch.autograd.Function):
    """One training step of BN, PN-V or PN: y = (xs - mean) * inv * gamma +
    beta with the running statistics updated, and the backward of ``step.mode``.

    Launches per forward + backward: after PN's warmup, 2 + 2 (the forward
    normalises with psi^2_{t-1} while it sums psi_B^2; the backward reads
    nu_{t-1}); otherwise 3 + 3 (statistics, then normalising; sums, then the
    gradient). Each pass is followed, or separated, by one small kernel that
    reduces the per-program sums in a fixed order and updates the running
    statistics (``finish_stats``, ``finish_backward``). Nothing is read back to
    the host: the real-token count stays on the device.

    ``given_mean`` and ``given_inv`` (empty when not given) fix the statistics
    the forward normalises with, in one pass that still sums the batch's for
    the running update: the causal mode's running statistics, or a
    recomputation's replay of the scale its first forward used. Returns y and
    the inv it normalised with (not differentiable).
    """

    @staticmethod
    def forward(ctx, x, mask, weight, bias, mean_buf, second_buf, steps, nu, given_mean, given_inv, step: Step):
        """x: (N, C) contiguous rows; mask: the (B, T) padding mask or empty;
        mean_buf, second_buf: the running statistics (BN's mean or empty);
        steps: PN's step counter or empty; nu: PN's running nu or empty."""
        s, none = step, x.new_empty(0)
        if given_inv.numel():
            y, scale, part = P.forward(s.backend, x, mask, s.groups, GROUP_EPS, given_mean, given_inv, -1.0, weight,
                                       bias, True, True, s.center)
            _, _, inv_batch, n, n_all = _statistics(s, part, mean_buf, second_buf, steps)
            mean, inv = given_mean, given_inv
        elif s.update in RUNNING_SCALE:
            y, scale, part = P.forward(s.backend, x, mask, s.groups, GROUP_EPS, none, second_buf, s.eps, weight, bias,
                                       True, True, False)
            mean, inv, inv_batch, n, n_all = _statistics(s, part, mean_buf, second_buf, steps)
        else:
            _, _, part = P.forward(s.backend, x, mask, s.groups, GROUP_EPS, none, none, -1.0, none, none, False, True,
                                   s.center)
            mean, inv, inv_batch, n, n_all = _statistics(s, part, mean_buf, second_buf, steps)
            y, scale, _ = P.forward(s.backend, x, mask, s.groups, GROUP_EPS, mean, inv, -1.0, weight, bias, True,
                                    False, False)
        ctx.save_for_backward(x, mask, scale, weight, mean, inv, inv_batch, n, n_all)
        ctx.step, ctx.nu = s, nu  # nu: a buffer the backward updates, not a saved value
        ctx.mark_non_differentiable(inv)
        ctx.set_materialize_grads(False)  # inv's gradient is never used: no zeros made for it
        return y, inv

    @staticmethod
    def backward(ctx, grad_y, _):
        if grad_y is None:  # no gradient reached y (gradients are not materialised): nothing flows back
            return (None,) * 11
        first_derivative_only("bn, pn-v and pn", grad_y)
        x, mask, scale, weight, mean, inv, inv_batch, n, n_all = ctx.saved_tensors
        s, nu, none, gy = ctx.step, ctx.nu, x.new_empty(0), grad_y.contiguous()
        if s.mode == "exact":  # the batch terms of Eq. 3 / Eq. 6 first, then the gradient
            _, part = P.backward(s.backend, x, mask, scale, gy, weight, mean, inv, none, none, none, 1.0, s.groups,
                                 False, False, True)
            if s.sync == "none":
                grad_w, grad_b, A, B = P.finish_backward(s.backend, part, weight, n, nu, s.rate, "exact", s.center,
                                                         x.size(0))
            else:
                grad_w, grad_b, A, B = _synced_terms(s, part, weight, n, n_all, nu, exact=True)
            grad_x, _ = P.backward(s.backend, x, mask, scale, gy, weight, mean, inv, inv, A, B, 1.0, s.groups, False,
                                   True, False)
        else:
            # B = nu_{t-1} (Algorithm 2), (1 - alpha_bwd) nu over every position (the released code),
            # or none: statistics that did not come from this batch ("fixed") are constants of the gradient
            reference, kind = s.mode == "reference", "paper" if s.mode == "fixed" else s.mode
            grad_x, part = P.backward(s.backend, x, mask, scale, gy, weight, mean, inv,
                                      inv_batch if reference else inv, none, none if s.mode == "fixed" else nu,
                                      s.rate if reference else 1.0, s.groups, reference, True, True)
            if s.sync == "none":
                grad_w, grad_b, _, _ = P.finish_backward(s.backend, part, weight, n, nu, s.rate, kind, False,
                                                         x.size(0))
            else:
                grad_w, grad_b, _, _ = _synced_terms(s, part, weight, n, n_all, nu, exact=False)
        return grad_x, None, grad_w, grad_b, None, None, None, None, None, None, None


def first_derivative_only(kinds: str, grad_y: Tensor):
    """The fused backwards compute no graph of their own: a backward asked for
    one (``create_graph=True`` through this norm) is refused, on every backend."""
    if torch.is_grad_enabled() and grad_y.requires_grad:
        raise RuntimeError(f"{kinds} have no second derivative here (a backward with create_graph=True went "
                           "through one): use ln, layernorm-simple or none for double backward")


def _statistics(s: Step, part, mean_buf, second_buf, steps):
    """(mean, inv, inv of the batch, n for the gradient, n of the global
    batch) from ``forward``'s part, the running statistics updated. Under
    --norm-sync the workers' counts and sums are added in one all-reduce and
    the running statistics follow the global batch; ``running`` normalises
    each worker's batch with its own statistics."""
    if s.sync == "none":
        mean, inv, inv_batch, n = P.finish_stats(s.backend, part, mean_buf, second_buf, steps, s.update, s.momentum,
                                                 s.eps, s.warmup, s.clock)
        return mean, inv, inv_batch, n, n
    local = _totals(_rows_of(part, s))
    mean, inv, inv_batch, n_all = P.finish_stats(s.backend, _as_part(sync_mod.all_sum(local), s), mean_buf, second_buf,
                                                 steps, s.update, s.momentum, s.eps, s.warmup, s.clock)
    if s.sync == "batch" or s.update in RUNNING_SCALE or s.mode == "fixed":  # the forward used running ones
        return mean, inv, inv_batch, n_all, n_all
    n = local[:1]
    real, ns = n > 0, n.clamp(min=1)
    C = part.size(-1)
    local_mean = local[1:C + 1] / ns
    second = local[C + 1:] / ns - (local_mean ** 2 if s.center else 0)
    sd = second_buf.dtype
    inv = torch.where(real, torch.rsqrt(second.clamp(min=0) + s.eps), torch.rsqrt(second_buf.double() + s.eps))
    if s.center:
        mean = torch.where(real, local_mean, mean_buf.double()).to(sd)
    return mean, inv.to(sd), inv_batch, n, n_all


def _rows_of(part: Tensor, s: Step) -> Tensor:
    """The per-program rows of a part, without the backend's ticket rows."""
    tickets = ops.backend(s.backend).TICKET_ROWS
    return part[:part.size(0) - tickets] if tickets else part


def _totals(part: Tensor) -> Tensor:
    """(count, sum, sum of squares) over this worker's real rows from
    ``forward``'s per-program part, float64, packed (2C + 1,) for one all-reduce."""
    p = part.double()
    count = p[:, 0]
    return torch.cat([count[:, :1].sum(0), (count * p[:, 1]).sum(0), (p[:, 2] + count * p[:, 1] ** 2).sum(0)])


def _as_part(totals: Tensor, s: Step) -> Tensor:
    """:func:`_totals` of the global batch as one row of ``forward``'s part:
    count, mean, sum of squared deviations (and the backend's zeroed ticket rows)."""
    C = (totals.numel() - 1) // 2
    n, s1, s2 = totals[:1], totals[1:C + 1], totals[C + 1:]
    mean = s1 / n.clamp(min=1)
    row = torch.stack([n.expand(C), mean, s2 - s1 * mean]).unsqueeze(0)
    tickets = ops.backend(s.backend).TICKET_ROWS  # a ticket set to 0
    return torch.cat([row, row.new_zeros(tickets, 3, C)]) if tickets else row


def _synced_terms(s: Step, part, weight, n, n_all, nu, exact: bool):
    """Under --norm-sync: this worker's weight and bias gradients, the exact
    gradient's A and B (of the global batch under ``batch``), and nu's
    Algorithm-2 update over the global batch, with one all-reduce."""
    sums = _rows_of(part, s).double().sum(0)
    w = weight.double()
    # the rows all workers add (a slice: indexing by a list would copy it to the device)
    first, last = (0 if exact and s.sync == "batch" else 2), (4 if nu.numel() else 2)
    total = dict(zip(range(first, last), sync_mod.all_sum(sums[first:last]))) if first < last else {}
    sd = nu.dtype if nu.numel() else (torch.float64 if weight.dtype == torch.float64 else torch.float32)
    A, B = weight.new_empty(0, dtype=sd), weight.new_empty(0, dtype=sd)
    if exact:  # Eq. 3 / Eq. 6 over the global batch, or over this worker's (running)
        terms, count = (total, n_all) if s.sync == "batch" else ({0: sums[0], 1: sums[1]}, n)
        B = (w * terms[0] / count.clamp(min=1)).to(sd)
        if s.center:
            A = (w * terms[1] / count.clamp(min=1)).to(sd)
    if nu.numel():  # Algorithm 2: Lambda_t and Gamma_t of the global batch
        count = n_all.clamp(min=1)
        update_nu(nu, s.rate, gamma_t=total[3] / count, lambda_t=w * total[2] / count)
    return sums[0].to(weight.dtype, copy=True), sums[1].to(weight.dtype, copy=True), A, B


def rows(x: Tensor, pad_mask):
    """x as contiguous (N, C) rows, and the padding mask as the kernels take it:
    a contiguous (B, T) bool tensor, or empty for none (a slice of a larger
    mask is not evenly strided, and the kernels read it row by row)."""
    T, B, C = x.shape
    return x.contiguous().view(T * B, C), (x.new_empty(0, dtype=torch.bool) if pad_mask is None
                                           else pad_mask.contiguous())


class FusedScaleNorm(torch.autograd.Function):
    """ScaleNorm in one pass each way."""

    @staticmethod
    def forward(ctx, x, scale, eps, backend):
        y, norms = P.scalenorm_forward(backend, x, scale, eps)
        ctx.save_for_backward(x, norms, scale)
        ctx.eps, ctx.backend = eps, backend
        return y

    @staticmethod
    def backward(ctx, grad_y):
        first_derivative_only("scalenorm", grad_y)
        x, norms, scale = ctx.saved_tensors
        grad_x, grad_scale = P.scalenorm_backward(ctx.backend, x, norms, grad_y.contiguous(), scale, ctx.eps)
        return grad_x, grad_scale, None, None


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm in one pass each way."""

    @staticmethod
    def forward(ctx, x, weight, eps, backend):
        y, rstd = P.rmsnorm_forward(backend, x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, grad_y):
        first_derivative_only("rmsnorm", grad_y)
        x, rstd, weight = ctx.saved_tensors
        grad_x, grad_weight = P.rmsnorm_backward(ctx.backend, x, rstd, grad_y.contiguous(), weight)
        return grad_x, grad_weight, None, None
