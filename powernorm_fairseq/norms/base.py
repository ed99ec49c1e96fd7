"""What every norm shares: the forward signature and the padding mask.

Every norm takes ``x`` of shape ``(seq_len, batch, channels)`` and fairseq's
padding mask of shape ``(batch, seq_len)``, True at padding. fairseq's layers
call their norms with ``x`` alone, so the encoder and decoder of this plugin
hand the mask over with :func:`padding_mask` for the duration of a forward.
"""

from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor, nn


class Norm(nn.Module):
    """Base class: ``forward(x, pad_mask=None)`` over ``(T, B, C)``.

    What the rest of the plugin needs to know of a norm, each class declares:
    :meth:`options` (its constructor options from the model's flags),
    ``running_stats`` (whether it keeps running statistics of the batch) and,
    for those, :meth:`diagnostics_view` (what ``--norm-diagnostics`` measures).
    """

    #: set by :func:`padding_mask` for calls that cannot pass the mask
    pad_mask: Optional[Tensor] = None
    #: keeps running statistics of its training batches (eval uses them)
    running_stats = False

    @classmethod
    def options(cls, cfg, heads: int, final: bool = False) -> dict:
        """Constructor options from the model's flags ``cfg``; ``heads``: the
        attention heads of its side; ``final``: the norm after the last layer."""
        return {}

    def diagnostics_view(self, x: Tensor, pad_mask: Optional[Tensor]):
        """For a norm with running statistics: ``(stats, (xs, mean, inv))``,
        the batch and running statistics by name and what gives x-hat, as the
        coming training forward will compute them (see ``diagnostics``)."""
        raise NotImplementedError

    def forward(self, x: Tensor, pad_mask: Optional[Tensor] = None) -> Tensor:
        if pad_mask is None:
            pad_mask = self.pad_mask
        if pad_mask is not None and pad_mask.shape != (x.size(1), x.size(0)):
            raise ValueError(
                f"pad_mask has shape {tuple(pad_mask.shape)}, expected "
                f"(batch, seq_len) = ({x.size(1)}, {x.size(0)})"
            )
        return self.normalize(x, pad_mask)

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        # Running statistics stay float32 when the model is cast to float16
        # or bfloat16 (fairseq's --fp16 / --bf16 call .half() / .to(bfloat16)):
        # half precision would round away the small updates of a running
        # average and overflow psi^2. Casts to float64 and moves between
        # devices apply as usual.
        kept = {name: buf.dtype for name, buf in self._buffers.items()
                if buf is not None and buf.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, dtype in kept.items():
            buf = self._buffers[name]
            if buf.dtype in (torch.float16, torch.bfloat16):
                self._buffers[name] = buf.to(dtype)
        return self


def momentum_option(cfg) -> dict:
    """``--norm-momentum`` if given: without it each class keeps its own default."""
    return {} if cfg.norm_momentum is None else dict(momentum=cfg.norm_momentum)


def layer_scale_option(cfg, default: bool) -> bool:
    """``--layer-scale``/``--no-layer-scale`` if given, else the kind's ``default``."""
    return default if getattr(cfg, "layer_scale", None) is None else cfg.layer_scale


class NoNorm(Norm):
    """``none``: the identity, for "w/o Norm" ablations."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{self.dim}"


@contextmanager
def padding_mask(module: nn.Module, pad_mask: Optional[Tensor]):
    """Give every :class:`Norm` inside ``module`` the padding mask (B, T)."""
    norms = [m for m in module.modules() if isinstance(m, Norm)]
    for norm in norms:
        norm.pad_mask = pad_mask
    try:
        yield
    finally:
        for norm in norms:
            norm.pad_mask = None

