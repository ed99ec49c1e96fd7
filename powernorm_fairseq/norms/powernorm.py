"""Power Normalization (Shen et al., ICML 2020, "PowerNorm: Rethinking Batch
Normalization in Transformers", https://arxiv.org/abs/2003.07845).

Two members of the family:

* :class:`PowerNormV` ("PN-V"): divide by the quadratic mean of the batch,
  psi_B^2 = mean(x^2) over the real tokens, with the exact gradient (Eq. 6).
* :class:`PowerNorm` ("PN"): divide by a *running* psi^2 in the forward pass
  and use the approximate backward pass of Algorithm 2, whose running term nu
  stands in for the batch-dependent part of Eq. 6.

``backward="reference"`` reproduces what the authors' released code computes
(``fairseq/modules/norms/mask_powernorm.py`` of sIncerass/powernorm), so a
model trained with it can be continued or compared exactly. Each departure
from the paper is marked ``REFERENCE:`` below.
"""

import logging
import math
from typing import Optional

import torch
from torch import Tensor, nn

from . import kernels
from . import sync as sync_mod
from .base import Norm, layer_scale_option, momentum_option
from .batchnorm import BatchStatNorm
from .kernels import functions as fused
from .stats import assign_if_finite, group_scale, real_tokens, token_mean, update_nu, upcast

logger = logging.getLogger(__name__)

#: the released code builds each side's final norm without a warmup argument,
#: so its PN gets NormSelect's default (fairseq/modules/norm_select.py there)
RELEASED_FINAL_WARMUP = 1000


def _affine(xh: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return xh * weight.to(xh) + bias.to(xh)


class PowerNormV(BatchStatNorm):
    """PN-V: x / sqrt(psi_B^2 + eps) with the exact gradient (Eq. 6); running psi^2 for eval."""

    center = False

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5, sync: str = "batch",
                 layer_scale: bool = False, groups: int = 1):
        super().__init__(dim, momentum, eps, sync, layer_scale, groups)
        self.register_buffer("running_psi2", torch.ones(dim))

    @classmethod
    def options(cls, cfg, heads, final=False):
        return dict(eps=cfg.pn_eps, sync=cfg.norm_sync or "batch", layer_scale=layer_scale_option(cfg, False),
                    groups=heads, **momentum_option(cfg))

    update = "pn-v"  # how the kernels update the running statistics (kernels/functions.py)

    def running(self, like):
        return None, self.running_psi2.to(like)

    def kernel_buffers(self):
        return self.running_psi2.new_empty(0), self.running_psi2

    @torch.no_grad()
    def update_running(self, mean, psi2, n):
        # a non-finite psi^2 (overflowed half-precision activations) leaves it alone
        rp = self.running_psi2
        assign_if_finite(rp, rp.lerp(psi2.to(rp), self.momentum), psi2)


class PowerNormFunction(torch.autograd.Function):
    """Forward with a fixed scale; backward replaces the batch term of Eq. 6
    by the running nu (Algorithm 2), or computes it exactly during warmup."""

    @staticmethod
    def forward(ctx, x, keep, n, inv, weight, bias, nu, mode, alpha_bwd, inv_batch, sync="none", n_global=None):
        # x: (T, B, C) float32; keep: (T, B, 1) real-token weights or None;
        # inv: (C,) 1/sqrt(psi^2 + eps) used by the forward pass; n real
        # tokens here, n_global in the union of the workers' batches.
        xh = x * inv
        ctx.save_for_backward(xh, keep, inv, weight, inv_batch)
        ctx.n, ctx.nu, ctx.mode, ctx.alpha_bwd = n, nu, mode, alpha_bwd
        ctx.sync, ctx.n_global = sync, n_global
        return xh * weight + bias

    @staticmethod
    def backward(ctx, grad_y):
        xh, keep, inv, weight, inv_batch = ctx.saved_tensors
        n, nu, rate = ctx.n, ctx.nu, 1.0 - ctx.alpha_bwd
        g = grad_y * weight  # dL/dxh
        if ctx.mode == "reference":
            # REFERENCE: the released update nu += mean(g' * xh), g' = g -
            # (1 - alpha_bwd) nu xh, is Algorithm 2 (Eq. 13) with nu stored
            # as nu_paper / (1 - alpha_bwd). What differs from the paper:
            # its means run over every position, padding included; the
            # result is divided by the *batch* psi_B even after warmup, where
            # the forward pass used the running psi; and during warmup this
            # approximate backward runs instead of the exact one (Eq. 6).
            g = g - rate * nu * xh
            nu.add_((g * xh).mean(dim=(0, 1)))
            grad_x = g * inv_batch
        elif ctx.sync != "none":
            g_xh = g * xh
            masked = (lambda v: v) if keep is None else (lambda v: v * keep)
            local = torch.stack([g_xh.sum(dim=(0, 1)), masked(g_xh).sum(dim=(0, 1)), masked(xh * xh).sum(dim=(0, 1))])
            total = sync_mod.all_sum(local)
            N = ctx.n_global
            lambda_t, gamma_t = total[1] / N, total[2] / N  # Algorithm 2 over the global batch
            if ctx.mode == "exact":  # Eq. 6 over the global batch, or this worker's (running)
                correction = total[0] / N if ctx.sync == "batch" else local[0] / max(n, 1)
            else:
                correction = nu.clone()
        else:
            g_xh = g * xh
            gamma_t = token_mean(xh * xh, keep, n)  # Algorithm 2: Gamma_t = mean(xh^2)
            lambda_t = token_mean(g_xh, keep, n)  # Algorithm 2: Lambda_t = mean(dL/dxh * xh)
            if ctx.mode == "exact":  # warmup: the exact gradient, Eq. 6
                correction = g_xh.sum(dim=(0, 1)) / n
            else:  # Algorithm 2: dL/dxh' = dL/dxh - nu_{t-1} * xh
                correction = nu.clone()
        if ctx.mode != "reference":
            # the correction belongs to the real tokens, which alone make psi
            shift = correction * xh if keep is None else correction * xh * keep
            grad_x = (g - shift) * inv
            update_nu(nu, rate, gamma_t=gamma_t, lambda_t=lambda_t)
        grad_weight = (grad_y * xh).sum(dim=(0, 1))
        grad_bias = grad_y.sum(dim=(0, 1))
        return grad_x, None, None, None, grad_weight, grad_bias, None, None, None, None, None, None


class PowerNorm(Norm):
    """PN: running quadratic mean forward, Algorithm 2 backward.

    For the first ``warmup_updates`` training forwards it behaves as PN-V
    (batch statistic, exact gradient) while psi^2 is the cumulative mean of
    the batch statistics; nu already follows Algorithm 2's update then, so the
    approximate backward starts from a current estimate.
    """

    running_stats = True

    def __init__(
        self,
        dim: int,
        alpha_fwd: float = 0.9,
        alpha_bwd: float = 0.9,
        warmup_updates: int = 0,
        eps: float = 1e-5,
        layer_scale: bool = False,
        groups: int = 1,
        backward: str = "paper",
        sync: Optional[str] = None,
        group_scaling: Optional[bool] = None,
    ):
        super().__init__()
        if group_scaling is not None:  # the earlier, pn-only spelling of layer_scale
            if layer_scale and not group_scaling:
                raise ValueError("layer_scale=True contradicts group_scaling=False; pass layer_scale alone")
            layer_scale = group_scaling
        if sync is None:  # the released code never synchronised
            sync = "none" if backward == "reference" else "batch"
        sync_mod.active(sync)  # validates
        if backward == "reference" and sync != "none":
            raise ValueError("backward='reference' reproduces the released code, which never "
                             f"synchronised its statistics: use sync='none', got {sync!r}")
        for name, alpha in (("alpha_fwd", alpha_fwd), ("alpha_bwd", alpha_bwd)):
            if not 0.0 < alpha < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {alpha}")
        if backward not in ("paper", "reference"):
            raise ValueError(f"backward must be 'paper' or 'reference', got {backward!r}")
        if warmup_updates < 0:
            raise ValueError(f"warmup_updates must be >= 0, got {warmup_updates}")
        if groups < 1 or dim % groups:
            raise ValueError(f"groups must divide dim={dim}, got {groups}")
        self.dim, self.eps = dim, eps
        self.alpha_fwd, self.alpha_bwd = alpha_fwd, alpha_bwd
        self.warmup_updates, self.backward = warmup_updates, backward
        self.layer_scale, self.groups, self.sync = layer_scale, groups, sync
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_psi2", torch.ones(dim))
        self.register_buffer("running_nu", torch.zeros(dim))
        self.register_buffer("num_steps", torch.tensor(0, dtype=torch.long))
        # running_nu is nu_paper times this: the released code stores nu / (1 - alpha_bwd)
        self.register_buffer("nu_scale", torch.tensor(self._own_nu_scale()))
        # num_steps on the host, so that a step never waits to read it: set
        # here and by a load (from the state dict's value, at load time)
        self._steps = 0

    @property
    def group_scaling(self) -> bool:
        """The earlier name of ``layer_scale``."""
        return self.layer_scale

    def _next_step(self) -> int:
        """k of the coming training forward (1-based); :meth:`_count_step` commits it."""
        return self._steps + 1

    def _count_step(self, k: int):
        self._steps = k
        self.num_steps.fill_(k)

    @classmethod
    def options(cls, cfg, heads, final=False):
        reference = cfg.pn_backward == "reference"
        return dict(
            alpha_fwd=cfg.pn_alpha_fwd,
            alpha_bwd=cfg.pn_alpha_bwd,
            warmup_updates=RELEASED_FINAL_WARMUP if final and reference else cfg.pn_warmup_updates,
            eps=cfg.pn_eps,
            # the layer scale: on unless --no-layer-scale (or its pn-only spelling --no-pn-group-scaling)
            layer_scale=layer_scale_option(cfg, cfg.pn_group_scaling is not False),
            groups=heads,
            backward=cfg.pn_backward,
            sync=cfg.norm_sync,
        )

    def diagnostics_view(self, x, pad_mask):
        xs = self.scaled(upcast(x))
        keep, n = real_tokens(xs, pad_mask)
        psi2 = token_mean(xs * xs, keep, n)
        running = self.running_psi2.to(xs, copy=True)
        warm = self._next_step() <= self.warmup_updates
        inv = torch.rsqrt((psi2 if warm else running) + self.eps)  # the scale the forward uses
        return {"psi2": (psi2, running)}, (xs, None, inv)

    def _own_nu_scale(self) -> float:
        return 1.0 / (1.0 - self.alpha_bwd) if self.backward == "reference" else 1.0

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "num_steps" in state_dict:
            self._steps = int(state_dict[prefix + "num_steps"])
        own, key, nu_key = self._own_nu_scale(), prefix + "nu_scale", prefix + "running_nu"
        if key not in state_dict:  # saved before the scale was recorded: taken as this backward's
            state_dict[key] = torch.tensor(own)
        saved = float(state_dict[key])
        if nu_key in state_dict and not math.isclose(saved, own, rel_tol=1e-6):
            # nu from the other backward: the same estimate on another scale
            state_dict[nu_key] = state_dict[nu_key] * (own / saved)
            state_dict[key] = torch.tensor(own)
            logger.info("%srunning_nu: converted from the %s backward's scale to the %s backward's",
                        prefix, "paper" if saved == 1.0 else "reference", self.backward)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        if not self.training:  # the running psi^2, no update
            return self._with_running_psi2(self.scaled(upcast(x))).to(x.dtype)
        k = kernels.select(x)
        if k is not None:
            return self._fused(k, x if x.dtype in k.DTYPES else upcast(x), pad_mask).to(x.dtype)
        if sync_mod.active(self.sync):
            return self._synced(upcast(x), pad_mask).to(x.dtype)
        if pad_mask is not None and bool(pad_mask.all()):  # a training batch that is all padding: no update
            return self._with_running_psi2(self.scaled(upcast(x))).to(x.dtype)
        step = self._next_step()
        self._count_step(step)
        warm = step <= self.warmup_updates  # batch statistics in the forward (PN-V) while warm
        mode = "reference" if self.backward == "reference" else "exact" if warm else "paper"
        y, psi2_batch = self._plain(upcast(x), pad_mask, mode, warm)
        self._update_psi2(psi2_batch, step, warm)
        return y.to(x.dtype)

    def scaled(self, xf: Tensor) -> Tensor:
        """The input psi^2 is taken of: group-scaled if asked."""
        return group_scale(xf, self.groups) if self.layer_scale else xf

    def _with_running_psi2(self, xs):
        """Eval, or a training batch without real tokens: the running psi^2, no update."""
        return _affine(xs * torch.rsqrt(self.running_psi2.to(xs) + self.eps), self.weight, self.bias)

    def _update_psi2(self, psi2_batch, k, warm):
        with torch.no_grad():  # psi^2_t, after the forward used psi^2_{t-1}
            psi2, psi2_batch = self.running_psi2.clone(), psi2_batch.to(self.running_psi2)
            if self.backward == "reference":
                # REFERENCE: the cumulative mean stops one step before the
                # warmup does, and the exponential average is applied on top
                # of it at every step, warmup included.
                if k < self.warmup_updates:
                    psi2.mul_((k - 1) / k).add_(psi2_batch / k)
                psi2.lerp_(psi2_batch, 1.0 - self.alpha_fwd)
            elif warm:
                psi2.mul_((k - 1) / k).add_(psi2_batch / k)  # cumulative mean
            else:
                psi2.lerp_(psi2_batch, 1.0 - self.alpha_fwd)  # Algorithm 2: psi_t^2
            # overflowed half-precision activations leave the running psi^2 alone
            assign_if_finite(self.running_psi2, psi2, psi2_batch)

    def _synced(self, xf, pad_mask):
        """Training under ``--norm-sync batch|running`` (plain PyTorch operations)."""
        xs = group_scale(xf, self.groups) if self.layer_scale else xf
        keep, n = real_tokens(xs, pad_mask)
        N, _, psi2_global = sync_mod.moments(xs, keep, center=False)
        if N == 0:  # every worker's batch is padding: as in eval, no update
            return self._with_running_psi2(xs)
        k = self._next_step()
        self._count_step(k)
        warm = k <= self.warmup_updates
        psi2_global = psi2_global.to(xs)
        if self.sync == "batch" or n == 0:
            psi2_batch = psi2_global
        else:
            psi2_batch = token_mean(xs * xs, keep, n).detach()
        inv_batch = torch.rsqrt(psi2_batch + self.eps)
        inv = inv_batch if warm else torch.rsqrt(self.running_psi2.to(xs) + self.eps)
        y = PowerNormFunction.apply(
            xs, keep, n, inv, self.weight.to(xs), self.bias.to(xs), self.running_nu,
            "exact" if warm else "paper", self.alpha_bwd, inv_batch, self.sync, N,
        )
        self._update_psi2(psi2_global, k, warm)
        return y

    def _fused(self, k, x, pad_mask):
        """On backend ``k``: after warmup one pass each way (the forward sums
        psi_B^2 for the running average while it normalises with psi^2_{t-1});
        during warmup a statistics pass first, and the exact gradient in two.
        The kernels count the step on the device (a batch of padding is not a
        step); the host counts the training forwards, which decide the warmup."""
        step = self._next_step()
        self._steps = step
        warm = step <= self.warmup_updates
        if self.backward == "reference":
            update, mode = ("reference-warm" if warm else "reference"), "reference"
        else:
            update, mode = ("pn-warm", "exact") if warm else ("pn", "paper")
        groups = self.groups if self.layer_scale else 0
        plan = fused.Step(k.NAME, groups, False, update, mode, 1.0 - self.alpha_fwd, self.eps, self.warmup_updates,
                          1.0 - self.alpha_bwd, self.sync if sync_mod.active(self.sync) else "none")
        x2, mask = fused.rows(x, pad_mask)
        y = fused.FusedChannelNorm.apply(x2, mask, self.weight, self.bias, x.new_empty(0), self.running_psi2,
                                         self.num_steps, self.running_nu, plan)
        return y.view_as(x)

    def _plain(self, xf, pad_mask, mode, batch_scale):
        """The same computation in plain PyTorch operations."""
        if self.layer_scale:
            xf = group_scale(xf, self.groups)
        keep, n = real_tokens(xf, pad_mask)
        psi2_batch = token_mean(xf * xf, keep, n).detach()  # psi_B^2
        inv_batch = torch.rsqrt(psi2_batch + self.eps)
        inv = inv_batch if batch_scale else torch.rsqrt(self.running_psi2.to(xf) + self.eps)
        y = PowerNormFunction.apply(
            xf, keep, n, inv, self.weight.to(xf), self.bias.to(xf),
            self.running_nu, mode, self.alpha_bwd, inv_batch,
        )
        return y, psi2_batch

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, alpha_fwd={self.alpha_fwd}, alpha_bwd={self.alpha_bwd}, "
            f"warmup_updates={self.warmup_updates}, eps={self.eps}, "
            f"layer_scale={self.layer_scale}, groups={self.groups}, "
            f"backward={self.backward!r}, sync={self.sync!r}"
        )
