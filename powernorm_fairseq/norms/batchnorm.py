"""Batch normalisation over the real tokens of a batch (Ioffe & Szegedy, 2015,
https://arxiv.org/abs/1502.03167), the "BN" row of the PowerNorm paper.

The mean and variance are taken over the non-pad tokens only (the paper's
Section 3 with B the number of real tokens); the gradient is the exact one of
that computation (Eq. 3). Padding neither enters the statistics nor is filled
with anything: pad positions are normalised with the same statistics as the
real tokens so every position has an output.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from . import kernels
from . import sync as sync_mod
from .base import Norm, layer_scale_option, momentum_option
from .kernels import functions as fused
from .stats import assign_if_finite, group_scale, real_tokens, token_mean, upcast


class BatchStatNorm(Norm):
    """What BN and PN-V share: statistics of the batch's real tokens with the
    exact gradient in training, running statistics in eval. ``center`` says
    whether the mean is removed (BN) or not (PN-V).

    ``layer_scale``: the paper's "layer-scale layer ... before the
    normalization layer" (Appendix A), the authors' per-token RMS scaling of
    each of ``groups`` channel groups (:func:`stats.group_scale`); the
    statistics are then those of the scaled input, and the gradient flows
    back through the scaling."""

    center = True
    running_stats = True

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5, sync: str = "batch",
                 layer_scale: bool = False, groups: int = 1):
        super().__init__()
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"momentum must be in (0, 1), got {momentum}")
        if groups < 1 or dim % groups:
            raise ValueError(f"groups must divide dim={dim}, got {groups}")
        sync_mod.active(sync)  # validates
        self.dim, self.momentum, self.eps, self.sync = dim, momentum, eps, sync
        self.layer_scale, self.groups = layer_scale, groups
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    @classmethod
    def options(cls, cfg, heads, final=False):
        # --layer-scale: off unless asked (the authors' BN had its own, bn-original's)
        return dict(sync=cfg.norm_sync or "batch", layer_scale=layer_scale_option(cfg, False), groups=heads,
                    **momentum_option(cfg))

    def diagnostics_view(self, x, pad_mask):
        xs = self.scaled(upcast(x))
        keep, n = real_tokens(xs, pad_mask)
        psi2 = token_mean(xs * xs, keep, n)
        return {"psi2": (psi2, self.running(xs)[1].clone())}, (xs, None, torch.rsqrt(psi2 + self.eps))

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        k = kernels.select(x) if self.training else None
        if k is not None:
            return self._fused(k, x if x.dtype in k.DTYPES else upcast(x), pad_mask).to(x.dtype)
        xf = self.scaled(upcast(x))
        if self.training and sync_mod.active(self.sync):
            return self._normalized(xf, *self.synced_stats(xf, pad_mask)).to(x.dtype)
        keep, n = real_tokens(x, pad_mask) if self.training else (None, 0)
        if n == 0:  # eval, or a training batch that is all padding
            mean, second = self.running(xf)
        else:  # autograd through the masked statistics gives the exact gradient
            mean = token_mean(xf, keep, n) if self.center else None
            centred = xf - mean if self.center else xf
            second = token_mean(centred * centred, keep, n)
            self.update_running(mean, second, n)
        return self._normalized(xf, mean, second).to(x.dtype)

    def _normalized(self, xf: Tensor, mean: Optional[Tensor], second: Tensor) -> Tensor:
        """gamma * (xf - mean) / sqrt(var + eps) + beta (Eq. 3's forward; no
        mean and second = psi^2 for PN-V, Eq. 6's)."""
        y = (xf - mean if mean is not None else xf) * torch.rsqrt(second + self.eps)
        return y * self.weight.to(xf) + self.bias.to(xf)

    def scaled(self, xf: Tensor) -> Tensor:
        """The input the statistics are taken of: layer-scaled if asked."""
        return group_scale(xf, self.groups) if self.layer_scale else xf

    def _fused(self, k, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        """Training on backend ``k``: a statistics pass, one normalising pass,
        and the exact gradient in two (``kernels/functions.py``)."""
        x2, mask = fused.rows(x, pad_mask)
        groups = self.groups if self.layer_scale else 0  # the kernels scale each row in registers
        step = fused.Step(k.NAME, groups, self.center, self.update, "exact", self.momentum, self.eps,
                          sync=self.sync if sync_mod.active(self.sync) else "none")
        mean_buf, second_buf = self.kernel_buffers()
        steps, nu = x.new_empty(0), x.new_empty(0)  # PN's; apart, as the kernels write the one
        y = fused.FusedChannelNorm.apply(x2, mask, self.weight, self.bias, mean_buf, second_buf, steps, nu, step)
        return y.view_as(x)

    def _with_running(self, x: Tensor) -> Tensor:
        """Normalised with the running statistics, as in eval."""
        xf = self.scaled(upcast(x))
        return self._normalized(xf, *self.running(xf))

    def synced_stats(self, xf: Tensor, pad_mask: Optional[Tensor]):
        """(mean or None, variance or psi^2) to normalise with under ``--norm-sync``."""
        keep, n = real_tokens(xf, pad_mask)
        if self.sync == "running":  # global statistics for the buffers only
            N, g_mean, g_second = sync_mod.moments(xf, keep, self.center)
            if N > 0:
                self.update_running(g_mean, g_second, N)
            if n == 0:
                return self.running(xf)
            mean = token_mean(xf, keep, n) if self.center else None
            centred = xf - mean if self.center else xf
            return mean, token_mean(centred * centred, keep, n)
        # batch: the statistics of the union of the workers' batches, with
        # autograd through the all-reduce (the exact gradient, Eq. 3 / Eq. 6)
        C = xf.size(-1)
        masked = (lambda v: v) if keep is None else (lambda v: v * keep)
        first = masked(xf).sum(dim=(0, 1)) if self.center else masked(xf * xf).sum(dim=(0, 1))
        packed = sync_mod.all_sum(torch.cat([first, first.new_tensor([float(n)])]), differentiable=True)
        N = int(packed[-1].item())
        if N == 0:  # every worker's batch is padding
            return self.running(xf)
        if self.center:
            mean = packed[:C] / N
            centred = xf - mean
            second = sync_mod.all_sum(masked(centred * centred).sum(dim=(0, 1)), differentiable=True) / N
        else:
            mean, second = None, packed[:C] / N
        self.update_running(mean, second, N)
        return mean, second

    def running(self, like: Tensor) -> Tuple[Optional[Tensor], Tensor]:
        raise NotImplementedError

    def kernel_buffers(self) -> Tuple[Tensor, Tensor]:
        """(running mean or empty, running second moment) that the kernels update in place."""
        raise NotImplementedError

    def update_running(self, mean: Optional[Tensor], second: Tensor, n: int):
        raise NotImplementedError

    def extra_repr(self) -> str:
        scale = f", layer_scale=True, groups={self.groups}" if self.layer_scale else ""
        return f"{self.dim}, momentum={self.momentum}, eps={self.eps}, sync={self.sync!r}{scale}"


class MaskedBatchNorm(BatchStatNorm):
    """BatchNorm whose batch is the set of real tokens of a (T, B, C) input."""

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5, sync: str = "batch",
                 layer_scale: bool = False, groups: int = 1):
        super().__init__(dim, momentum, eps, sync, layer_scale, groups)
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    update = "bn"  # how the kernels update the running statistics (kernels/functions.py)

    def running(self, like):
        return self.running_mean.to(like), self.running_var.to(like)

    def kernel_buffers(self):
        return self.running_mean, self.running_var

    def diagnostics_view(self, x, pad_mask):
        xs = self.scaled(upcast(x))
        keep, n = real_tokens(xs, pad_mask)
        return self._mean_var_view(xs, keep, n)

    def _mean_var_view(self, xs, keep, n):
        mean = token_mean(xs, keep, n)
        var = token_mean((xs - mean) ** 2, keep, n)
        stats = {"mu": (mean, self.running_mean.to(xs, copy=True)), "var": (var, self.running_var.to(xs, copy=True))}
        return stats, (xs, mean, torch.rsqrt(var + self.eps))

    @torch.no_grad()
    def update_running(self, mean, var, n):
        # non-finite statistics (overflowed half-precision activations) leave both alone
        rm, rv = self.running_mean, self.running_var
        assign_if_finite(rm, rm.lerp(mean.to(rm), self.momentum), mean, var)
        if n > 1:  # one token has no variance estimate (torch's BatchNorm refuses such a batch)
            unbiased = var * n / (n - 1)  # like torch's BatchNorm
            assign_if_finite(rv, rv.lerp(unbiased.to(rv), self.momentum), mean, var)


class OriginalBatchNorm(MaskedBatchNorm):
    """``bn-original``: the "batch" norm of the authors' code
    (``MaskSyncBatchNorm`` in sIncerass/powernorm), which produced the paper's
    BN rows. It is not plain BN, in two ways:

    * layer scaling: each token is first divided by its root mean square over
      the channels, x / sqrt(mean_c(x^2) + eps);
    * pad filling: every padded position is filled with the mean of the
      batch's real tokens (gradient included), and BatchNorm then runs over all
      T x B positions. The mean is unchanged, but the variance shrinks by the
      fraction of real tokens, so a token's output depends on how much the
      batch is padded; the running variance is the unbiased one over T x B.

    Momentum 0.05 by default, and never synchronised across workers, as there.
    """

    def __init__(self, dim: int, momentum: float = 0.05, eps: float = 1e-5, sync: str = "none"):
        if sync != "none":
            raise ValueError(f"bn-original reproduces code that never synchronised its statistics: "
                             f"use sync='none', got {sync!r}")
        super().__init__(dim, momentum, eps, sync)
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    @classmethod
    def options(cls, cfg, heads, final=False):
        return momentum_option(cfg)  # never synchronised, its own layer scale

    def diagnostics_view(self, x, pad_mask):
        xs, _ = self.fill(upcast(x), pad_mask)  # its batch: every position, padding filled
        return self._mean_var_view(xs, None, xs.size(0) * xs.size(1))

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        xs, n = self.fill(upcast(x), pad_mask)
        if self.training and n > 0:
            self.num_batches_tracked += 1
            mean = xs.mean(dim=(0, 1))
            var = (xs - mean).pow(2).mean(dim=(0, 1))
            self.update_running(mean, var, xs.size(0) * xs.size(1))
        else:  # eval, or a training batch that is all padding
            mean, var = self.running(xs)
        y = (xs - mean) * torch.rsqrt(var + self.eps)
        return (y * self.weight.to(xs) + self.bias.to(xs)).to(x.dtype)

    def fill(self, xf: Tensor, pad_mask: Optional[Tensor]):
        """The layer-scaled input with its padding filled, and the real-token count."""
        xs = group_scale(xf, 1)
        keep, n = real_tokens(xs, pad_mask)
        if keep is not None and n > 0:
            xs = torch.where(keep.bool(), xs, token_mean(xs, keep, n))
        return xs, n
