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

Per-channel vectors are kept in the statistics dtype (float32 for half
inputs), activations in their own; per-program sums are added in float64.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from ..stats import GROUP_EPS
from . import ops  # noqa: F401  (registers torch.ops.powernorm)

P = torch.ops.powernorm

#: how ``finish_stats`` updates the running statistics, by norm and phase:
#: BN's mean and unbiased variance (EMA), PN-V's psi^2 (EMA), PN's psi^2 as a
#: cumulative mean in warmup and Algorithm 2's EMA after, and the released
#: PN's (a cumulative mean that stops a step before its warmup, an EMA on top)
UPDATES = ("bn", "pn-v", "pn-warm", "pn", "reference-warm", "reference")
#: the updates after which the forward normalised with the running psi^2_{t-1}
RUNNING_SCALE = ("pn", "reference")
MODES = ("exact", "paper", "reference")


class Step(NamedTuple):
    """What one :class:`FusedChannelNorm` call does beyond its tensors."""

    backend: str  # "cpu" or "triton" (ops.py)
    groups: int  # group scaling of each row in this many channel groups (0: none)
    center: bool  # subtract the mean (BN), or not (PN-V, PN)
    update: str  # one of UPDATES
    mode: str  # one of MODES: which backward (module doc)
    momentum: float  # of the running statistics' EMA
    eps: float
    warmup: int = 0  # the released PN's warmup (reference updates)
    rate: float = 0.0  # PN's 1 - alpha_bwd


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
    """

    @staticmethod
    def forward(ctx, x, mask, weight, bias, mean_buf, second_buf, steps, nu, step: Step):
        """x: (N, C) contiguous rows; mask: the (B, T) padding mask or empty;
        mean_buf, second_buf: the running statistics (BN's mean or empty);
        steps: PN's step counter or empty; nu: PN's running nu or empty."""
        s, none = step, x.new_empty(0)
        if s.update in RUNNING_SCALE:
            y, scale, part = P.forward(s.backend, x, mask, s.groups, GROUP_EPS, none, second_buf, s.eps, weight, bias,
                                       True, True, False)
            mean, inv, inv_batch, n = P.finish_stats(s.backend, part, mean_buf, second_buf, steps, s.update,
                                                     s.momentum, s.eps, s.warmup)
        else:
            _, _, part = P.forward(s.backend, x, mask, s.groups, GROUP_EPS, none, none, -1.0, none, none, False, True,
                                   s.center)
            mean, inv, inv_batch, n = P.finish_stats(s.backend, part, mean_buf, second_buf, steps, s.update,
                                                     s.momentum, s.eps, s.warmup)
            y, scale, _ = P.forward(s.backend, x, mask, s.groups, GROUP_EPS, mean, inv, -1.0, weight, bias, True,
                                    False, False)
        ctx.save_for_backward(x, mask, scale, weight, mean, inv, inv_batch, n)
        ctx.step, ctx.nu = s, nu  # nu: a buffer the backward updates, not a saved value
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, mask, scale, weight, mean, inv, inv_batch, n = ctx.saved_tensors
        s, nu, none, gy = ctx.step, ctx.nu, x.new_empty(0), grad_y.contiguous()
        if s.mode == "exact":  # the batch terms of Eq. 3 / Eq. 6 first, then the gradient
            _, part = P.backward(s.backend, x, mask, scale, gy, weight, mean, inv, none, none, none, 1.0, s.groups,
                                 False, False, True)
            grad_w, grad_b, A, B = P.finish_backward(s.backend, part, weight, n, nu, s.rate, "exact", s.center,
                                                     x.size(0))
            grad_x, _ = P.backward(s.backend, x, mask, scale, gy, weight, mean, inv, inv, A, B, 1.0, s.groups, False,
                                   True, False)
        else:  # B = nu_{t-1} (Algorithm 2), or (1 - alpha_bwd) nu over every position (the released code)
            paper = s.mode == "paper"
            grad_x, part = P.backward(s.backend, x, mask, scale, gy, weight, none, inv, inv if paper else inv_batch,
                                      none, nu, 1.0 if paper else s.rate, s.groups, not paper, True, True)
            grad_w, grad_b, _, _ = P.finish_backward(s.backend, part, weight, n, nu, s.rate, s.mode, False,
                                                     x.size(0))
        return grad_x, None, grad_w, grad_b, None, None, None, None, None


def rows(x: Tensor, pad_mask):
    """x as contiguous (N, C) rows, and the padding mask as the kernels take it (empty for none)."""
    T, B, C = x.shape
    return x.contiguous().view(T * B, C), (x.new_empty(0, dtype=torch.bool) if pad_mask is None else pad_mask)


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
        x, norms, scale = ctx.saved_tensors
        grad_x, grad_scale = P.scalenorm_backward(ctx.backend, x, norms, grad_y.contiguous(), scale, ctx.eps)
        return grad_x, grad_scale, None, None


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm in one pass each way (GPU kernels only)."""

    @staticmethod
    def forward(ctx, x, weight, eps, backend):
        y, rstd = P.rmsnorm_forward(backend, x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, rstd, weight = ctx.saved_tensors
        grad_x, grad_weight = P.rmsnorm_backward(ctx.backend, x, rstd, grad_y.contiguous(), weight)
        return grad_x, grad_weight, None, None
