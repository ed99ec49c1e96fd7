"""Statistics shared across data-parallel workers (``--norm-sync``).

* ``batch``: the batch is the union of every worker's batch. The sufficient
  statistics (real-token count, sums of x, of squared deviations, of x^2, and
  PN's backward sums Gamma and Lambda) are all-reduced, so each worker
  normalises with the global statistics, and the all-reduce is differentiable
  (its backward all-reduces the gradient), which gives every worker its part
  of the exact gradient of the global computation (BN Eq. 3, PN-V Eq. 6).
* ``running``: each worker normalises with its own batch (and back-propagates
  through it alone); the running statistics (and PN's nu) are updated with the
  global statistics, so they stay identical on every worker.
* ``none``: everything per worker, as the authors' released code did.

Collectives run only in training mode, on every worker in the same order
(workers without real tokens join with zero sums), and only when
torch.distributed is initialised with more than one process.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

MODES = ("none", "batch", "running")


_DISTRIBUTED = dist.is_available()  # whether this torch was built with it: fixed for the process
#: torch.distributed's registry of process groups, where this torch has one: with no default group, a
#: process runs alone, which is known without dist.is_initialized()'s three calls (measure/host.py)
_WORLD = getattr(dist.distributed_c10d, "_world", None) if _DISTRIBUTED else None
_WORLD = _WORLD if hasattr(_WORLD, "_default_pg") else None


def active(mode: str) -> bool:
    """Whether ``mode`` needs collectives in this process."""
    if mode not in MODES:
        raise ValueError(f"sync must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none" or not _DISTRIBUTED or (_WORLD is not None and _WORLD._default_pg is None):
        return False
    return dist.is_initialized() and dist.get_world_size() > 1


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        out = t.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        # the global loss is the sum of the workers' losses: each worker's
        # share of dL/dS is the sum of every worker's dL_w/dS
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


def all_sum(t: Tensor, differentiable: bool = False) -> Tensor:
    """The sum of ``t`` over the workers (a new tensor)."""
    if differentiable and t.requires_grad:
        return _AllReduceSum.apply(t)
    out = t.detach().clone()
    dist.all_reduce(out)
    return out


def sum_and_count(t: Tensor, n: int):
    """(N, sum of ``t``) over the workers, with N the sum of their counts ``n``:
    one all-reduce."""
    packed = all_sum(torch.cat([t, t.new_tensor([float(n)])]))
    return int(packed[-1].item()), packed[:-1]


def combine(n: int, mean: Tensor, m2: Tensor):
    """(N, mean, sum of squared deviations) of the union of the workers'
    batches from each worker's count ``n``, ``mean`` and sum of squared
    deviations from it ``m2`` (float64): the pairwise formula of Chan, Golub &
    LeVeque (1983), which stays accurate where E[x^2] - mean^2 would cancel.
    ``(0, None, None)`` when no worker has a real token."""
    N, total = sum_and_count(mean * n, n)
    if N == 0:
        return 0, None, None
    g_mean = total / N
    return N, g_mean, all_sum(m2 + n * (mean - g_mean) ** 2)


def moments(x: Tensor, keep: Optional[Tensor], center: bool):
    """Global (count, mean or None, second moment) of the real rows of ``x`` (T, B, C), float64, no grad.

    The second moment is the variance when ``center``, else mean(x^2).
    """
    with torch.no_grad():
        xd = x.double()
        kd = keep.double() if keep is not None else None
        masked = (lambda v: v) if kd is None else (lambda v: v * kd)
        n = int(kd.sum().item()) if kd is not None else x.size(0) * x.size(1)
        if not center:
            N, total = sum_and_count(masked(xd * xd).sum(dim=(0, 1)), n)
            return (N, None, total / N) if N else (0, None, None)
        mean = masked(xd).sum(dim=(0, 1)) / max(n, 1)  # this worker's, then its squared deviations
        N, g_mean, m2 = combine(n, mean, masked((xd - mean) ** 2).sum(dim=(0, 1)))
        return (N, g_mean, (m2 / N).clamp(min=0)) if N else (0, None, None)
