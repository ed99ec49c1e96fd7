"""LayerNorm (Ba et al., 2016, https://arxiv.org/abs/1607.06450), as fairseq uses it.

The parameter names match ``fairseq.modules.LayerNorm`` so an LN model of this
plugin has the state dict of a stock fairseq transformer.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Norm


class LayerNorm(Norm):
    """Per-token mean and variance over channels; padding is irrelevant."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
