"""ScaleNorm (Nguyen & Salazar, 2019, "Transformers without Tears",
https://arxiv.org/abs/1910.05895, Eq. 8): ``g * x / max(||x||, eps)``.

One learned scalar ``g`` per layer, initialised to ``sqrt(C)`` so that the
output starts with the per-channel scale of a unit-variance input.
"""

import math
from typing import Optional

import torch
from torch import Tensor, nn

from . import fused
from .base import Norm, upcast


class ScaleNorm(Norm):
    """Per-token l2 normalisation to a learned length."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.scale = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        xf = upcast(x)
        if fused.usable(xf):
            x2 = xf.contiguous().view(-1, self.dim)
            return fused.FusedScaleNorm.apply(x2, self.scale.to(xf), self.eps).view_as(x).to(x.dtype)
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        return (self.scale.to(xf) * xf / norm.clamp(min=self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
