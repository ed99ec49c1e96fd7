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

from . import sync as sync_mod
from .base import Norm, layer_scale_option, momentum_option, recomputing
from .kernels import functions as fused
from .kernels.contract import Mode, Update
from .kernels import plain
from .stats import group_scale, real_tokens, token_mean, upcast


class BatchStatNorm(Norm):
    """What BN and PN-V share: statistics of the batch's real tokens with the
    exact gradient in training, running statistics in eval. ``center`` says
    whether the mean is removed (BN) or not (PN-V).

    ``layer_scale``: the paper's "layer-scale layer ... before the
    normalization layer" (Appendix A), the authors' per-token RMS scaling of
    each of ``groups`` channel groups (:func:`stats.group_scale`); the
    statistics are then those of the scaled input, and the gradient flows
    back through the scaling.

    ``causal``: normalise with the running statistics in training too (they
    are updated from the batch after the forward, and are constants of the
    gradient), so no token's output depends on another token of the batch:
    for causal decoders, where batch statistics leak later tokens.

    ``unit_offset``: the gain is stored as gamma - 1 and read as 1 + gamma (``Norm.offset_gain``).

    Every training step runs on the backend :func:`kernels.select` gives
    (``kernels/functions.py``); a recomputation of activation checkpointing
    gives the first forward's output again and updates nothing."""

    center = True
    running_stats = True

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5, sync: str = "batch",
                 layer_scale: bool = False, groups: int = 1, causal: bool = False, unit_offset: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"momentum must be in (0, 1), got {momentum}")
        if groups < 1 or dim % groups:
            raise ValueError(f"groups must divide dim={dim}, got {groups}")
        sync_mod.active(sync)  # validates
        self.dim, self.momentum, self.eps, self.sync = dim, momentum, eps, sync
        self.layer_scale, self.groups, self.causal = layer_scale, groups, causal
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        self.offset_gain(unit_offset)
        self._given = None  # the statistics the last training forward was given (causal), for its replay

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
        if not self.training:
            return self._with_running(x).to(x.dtype)
        config = self.step_config()
        given, mode, replay = None, Mode.EXACT, recomputing()
        if self.causal:
            mode = Mode.FIXED
            given = self._given if replay else (
                config.mean_buf.clone() if self.center else None, plain.running_scale(config.second_buf, self.eps))
            self._given = None if replay else given
        else:
            self.warn_leak("bn" if self.center else "pn-v")
        params = self._parameters  # not nn.Module's __getattr__, a call each (measure/host.py)
        y, _ = fused.channel_norm(x, pad_mask, params["weight"], params["bias"], config, self.update, mode, given,
                                  replay)
        return y

    def make_step_config(self):
        mean_buf, second_buf = self.kernel_buffers()
        return fused.ChannelConfig(center=self.center, groups=self.groups if self.layer_scale else 0,
                                   momentum=self.momentum, eps=self.eps, sync=self.sync, mean_buf=mean_buf,
                                   second_buf=second_buf, w_offset=self.w_offset)

    def _normalized(self, xf: Tensor, mean: Optional[Tensor], second: Tensor) -> Tensor:
        """gamma * (xf - mean) / sqrt(var + eps) + beta (Eq. 3's forward; no
        mean and second = psi^2 for PN-V, Eq. 6's)."""
        y = (xf - mean if mean is not None else xf) * torch.rsqrt(second + self.eps)
        return y * self.gain(xf) + self.bias.to(xf)

    def scaled(self, xf: Tensor) -> Tensor:
        """The input the statistics are taken of: layer-scaled if asked."""
        return group_scale(xf, self.groups) if self.layer_scale else xf

    def _with_running(self, x: Tensor) -> Tensor:
        """Normalised with the running statistics, as in eval."""
        xf = self.scaled(upcast(x))
        return self._normalized(xf, *self.running(xf))

    def running(self, like: Tensor) -> Tuple[Optional[Tensor], Tensor]:
        raise NotImplementedError

    def kernel_buffers(self) -> Tuple[Optional[Tensor], Tensor]:
        """(running mean or None, running second moment) that the kernels update in place (from
        ``_buffers``, not through nn.Module's __getattr__, a call each: measure/host.py)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        scale = f", layer_scale=True, groups={self.groups}" if self.layer_scale else ""
        causal = ", causal=True" if self.causal else ""
        return (f"{self.dim}, momentum={self.momentum}, eps={self.eps}, sync={self.sync!r}{scale}{causal}"
                + self.offset_repr())


class MaskedBatchNorm(BatchStatNorm):
    """BatchNorm whose batch is the set of real tokens of a (T, B, C) input."""

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5, sync: str = "batch",
                 layer_scale: bool = False, groups: int = 1, causal: bool = False, unit_offset: bool = False,
                 device=None, dtype=None):
        super().__init__(dim, momentum, eps, sync, layer_scale, groups, causal, unit_offset, device, dtype)
        self.register_buffer("running_mean", torch.zeros(dim, device=device))
        self.register_buffer("running_var", torch.ones(dim, device=device))

    def reset_running_stats(self) -> None:
        self.running_mean.zero_()
        self.running_var.fill_(1.0)

    update = Update.BN  # how the kernels update the running statistics

    def running(self, like):
        return self.running_mean.to(like), self.running_var.to(like)

    def kernel_buffers(self):
        return self._buffers["running_mean"], self._buffers["running_var"]

    def diagnostics_view(self, x, pad_mask):
        xs = self.scaled(upcast(x))
        keep, n = real_tokens(xs, pad_mask)
        return self._mean_var_view(xs, keep, n)

    def _mean_var_view(self, xs, keep, n):
        mean = token_mean(xs, keep, n)
        var = token_mean((xs - mean) ** 2, keep, n)
        stats = {"mu": (mean, self.running_mean.to(xs, copy=True)), "var": (var, self.running_var.to(xs, copy=True))}
        return stats, (xs, mean, torch.rsqrt(var + self.eps))


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

    def __init__(self, dim: int, momentum: float = 0.05, eps: float = 1e-5, sync: str = "none",
                 unit_offset: bool = False, device=None, dtype=None):
        if sync != "none":
            raise ValueError(f"bn-original reproduces code that never synchronised its statistics: "
                             f"use sync='none', got {sync!r}")
        super().__init__(dim, momentum, eps, sync, unit_offset=unit_offset, device=device, dtype=dtype)
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))

    def reset_running_stats(self) -> None:
        super().reset_running_stats()
        self.num_batches_tracked.zero_()

    @classmethod
    def options(cls, cfg, heads, final=False):
        return momentum_option(cfg)  # never synchronised, its own layer scale

    def diagnostics_view(self, x, pad_mask):
        xs, _ = self.fill(upcast(x), pad_mask)  # its batch: every position, padding filled
        return self._mean_var_view(xs, None, xs.size(0) * xs.size(1))

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        xs, n = self.fill(upcast(x), pad_mask)
        mean, var = self.running(xs)
        if self.training:  # a batch of padding (n = 0) normalises as eval does and updates nothing
            self.warn_leak("bn-original")
            real = n > 0  # decided on the device: nothing waits, and a compiled graph does not break
            batch_mean = xs.mean(dim=(0, 1))
            batch_var = (xs - batch_mean).pow(2).mean(dim=(0, 1))
            mean, var = torch.where(real, batch_mean, mean), torch.where(real, batch_var, var)
            if not recomputing():  # activation checkpointing's second forward updates nothing
                with torch.no_grad():
                    self.num_batches_tracked.add_(real.to(self.num_batches_tracked.dtype))
                    rm, rv = self.running_mean, self.running_var
                    new_mean, new_var = rm.lerp(batch_mean.to(rm), self.momentum), rv
                    T_B = xs.size(0) * xs.size(1)
                    if T_B > 1:  # its running variance: the unbiased one over every position
                        new_var = rv.lerp((batch_var * T_B / (T_B - 1)).to(rv), self.momentum)
                    ok = real & torch.isfinite(batch_mean).all() & torch.isfinite(batch_var).all()
                    rm.copy_(torch.where(ok, new_mean, rm))
                    rv.copy_(torch.where(ok, new_var, rv))
        y = (xs - mean) * torch.rsqrt(var + self.eps)
        return (y * self.gain(xs) + self.bias.to(xs)).to(x.dtype)

    def fill(self, xf: Tensor, pad_mask: Optional[Tensor]):
        """The layer-scaled input with its padding filled, and the real-token count (a tensor)."""
        xs = group_scale(xf, 1)
        if pad_mask is None:
            return xs, torch.full((), xs.size(0) * xs.size(1), device=xs.device)
        keep = (~pad_mask).t().unsqueeze(-1)
        n = keep.sum()
        return torch.where(keep, xs, token_mean(xs, keep, n.clamp(min=1))), n
