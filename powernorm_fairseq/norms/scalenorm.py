"""ScaleNorm (Nguyen & Salazar, 2019, "Transformers without Tears",
https://arxiv.org/abs/1910.05895, Eq. 8): ``g * x / max(||x||, eps)``.

One learned scalar ``g`` per layer, initialised to ``sqrt(C)`` so that the
output starts with the per-channel scale of a unit-variance input.
"""

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .base import Norm
from .kernels.functions import SCALENORM, row_norm


class ScaleNorm(Norm):
    """Per-token l2 normalisation to a learned length."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.scale = nn.Parameter(torch.tensor(math.sqrt(dim), device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.fill_(math.sqrt(self.dim))

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        return row_norm(SCALENORM, x, (self._parameters["scale"],), self.eps)  # no __getattr__ call

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
