"""DyT, Dynamic Tanh (Zhu et al., 2025, "Transformers without Normalization",
https://arxiv.org/abs/2503.10622, Eq. 1): y = γ · tanh(α x) + β.

No statistics at all: a learned scalar α squashes each entry, and a gain γ
and bias β per channel follow, as LayerNorm's. α starts at ``alpha_init``
(0.5, the paper's default for models that are not LLMs, Section 7). The norm-free
rival of ``none`` in the norm grids.
"""

from typing import Optional

import torch
from torch import Tensor

from ..common.flags import positive
from .base import Flag
from .entry import EntryNorm
from .kernels.contract import RowKind, row_kind
from .kernels.functions import row_norm
from .kernels.plain import _acc, _into, _rows


def _forward(x, alpha, weight, bias, eps):
    """Eq. 1 per entry: (y, no statistic)."""
    xa = x.to(_acc(x))
    y, out = _into(x)
    torch.addcmul(bias.to(xa), torch.tanh(alpha.to(xa) * xa), weight.to(xa), out=out)
    return y, xa.new_empty(0)


def _backward(x, ticket, grad_y, alpha, weight, bias, eps):
    """dL/dx = alpha d, d = dy w (1 - t^2), t = tanh(alpha x); dL/dalpha = sum d x, dL/dw = sum dy t, dL/db = sum dy."""
    _, rows = _rows(x)
    xa, gy = x.to(_acc(x)), grad_y.view(x.shape).to(_acc(x))
    t = torch.tanh(alpha.to(xa) * xa)
    g = gy * weight.to(xa) * (1 - t * t)  # dL/d(alpha x)
    gx, out = _into(x)
    torch.mul(g, alpha.to(xa), out=out)
    return [gx, (g.double() * xa.double()).sum().to(alpha.dtype), (gy.double() * t.double()).sum(rows).to(weight.dtype),
            gy.double().sum(rows).to(weight.dtype)]


def _twice(x, grad_y, alpha, weight, bias):
    """DyT's gradients in PyTorch ops, which autograd differentiates again: t = tanh(alpha x), y = w t + b."""
    grad_y = grad_y.view_as(x)  # y's rows in x's shape
    t = torch.tanh(alpha * x)
    d = grad_y * weight * (1 - t * t)
    rows = tuple(range(x.dim() - 1))
    return [d * alpha, (d * x).sum(), (grad_y * t).sum(rows), grad_y.sum(rows)]


#: the kind's description: the kernels' (csrc/cpu_rows.h, gpu_rows.py) by name, these passes the plain backend's
DYT = row_kind(RowKind("dyt", ("alpha", "weight", "bias"), False, _forward, _backward, _twice))


class DyT(EntryNorm):
    """DyT (Zhu et al., 2025, Eq. 1): gamma * tanh(alpha x) + beta per entry,
    one learned scalar alpha; no statistics."""

    flags = {"dyt_alpha_init": Flag(0.5, "DyT's alpha at initialisation (Zhu et al., 2025: 0.5)", "training",
                                    dict(type=positive, metavar="A"))}

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        # per entry, one fused pass each way (kernels/functions.py, FusedRowNorm): padding rows are computed and
        # never mixed into a real one; the output keeps x's dtype, as every norm's does
        params = self._parameters  # not nn.Module's __getattr__, a call each
        return row_norm(DYT, x, (params["alpha"], params["weight"], params["bias"]), None, self.w_offset)
