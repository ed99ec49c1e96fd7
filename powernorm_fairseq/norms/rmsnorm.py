"""RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization",
https://arxiv.org/abs/1910.07467, Eq. 4): x / sqrt(mean(x^2) + eps) * g per
token, g one gain per channel initialised to 1. The per-token cousin of PN-V,
which takes the same quadratic mean over the batch instead of the channels."""

from typing import Optional

import torch
from torch import Tensor, nn

from .base import Norm
from .kernels.functions import FusedRMSNorm, row_norm


class RMSNorm(Norm):
    """RMSNorm (Zhang & Sennrich, 2019, Eq. 4): x / sqrt(mean(x^2) + eps) * g per token, g per channel."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        return row_norm(FusedRMSNorm, x, (self._parameters["weight"],), self.eps)  # no __getattr__ call

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
