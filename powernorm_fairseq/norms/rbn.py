"""Regularized BN (Wang, Wu and Huang, "Understanding the Failure of Batch
Normalization for Transformers in NLP", NeurIPS 2022,
https://arxiv.org/abs/2210.05153; their code: github.com/wjxts/RegularizedBN,
``MaskBatchNorm3d.loss_diff``).

bn's forward and backward over the batch's real tokens, on every backend (this
project's bn: sqrt(var + eps), an unbiased running variance; the authors' BN
divides by sqrt(max(var, eps)) and averages the biased one), and in training a
penalty on the gap between the batch's statistics and the
running ones (the training-inference discrepancy):

    P = lambda_mu * sum_c (mu_c - mu_B,c)^2 + lambda_var * sum_c |var_c - var_B,c|

with mu, var the running statistics once this batch has updated them (as the
authors' code orders it) and mu_B, var_B the batch's, var_B the unbiased
estimate the running variance averages. P's gradient reaches x through mu_B
and var_B; the running statistics are constants of it. With ``--norm-sync
batch`` the batch is every worker's, and its all-reduce is differentiable.

P enters the training loss as the authors' criterion adds it: to the summed
loss of each forward, before fairseq divides by the tokens. Here it is added
once per update on average (each forward's P weighted by 1 / (forwards per
update x workers)), so that the regulariser weighs the same at any world size
and update frequency; with one worker and ``--update-freq 1`` that is the
authors' weight. :func:`regularization` collects it: fairseq's trainer adds it
(``patches/regularizers.py``); a training loop of one's own adds
``regularization(model)`` to its loss.

Defaults: lambda_mu 0.1, lambda_var 0.01 and momentum 0.05, the authors'
pre-norm IWSLT14 setting (``batch_diff_0.1_0.01``); their post-norm one is
``--rbn-penalty-mean 60 --rbn-penalty-var 0``. The weights are relative to a
loss summed over a batch of 4,096 tokens: a criterion that sums over
sentences (a classifier's) weighs the same penalty about 100 times more
(docs/study.md measures what that does).
"""

from typing import Optional

import torch
from torch import Tensor, nn

from ..common.flags import non_negative
from . import sync as sync_mod
from .base import Flag, recomputing
from .batchnorm import MaskedBatchNorm
from .stats import upcast


def _sum(t: Tensor, synced: bool) -> Tensor:
    return sync_mod.all_sum(t, differentiable=True) if synced else t


class RegularizedBatchNorm(MaskedBatchNorm):
    """Regularized BN (Wang, Wu and Huang, 2022): bn, and a loss penalty on its batch vs running statistics."""

    flags = {
        "rbn_penalty_mean": Flag(0.1, "RBN's weight of sum (mu - mu_B)^2 (the authors' pre-norm 0.1; post-norm 60)",
                                 "training", dict(type=non_negative, metavar="W")),
        "rbn_penalty_var": Flag(0.01, "RBN's weight of sum |var - var_B| (the authors' pre-norm 0.01; post-norm 0)",
                                "training", dict(type=non_negative, metavar="W")),
    }

    def __init__(self, dim: int, momentum: float = 0.05, eps: float = 1e-5, sync: str = "batch",
                 layer_scale: bool = False, groups: int = 1, causal: bool = False, penalty_mean: float = 0.1,
                 penalty_var: float = 0.01, unit_offset: bool = False, device=None, dtype=None):
        super().__init__(dim, momentum, eps, sync, layer_scale, groups, causal, unit_offset, device, dtype)
        if penalty_mean < 0 or penalty_var < 0:
            raise ValueError(f"penalty_mean and penalty_var must be >= 0, got {penalty_mean} and {penalty_var}")
        self.penalty_mean, self.penalty_var = penalty_mean, penalty_var
        self.last_penalty = None  # P of the last training forward, until regularization() takes it

    @classmethod
    def options(cls, cfg, heads, final=False):
        weights = {name[4:]: getattr(cfg, name, flag.default) for name, flag in cls.flags.items()}  # rbn_...
        return dict(super().options(cfg, heads, final), **weights)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        y = super().normalize(x, pad_mask)
        if self.training and (self.penalty_mean or self.penalty_var):
            penalty = self.penalty(x, pad_mask)
            if not recomputing():  # a recomputation's P (the same) is not a second one
                self.last_penalty = penalty
        return y

    def penalty(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        """P of the batch ``x`` against the running statistics as they stand (the module doc)."""
        xs = self.scaled(upcast(x))
        keep = None if pad_mask is None else (~pad_mask).t().unsqueeze(-1).to(xs.dtype)
        synced = sync_mod.active(self.sync) and self.sync == "batch"
        n = keep.sum() if keep is not None else xs.new_tensor(float(xs.size(0) * xs.size(1)))
        n = sync_mod.all_sum(n) if synced else n  # a count: no gradient
        masked = (lambda v: v) if keep is None else (lambda v: v * keep)
        mean = _sum(masked(xs).sum(dim=(0, 1)), synced) / n.clamp(min=1)
        m2 = _sum(masked((xs - mean) ** 2).sum(dim=(0, 1)), synced)
        var = m2 / (n - 1).clamp(min=1)  # unbiased, as the running variance is updated
        rm, rv = self.running_mean.to(xs), self.running_var.to(xs)
        p = self.penalty_mean * (rm - mean).pow(2).sum() + self.penalty_var * (rv - var).abs().sum()
        return torch.where(n > 1, p, torch.zeros_like(p))  # no real token (or one): no statistic, no update

    def __getstate__(self):
        """A copy (``copy.deepcopy``, an EMA's, pickle) leaves the last forward's penalty behind: a
        tensor of that forward's graph, which cannot be copied and is not part of the model."""
        return {**super().__getstate__(), "last_penalty": None}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, penalty_mean={self.penalty_mean}, penalty_var={self.penalty_var}"


def regularization(model: nn.Module) -> Optional[Tensor]:
    """The sum of the RBN penalties of ``model``'s last training forward (each RBN module's, which
    this call takes), or None where it has none. Add it to the loss that is back-propagated."""
    taken = []
    for module in model.modules():
        if isinstance(module, RegularizedBatchNorm) and module.last_penalty is not None:
            taken.append(module.last_penalty)
            module.last_penalty = None
    if not taken:
        return None
    if torch.is_grad_enabled() and not all(p.requires_grad for p in taken):
        raise RuntimeError("rbn: a penalty was computed without autograd (reentrant activation checkpointing "
                           "runs the first forward without it): checkpoint with use_reentrant=False, or train "
                           "rbn without activation checkpointing")
    return torch.stack(taken).sum()
