"""What the per-entry kinds share (their descriptors: contract.RowKind): y = γ · f(α x, ...) + β
with learned scalars inside f, a gain γ and a bias β per channel, and no statistics.
Each kind gives its row kind's passes and its ``normalize``; α starts at
``alpha_init``, every other scalar (``SCALARS``) at 0."""

import torch
from torch import nn

from .base import Norm


class EntryNorm(Norm):
    """A per-entry kind: learned scalars alpha and ``SCALARS``, then a gain and bias per channel."""

    SCALARS = ()  # the scalars after alpha, in the row kind's parameter order, each starting at 0

    def __init__(self, dim: int, alpha_init: float = 0.5, unit_offset: bool = False, device=None, dtype=None):
        super().__init__()
        if not alpha_init > 0:
            raise ValueError(f"alpha_init must be positive, got {alpha_init}")
        self.dim, self.alpha_init = dim, alpha_init
        self.alpha = nn.Parameter(torch.full((), alpha_init, device=device, dtype=dtype))
        for name in self.SCALARS:
            setattr(self, name, nn.Parameter(torch.zeros((), device=device, dtype=dtype)))
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        self.offset_gain(unit_offset)

    @classmethod
    def options(cls, cfg, heads: int, final: bool = False) -> dict:
        (name, flag), = cls.flags.items()  # the kind's own --<kind>-alpha-init
        return dict(alpha_init=getattr(cfg, name, flag.default))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                p.fill_(self.alpha_init if name == "alpha" else self.initial_gain() - self.w_offset if name == "weight"
                        else 0.0)

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha_init={self.alpha_init}" + self.offset_repr()
