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
model trained with it can be continued or compared exactly; its departures
from the paper are the ``REFERENCE`` update and mode (``kernels/contract.py``).
"""

import logging
import math
from typing import Optional

import torch
from torch import Tensor, nn

from . import sync as sync_mod
from .base import Norm, layer_scale_option, momentum_option, recomputing
from .batchnorm import BatchStatNorm
from .clock import Clock
from .kernels import functions as fused
from .kernels import plain
from .kernels.contract import RUNNING_SCALE, Mode, Update
from .stats import group_scale, real_tokens, token_mean, upcast

logger = logging.getLogger(__name__)

#: the released code builds each side's final norm without a warmup argument,
#: so its PN gets NormSelect's default (fairseq/modules/norm_select.py there)
RELEASED_FINAL_WARMUP = 1000


class PowerNormV(BatchStatNorm):
    """PN-V: x / sqrt(psi_B^2 + eps) with the exact gradient (Eq. 6); running psi^2 for eval."""

    center = False

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-5, sync: str = "batch",
                 layer_scale: bool = False, groups: int = 1, causal: bool = False, unit_offset: bool = False,
                 device=None, dtype=None):
        super().__init__(dim, momentum, eps, sync, layer_scale, groups, causal, unit_offset, device, dtype)
        self.register_buffer("running_psi2", torch.ones(dim, device=device))

    def reset_running_stats(self) -> None:
        self.running_psi2.fill_(1.0)

    @classmethod
    def options(cls, cfg, heads, final=False):
        return dict(eps=cfg.pn_eps, sync=cfg.norm_sync or "batch", layer_scale=layer_scale_option(cfg, False),
                    groups=heads, **momentum_option(cfg))

    update = Update.PN_V  # how the kernels update the running statistics

    def running(self, like):
        return None, self.running_psi2.to(like)

    def kernel_buffers(self):
        return None, self._buffers["running_psi2"]


class PowerNorm(Norm):
    """PN: running quadratic mean forward, Algorithm 2 backward.

    For the first ``warmup_updates`` training steps it behaves as PN-V (batch
    statistic, exact gradient) while psi^2 is the cumulative mean of the batch
    statistics; nu already follows Algorithm 2's update then, so the
    approximate backward starts from a current estimate. A step is a training
    forward with at least one real token: a batch of padding updates nothing
    and counts for nothing, on every backend. ``causal``: during the warmup
    normalise with the running psi^2 too (after it, PN never uses the batch's
    statistics in the forward, and leaks nothing in a causal decoder).
    """

    running_stats = True

    def __init__(self, dim: int, alpha_fwd: float = 0.9, alpha_bwd: float = 0.9, warmup_updates: int = 0,
                 eps: float = 1e-5, layer_scale: bool = False, groups: int = 1, backward: str = "paper",
                 sync: Optional[str] = None, group_scaling: Optional[bool] = None, causal: bool = False,
                 unit_offset: bool = False, device=None, dtype=None):
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
        if backward == "reference" and causal:
            raise ValueError("backward='reference' reproduces the released code, which has no causal mode")
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
        self.warmup_updates, self.backward, self.causal = warmup_updates, backward, causal
        self.layer_scale, self.groups, self.sync = layer_scale, groups, sync
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        self.offset_gain(unit_offset)
        self.register_buffer("running_psi2", torch.ones(dim, device=device))
        self.register_buffer("running_nu", torch.zeros(dim, device=device))
        self.register_buffer("num_steps", torch.tensor(0, dtype=torch.long, device=device))
        # running_nu is nu_paper times this: the released code stores nu / (1 - alpha_bwd)
        self.register_buffer("nu_scale", torch.tensor(self._own_nu_scale(), device=device))
        self._clock = Clock(warmup_updates)  # the phase on the host (clock.py); set again by a load
        self._last = None  # (warm, given inv) of the last training forward, for its replay

    @property
    def group_scaling(self) -> bool:
        """The earlier name of ``layer_scale``."""
        return self.layer_scale

    def reset_running_stats(self) -> None:
        self.running_psi2.fill_(1.0)
        self.running_nu.zero_()
        self.num_steps.zero_()
        self._clock.set(0)

    @classmethod
    def options(cls, cfg, heads, final=False):
        reference = cfg.pn_backward == "reference"
        return dict(alpha_fwd=cfg.pn_alpha_fwd, alpha_bwd=cfg.pn_alpha_bwd, eps=cfg.pn_eps, groups=heads,
                    warmup_updates=RELEASED_FINAL_WARMUP if final and reference else cfg.pn_warmup_updates,
                    # the layer scale: on unless --no-layer-scale (or its pn-only spelling --no-pn-group-scaling)
                    layer_scale=layer_scale_option(cfg, cfg.pn_group_scaling is not False),
                    backward=cfg.pn_backward, sync=cfg.norm_sync)

    def diagnostics_view(self, x, pad_mask):
        xs = self.scaled(upcast(x))
        keep, n = real_tokens(xs, pad_mask)
        psi2 = token_mean(xs * xs, keep, n)
        running = self.running_psi2.to(xs, copy=True)
        warm = self._clock.warm and not self.causal
        inv = torch.rsqrt((psi2 if warm else running) + self.eps)  # the scale the forward uses
        return {"psi2": (psi2, running)}, (xs, None, inv)

    def _own_nu_scale(self) -> float:
        return 1.0 / (1.0 - self.alpha_bwd) if self.backward == "reference" else 1.0

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "num_steps" in state_dict:
            self._clock.set(int(state_dict[prefix + "num_steps"]))
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

    def make_step_config(self):
        bufs = self._buffers
        return fused.ChannelConfig(center=False, groups=self.groups if self.layer_scale else 0,
                                   momentum=1.0 - self.alpha_fwd, eps=self.eps, sync=self.sync,
                                   second_buf=bufs["running_psi2"], steps=bufs["num_steps"], nu=bufs["running_nu"],
                                   warmup=self.warmup_updates, rate=1.0 - self.alpha_bwd, clock=self._clock.key,
                                   w_offset=self.w_offset)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        """Eval: the running psi^2, no update. Training: one fused step
        (``kernels/functions.py``), with PN-V's statistics and exact gradient
        in the warmup and Algorithm 2 after it."""
        if not self.training:
            xs = self.scaled(upcast(x))
            y = xs * torch.rsqrt(self.running_psi2.to(xs) + self.eps) * self.gain(xs) + self.bias.to(xs)
            return y.to(x.dtype)
        replay = recomputing()  # activation checkpointing: the first forward's plan and scale again
        warm, given = self._last if replay else (self._clock.warm, None)
        if self.backward == "reference":
            update, mode = (Update.REFERENCE_WARM if warm else Update.REFERENCE), Mode.REFERENCE
        elif warm:
            update, mode = Update.PN_WARM, Mode.FIXED if self.causal else Mode.EXACT
            if self.causal and not replay:
                given = plain.running_scale(self.running_psi2, self.eps)
            elif not self.causal:
                self.warn_leak("pn (in its warmup)")
        else:
            update, mode = Update.PN, Mode.PAPER
        params, config = self._parameters, self.step_config()  # not nn.Module's __getattr__, a call each
        y, inv = fused.channel_norm(x, pad_mask, params["weight"], params["bias"], config, update, mode,
                                    None if given is None else (None, given), replay)
        if not replay:  # what a recomputation of this forward must use again (a plain attribute, set without a call)
            self.__dict__["_last"] = (warm, inv if given is not None or update in RUNNING_SCALE else None)
        return y

    def scaled(self, xf: Tensor) -> Tensor:
        """The input psi^2 is taken of: group-scaled if asked."""
        return group_scale(xf, self.groups) if self.layer_scale else xf

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, alpha_fwd={self.alpha_fwd}, alpha_bwd={self.alpha_bwd}, "
            f"warmup_updates={self.warmup_updates}, eps={self.eps}, "
            f"layer_scale={self.layer_scale}, groups={self.groups}, "
            f"backward={self.backward!r}, sync={self.sync!r}" + (", causal=True" if self.causal else "")
            + self.offset_repr()
        )
