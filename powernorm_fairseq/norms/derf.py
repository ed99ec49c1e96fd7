"""Derf, the dynamic erf ("Stronger Normalization-Free Transformers",
https://arxiv.org/abs/2512.10938): y = γ · erf(α x + s) + β.

The dynamic tanh's neighbour, with erf for tanh and a learned shift: no statistics, a
learned scalar α and a learned scalar shift s inside the erf, then a gain γ
and bias β per channel. α starts at ``alpha_init`` (0.5, as x-transformers'
``Derf``), s at 0.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from ..common.flags import positive
from .base import Flag
from .entry import EntryNorm
from .kernels.contract import RowKind, row_kind
from .kernels.functions import row_norm
from .kernels.plain import _acc, _into, _rows

#: d erf(u) / du = TWO_OVER_SQRT_PI exp(-u^2)
TWO_OVER_SQRT_PI = 2 / math.sqrt(math.pi)


def _forward(x, alpha, shift, weight, bias, eps):
    """y = w erf(alpha x + s) + b per entry: (y, no statistic)."""
    xa = x.to(_acc(x))
    y, out = _into(x)
    torch.addcmul(bias.to(xa), torch.erf(alpha.to(xa) * xa + shift.to(xa)), weight.to(xa), out=out)
    return y, xa.new_empty(0)


def _backward(x, ticket, grad_y, alpha, shift, weight, bias, eps):
    """With u = alpha x + s and d = dy w erf'(u): dL/dx = alpha d, dL/dalpha = sum d x, dL/ds = sum d,
    dL/dw = sum over rows of dy erf(u), dL/db = sum over rows of dy."""
    _, rows = _rows(x)
    xa, gy = x.to(_acc(x)), grad_y.view(x.shape).to(_acc(x))
    u = alpha.to(xa) * xa + shift.to(xa)
    d = gy * weight.to(xa) * (TWO_OVER_SQRT_PI * torch.exp(-u * u))
    gx, out = _into(x)
    torch.mul(d, alpha.to(xa), out=out)
    dd = d.double()
    return [gx, (dd * xa.double()).sum().to(alpha.dtype), dd.sum().to(shift.dtype),
            (gy.double() * torch.erf(u).double()).sum(rows).to(weight.dtype), gy.double().sum(rows).to(weight.dtype)]


def _twice(x, grad_y, alpha, shift, weight, bias):
    """Derf's gradients in PyTorch ops, which autograd differentiates again."""
    grad_y = grad_y.view_as(x)
    u = alpha * x + shift
    d = grad_y * weight * (TWO_OVER_SQRT_PI * torch.exp(-u * u))
    rows = tuple(range(x.dim() - 1))
    return [d * alpha, (d * x).sum(), d.sum(), (grad_y * torch.erf(u)).sum(rows), grad_y.sum(rows)]


#: the kind's description: the kernels' (csrc/cpu_rows.h, gpu_rows.py) by name, these passes the plain backend's
DERF = row_kind(RowKind("derf", ("alpha", "shift", "weight", "bias"), False, _forward, _backward, _twice))


class Derf(EntryNorm):
    """Derf (arXiv 2512.10938): gamma * erf(alpha x + s) + beta per entry, learned scalars alpha and s."""

    SCALARS = ("shift",)
    flags = {"derf_alpha_init": Flag(0.5, "Derf's alpha at initialisation (x-transformers: 0.5)", "training",
                                     dict(type=positive, metavar="A"))}

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        params = self._parameters
        return row_norm(DERF, x, (params["alpha"], params["shift"], params["weight"], params["bias"]), None,
                        self.w_offset)
