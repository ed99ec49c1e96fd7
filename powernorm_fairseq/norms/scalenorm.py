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
from .kernels.contract import RowKind, row_kind
from .kernels.functions import row_norm
from .kernels.plain import _acc, _into, _rows


def _forward(x, scale, eps):
    """Eq. 8 per row: (y, the clamped norms)."""
    N, _ = _rows(x)
    xa = x.to(_acc(x))
    norms = torch.linalg.vector_norm(xa, dim=-1).clamp(min=eps)
    y, out = _into(x)
    torch.mul(xa, (scale.to(xa) / norms).unsqueeze(-1), out=out)
    return y, norms.reshape(N)


def _backward(x, norms, grad_y, scale, eps):
    """dL/dx = g / n (dy - x <dy, x> / n^2) (g / eps dy where clamped); dL/dg = sum <dy, x> / n."""
    xa, gy, norms = x.to(_acc(x)), grad_y.view(x.shape).to(_acc(x)), norms.view(x.shape[:-1])
    dot = (gy * xa).sum(-1)
    k = torch.where(norms > eps, dot / (norms * norms), torch.zeros_like(dot))
    gx, out = _into(x)
    torch.mul((scale.to(xa) / norms).unsqueeze(-1), gy - xa * k.unsqueeze(-1), out=out)
    return [gx, (dot.double() / norms).sum().to(scale.dtype)]


#: the kind's description: the kernels' (csrc/cpu_rows.h, gpu_rows.py) by name, these passes the plain backend's
SCALENORM = row_kind(RowKind("scalenorm", ("scale",), True, _forward, _backward, gain="scale"))


class ScaleNorm(Norm):
    """Per-token l2 normalisation to a learned length."""

    GAIN = "scale"

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.scale = nn.Parameter(torch.tensor(math.sqrt(dim), device=device, dtype=dtype))
        self.offset_gain(unit_offset)

    def initial_gain(self) -> float:
        return math.sqrt(self.dim)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        return row_norm(SCALENORM, x, (self._parameters["scale"],), self.eps, self.w_offset)  # no __getattr__ call

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + self.offset_repr()
