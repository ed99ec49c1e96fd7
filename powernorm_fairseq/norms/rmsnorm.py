"""RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization",
https://arxiv.org/abs/1910.07467, Eq. 4): x / sqrt(mean(x^2) + eps) * g per
token, g one gain per channel initialised to 1. The per-token cousin of PN-V,
which takes the same quadratic mean over the batch instead of the channels.

On a GPU it runs torch's fused RMSNorm (``aten._fused_rms_norm``) where the
installed torch has one and it matches Eq. 4 (:func:`torch_fused`, checked
once per device and dtypes); otherwise, and on the CPU, the plugin's kernels."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Norm
from .kernels.contract import RowKind, row_kind
from .kernels.functions import row_norm
from .kernels.plain import _acc, _into, _rows


def _forward(x, weight, eps):
    """Eq. 4 per row: (y, 1 / rms)."""
    N, _ = _rows(x)
    xa = x.to(_acc(x))
    rstd = torch.rsqrt(xa.pow(2).mean(-1) + eps)
    y, out = _into(x)
    torch.mul(xa * rstd.unsqueeze(-1), weight.to(xa), out=out)
    return y, rstd.reshape(N)


def _backward(x, rstd, grad_y, weight, eps):
    """dL/dx = r (g - x r^2 mean(g x)), g = dy * w; dL/dw = sum dy x r."""
    _, rows = _rows(x)
    xa, gy, rstd = x.to(_acc(x)), grad_y.view(x.shape).to(_acc(x)), rstd.view(x.shape[:-1])
    xr = xa * rstd.unsqueeze(-1)
    g = gy * weight.to(xa)
    gx, out = _into(x)
    torch.mul(rstd.unsqueeze(-1), g - xr * (g * xr).mean(-1, keepdim=True), out=out)
    return [gx, (gy.double() * xr.double()).sum(rows).to(weight.dtype)]


#: the kind's description: the kernels' (csrc/cpu_rows.h, gpu_rows.py) by name, these passes the plain backend's
RMSNORM = row_kind(RowKind("rmsnorm", ("weight",), True, _forward, _backward))


class RMSNorm(Norm):
    """RMSNorm (Zhang & Sennrich, 2019, Eq. 4): x / sqrt(mean(x^2) + eps) * g per token, g per channel."""

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.offset_gain(unit_offset)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        weight = self._parameters["weight"]  # not nn.Module's __getattr__, a call
        if x.is_cuda and not self.w_offset and torch_fused(x, weight):  # torch's takes no offset: the plugin's do
            return F.rms_norm(x, (self.dim,), weight, self.eps)
        return row_norm(RMSNORM, x, (weight,), self.eps, self.w_offset)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + self.offset_repr()


#: (device, x's dtype, the weight's dtype) -> whether torch's fused RMSNorm serves there
_TORCH_FUSED = {}


def torch_fused(x: Tensor, weight: Tensor) -> bool:
    """Whether torch's fused RMSNorm serves x and weight's device and dtypes:
    the installed torch has one, it takes them (one dtype: torch fuses no
    mixed one), and on a probe its output (in x's dtype) and gradients match
    Eq. 4 computed in float64 within a few roundings of x's dtype."""
    key = (x.device, x.dtype, weight.dtype)
    if key not in _TORCH_FUSED:
        _TORCH_FUSED[key] = (hasattr(torch.ops.aten, "_fused_rms_norm") and x.dtype == weight.dtype
                             and _matches(x.device, x.dtype, weight.dtype))
    return _TORCH_FUSED[key]


def _matches(device, dtype, weight_dtype, T=5, B=3, C=48, eps=1e-5) -> bool:
    g = torch.Generator().manual_seed(0)
    x64, dy64 = torch.randn(T, B, C, generator=g, dtype=torch.float64), torch.randn(T, B, C, generator=g,
                                                                                   dtype=torch.float64)
    w64 = 1 + 0.1 * torch.randn(C, generator=g, dtype=torch.float64)
    x, w = x64.to(device, dtype).requires_grad_(True), w64.to(device, weight_dtype).requires_grad_(True)
    with torch.enable_grad():
        y = F.rms_norm(x, (C,), w, eps)
        if y.dtype != dtype:
            return False
        gx, gw = torch.autograd.grad(y, (x, w), dy64.to(device, dtype))
        xr, wr = x.detach().double().cpu().requires_grad_(True), w.detach().double().cpu().requires_grad_(True)
        yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * wr  # Eq. 4
        gxr, gwr = torch.autograd.grad(yr, (xr, wr), dy64.to(dtype).double())
    tolerance = 8 * torch.finfo(dtype).eps
    return all(torch.allclose(a.detach().double().cpu(), b, rtol=tolerance, atol=tolerance * b.abs().max().item())
               for a, b in ((y, yr), (gx, gxr), (gw, gwr)))
