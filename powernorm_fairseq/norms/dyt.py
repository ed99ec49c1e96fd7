"""DyT, Dynamic Tanh (Zhu et al., 2025, "Transformers without Normalization",
https://arxiv.org/abs/2503.10622, Eq. 1): y = γ · tanh(α x) + β.

No statistics at all: a learned scalar α squashes each entry, and a gain γ
and bias β per channel follow, as LayerNorm's. α starts at ``alpha_init``
(0.5, the paper's default for models that are not LLMs, Section 7). The norm-free
rival of ``none`` in the norm grids.
"""

from typing import Optional

import torch
from torch import Tensor, nn

from .base import Norm
from .kernels.functions import DYT, row_norm


class DyT(Norm):
    """DyT (Zhu et al., 2025, Eq. 1): gamma * tanh(alpha x) + beta per entry,
    one learned scalar alpha; no statistics."""

    def __init__(self, dim: int, alpha_init: float = 0.5, device=None, dtype=None):
        super().__init__()
        if not alpha_init > 0:
            raise ValueError(f"alpha_init must be positive, got {alpha_init}")
        self.dim, self.alpha_init = dim, alpha_init
        self.alpha = nn.Parameter(torch.full((), alpha_init, device=device, dtype=dtype))
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    @classmethod
    def options(cls, cfg, heads: int, final: bool = False) -> dict:
        return dict(alpha_init=getattr(cfg, "dyt_alpha_init", 0.5))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.alpha.fill_(self.alpha_init)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        # per entry, one fused pass each way (kernels/functions.py, FusedRowNorm): padding rows are computed and
        # never mixed into a real one; the output keeps x's dtype, as every norm's does
        params = self._parameters  # not nn.Module's __getattr__, a call each
        return row_norm(DYT, x, (params["alpha"], params["weight"], params["bias"]))

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha_init={self.alpha_init}"
