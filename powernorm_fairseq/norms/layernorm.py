"""LayerNorm (Ba et al., 2016, https://arxiv.org/abs/1607.06450) and its
variants from Xu et al. (2019), "Understanding and Improving Layer
Normalization" (https://arxiv.org/abs/1911.07013), plus GroupNorm over the
channels of each token (Wu & He, 2018, https://arxiv.org/abs/1803.08494).

All are per token: padding is irrelevant. ``LayerNorm``'s parameter names
match ``fairseq.modules.LayerNorm`` so an LN model of this plugin has the state
dict of a stock fairseq transformer. The variants of Xu et al. have no gain and
bias, as in that paper.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Norm
from .stats import upcast


class LayerNorm(Norm):
    """fairseq's LayerNorm: per-token mean and variance over the channels,
    with its parameter names (an ln model has a stock state dict)."""

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        self.offset_gain(unit_offset)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        # torch's kernel takes the gain as given: a unit-offset gain is 1 + gamma in its own dtype, one
        # elementwise op of C entries more per forward
        weight = self.weight + self.w_offset if self.w_offset else self.weight
        return F.layer_norm(x, (self.dim,), weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + self.offset_repr()


STDS = ("biased", "unbiased")


def _moments(xf: Tensor, eps: float, std: str):
    """Per-token mean and the divisor: sqrt(var + eps) with the biased variance
    (torch's LayerNorm), or the unbiased std + eps (Xu et al.'s code)."""
    mean = xf.mean(dim=-1, keepdim=True)
    if std == "unbiased":
        return mean, xf.std(dim=-1, keepdim=True) + eps
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    return mean, torch.sqrt(var + eps)


def _check_std(std: str):
    if std not in STDS:
        raise ValueError(f"std must be one of {', '.join(STDS)}, got {std!r}")


class LayerNormSimple(Norm):
    """LayerNorm-simple (Xu et al., 2019, Section 3): LN without gain and bias.
    ``std="unbiased"`` divides by the unbiased std + eps, as the authors' code
    (lancopku/AdaNorm) does, instead of LayerNorm's sqrt(biased var + eps)."""

    def __init__(self, dim: int, eps: float = 1e-5, std: str = "biased", device=None, dtype=None):
        super().__init__()
        _check_std(std)
        self.dim, self.eps, self.std = dim, eps, std

    @classmethod
    def options(cls, cfg, heads, final=False):
        return dict(std=cfg.layernorm_simple_std)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        if self.std == "biased":
            return F.layer_norm(upcast(x), (self.dim,), None, None, self.eps).to(x.dtype)
        mean, std = _moments(upcast(x), self.eps, self.std)
        return ((upcast(x) - mean) / std).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, std={self.std!r}"


class DetachNorm(Norm):
    """DetachNorm (Xu et al., 2019, Section 3): LayerNorm-simple whose mean and
    standard deviation are constants in the backward pass; ``detach`` picks
    both (the paper's), only the mean, or only the variance; ``std`` as in
    :class:`LayerNormSimple`."""

    DETACH = ("both", "mean", "var")

    def __init__(self, dim: int, eps: float = 1e-5, detach: str = "both", std: str = "biased", device=None,
                 dtype=None):
        super().__init__()
        if detach not in self.DETACH:
            raise ValueError(f"detach must be one of {', '.join(self.DETACH)}, got {detach!r}")
        _check_std(std)
        self.dim, self.eps, self.detach, self.std = dim, eps, detach, std

    @classmethod
    def options(cls, cfg, heads, final=False):
        return dict(detach=cfg.detachnorm_detach, std=cfg.layernorm_simple_std)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        xf = upcast(x)
        mean, std = _moments(xf, self.eps, self.std)
        if self.detach in ("both", "mean"):
            mean = mean.detach()
        if self.detach in ("both", "var"):
            std = std.detach()
        return ((xf - mean) / std).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, detach={self.detach!r}, std={self.std!r}"


class AdaNorm(Norm):
    """AdaNorm (Xu et al., 2019, Eq. 8-9): z = C (1 - k y) y with y = (x - mu) / (sigma + eps),
    k = 1/10, the factor (1 - k y) a constant in the backward pass, and sigma the
    unbiased standard deviation, as in the authors' code."""

    K = 0.1

    def __init__(self, dim: int, eps: float = 1e-5, scale: float = 1.0, device=None, dtype=None):
        super().__init__()
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.dim, self.eps, self.scale = dim, eps, scale

    @classmethod
    def options(cls, cfg, heads, final=False):
        return dict(scale=cfg.adanorm_scale)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        if x.numel() == 0:  # no tokens: nothing to normalise (std() over none warns)
            return x.clone()
        xf = upcast(x)
        centred = xf - xf.mean(dim=-1, keepdim=True)
        y = centred / (xf.std(dim=-1, keepdim=True) + self.eps)
        return (self.scale * (1 - self.K * y).detach() * y).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, scale={self.scale}"


class GroupNorm(Norm):
    """Per token, LayerNorm over each of ``groups`` channel groups, then a gain
    and bias per channel (GroupNorm with one token as the spatial extent)."""

    def __init__(self, dim: int, groups: int = 4, eps: float = 1e-5, unit_offset: bool = False, device=None,
                 dtype=None):
        super().__init__()
        if groups < 1 or dim % groups:
            raise ValueError(f"groups must divide dim={dim}, got {groups}")
        self.dim, self.groups, self.eps = dim, groups, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        self.offset_gain(unit_offset)

    @classmethod
    def options(cls, cfg, heads, final=False):
        return dict(groups=cfg.norm_groups or heads)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        xf = upcast(x)
        xg = xf.reshape(*x.shape[:-1], self.groups, self.dim // self.groups)
        y = F.layer_norm(xg, (self.dim // self.groups,), None, None, self.eps).reshape_as(xf)
        return (y * self.gain(xf) + self.bias.to(xf)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, groups={self.groups}, eps={self.eps}" + self.offset_repr()
