"""Batch normalisation over the real tokens of a batch (Ioffe & Szegedy, 2015,
https://arxiv.org/abs/1502.03167), the "BN" row of the PowerNorm paper.

The mean and variance are taken over the non-pad tokens only (the paper's
Eq. 1-2 with B the number of real tokens); the gradient is the exact one of
that computation (Eq. 3), left to autograd. Padding neither enters the
statistics nor is filled with anything: pad positions are normalised with the
same statistics as the real tokens so every position has an output.
"""

from typing import Optional

import torch
from torch import Tensor, nn

from . import fused
from .base import Norm, real_tokens, token_mean, upcast


class MaskedBatchNorm(Norm):
    """BatchNorm whose batch is the set of real tokens of a (T, B, C) input."""

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5):
        super().__init__()
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"momentum must be in (0, 1), got {momentum}")
        self.dim, self.momentum, self.eps = dim, momentum, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        xf = upcast(x)
        if self.training and fused.usable(xf):
            x2, keep, n = fused.rows(xf, pad_mask)
            if n > 0:
                mean, var = fused.batch_stats(x2, keep, n, groups=0, center=True)
                self._update_running(mean, var, n)
                plan = fused.Plan(groups=0, center=True, mode="exact", n=n, mean=mean,
                                  inv=torch.rsqrt(var + self.eps))
                y = fused.FusedChannelNorm.apply(x2, keep, self.weight.to(xf), self.bias.to(xf), plan)
                return y.view_as(x).to(x.dtype)
        keep, n = real_tokens(x, pad_mask) if self.training else (None, 0)
        if n == 0:  # eval, or a training batch that is all padding
            mean, var = self.running_mean.to(xf), self.running_var.to(xf)
        else:
            mean = token_mean(xf, keep, n)
            centred = xf - mean
            var = token_mean(centred * centred, keep, n)  # biased, as the normalisation uses
            self._update_running(mean, var, n)
        y = (xf - mean) * torch.rsqrt(var + self.eps)
        return (y * self.weight.to(xf) + self.bias.to(xf)).to(x.dtype)

    @torch.no_grad()
    def _update_running(self, mean: Tensor, var: Tensor, n: int):
        unbiased = var * n / max(n - 1, 1)
        self.running_mean.lerp_(mean.to(self.running_mean), self.momentum)
        self.running_var.lerp_(unbiased.to(self.running_var), self.momentum)

    def extra_repr(self) -> str:
        return f"{self.dim}, momentum={self.momentum}, eps={self.eps}"
