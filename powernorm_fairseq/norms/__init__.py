"""The norm library: every norm takes (T, B, C) with fairseq's padding mask,
(B, T, C) with batch_first=True and attention_mask=, or (N, C) tokens (base.py).

``build_norm(kind, dim, **options)`` is the one way to make a norm; its
registry ``NORMS`` also gives the command-line choices (``NORM_TYPES``).
"""

import inspect

from torch import nn

from .base import NoNorm, Norm, padding_mask
from .batchnorm import MaskedBatchNorm, OriginalBatchNorm
from .derf import Derf
from .dyt import DyT
from .layernorm import AdaNorm, DetachNorm, GroupNorm, LayerNorm, LayerNormSimple
from .powernorm import PowerNorm, PowerNormV
from .rbn import RegularizedBatchNorm
from .rmsnorm import RMSNorm
from .scalenorm import ScaleNorm

NORMS = {
    "ln": LayerNorm,
    "bn": MaskedBatchNorm,
    "pn": PowerNorm,
    "pn-v": PowerNormV,
    "bn-original": OriginalBatchNorm,
    "rbn": RegularizedBatchNorm,
    "scalenorm": ScaleNorm,
    "rmsnorm": RMSNorm,
    "layernorm-simple": LayerNormSimple,
    "detachnorm": DetachNorm,
    "adanorm": AdaNorm,
    "groupnorm": GroupNorm,
    "dyt": DyT,
    "derf": Derf,
    "none": NoNorm,
}
NORM_TYPES = tuple(NORMS)
#: the kinds that keep running statistics of the batch
RUNNING_STAT_TYPES = tuple(kind for kind, cls in NORMS.items() if cls.running_stats)
#: the kinds with an affine gain, which ``unit_offset`` stores as its offset from the initial one (base.Norm)
GAIN_TYPES = tuple(kind for kind, cls in NORMS.items() if "unit_offset" in inspect.signature(cls).parameters)


#: what every norm takes as torch's own layers do (``device=``, ``dtype=``), beside its options
TORCH_OPTIONS = ("device", "dtype")


def build_norm(kind: str, dim: int, **options) -> nn.Module:
    """A norm of type ``kind`` (one of ``NORM_TYPES``) over ``dim`` channels;
    ``device=`` and ``dtype=`` place its parameters, as for ``nn.LayerNorm``."""
    if kind not in NORMS:
        raise ValueError(f"unknown norm type {kind!r}; choose one of {', '.join(NORM_TYPES)}")
    takes = [name for name in inspect.signature(NORMS[kind]).parameters if name not in ("dim", *TORCH_OPTIONS)]
    unknown = sorted(set(options) - set(takes) - set(TORCH_OPTIONS))
    if unknown:
        raise ValueError(f"{kind} takes no option {', '.join(unknown)}; its options: {', '.join(takes) or 'none'}")
    return NORMS[kind](dim, **options)


def norm_type_of(module: nn.Module) -> str:
    """The registry name of a norm module (inverse of :func:`build_norm`)."""
    for kind, cls in NORMS.items():
        if type(module) is cls:
            return kind
    raise TypeError(f"{type(module).__name__} is not a registered norm")


__all__ = ["GAIN_TYPES", "NORMS", "NORM_TYPES", "RUNNING_STAT_TYPES", "Norm", "build_norm", "norm_type_of",
           "padding_mask"]
