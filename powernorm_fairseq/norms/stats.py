"""The statistics every batch-statistic norm shares, and PN's nu update.

Each backend (the plain PyTorch path of each norm, the CPU C++ kernels, the
GPU kernels) computes the same quantities; what they are is defined here.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

GROUP_EPS = 1e-5  # the original code's group-scaling ("layer scale") epsilon


def upcast(x: Tensor) -> Tensor:
    """``x`` in at least float32: statistics of half precision overflow."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype statistics of ``x`` are kept in: float32 for half inputs."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def real_tokens(x: Tensor, pad_mask: Optional[Tensor]) -> Tuple[Optional[Tensor], int]:
    """Weights (T, B, 1), in the statistics dtype, that are 1 at real tokens, and their count.

    The weights are None when nothing is padded, so callers take plain sums.
    """
    if pad_mask is None or not pad_mask.any():
        return None, x.size(0) * x.size(1)
    keep = (~pad_mask).t().unsqueeze(-1).to(stat_dtype(x))
    return keep, int(keep.sum().item())


def token_mean(v: Tensor, keep: Optional[Tensor], n: int) -> Tensor:
    """Mean over the real tokens of ``v`` (T, B, C): one value per channel."""
    if keep is not None:
        v = v * keep
    return v.sum(dim=(0, 1)) / n


def group_scale(x: Tensor, groups: int, eps: float = GROUP_EPS) -> Tensor:
    """The original code's "layer scaling": per token, divide each of ``groups``
    channel groups by its root mean square (one group in its BN, one per
    attention head in its PN). ``x``: (T, B, C)."""
    T, B, C = x.shape
    xg = x.reshape(T, B, groups, C // groups)
    xg = xg * torch.rsqrt(xg.pow(2).mean(dim=-1, keepdim=True) + eps)
    return xg.reshape(T, B, C)


@torch.no_grad()
def assign_if_finite(buf: Tensor, new: Tensor, *checks: Optional[Tensor]):
    """``buf <- new`` if every statistic in ``checks`` (None allowed) is finite,
    else ``buf`` unchanged: overflowed half-precision activations or a float16
    loss-scale overflow must not enter a running statistic. Decided on the
    device, so a GPU run does not wait for it."""
    ok = torch.stack([torch.isfinite(t).all() for t in checks if t is not None]).all()
    buf.copy_(torch.where(ok, new.to(buf), buf))


def update_nu(nu: Tensor, rate: float, gamma_t: Tensor, lambda_t: Tensor):
    """Algorithm 2: nu_t = nu_{t-1} (1 - (1 - alpha_bwd) Gamma_t) + (1 - alpha_bwd) Lambda_t,

    with, in the paper's names, Gamma_t = mean(xh^2) and Lambda_t =
    mean(dL/dxh * xh) over the real tokens. Skipped when the gradient is not
    finite: a float16 loss-scale overflow, whose step the optimizer skips too,
    must not leave inf/NaN in nu.
    """
    assign_if_finite(nu, nu * (1.0 - rate * gamma_t).to(nu) + (rate * lambda_t).to(nu), gamma_t, lambda_t)
