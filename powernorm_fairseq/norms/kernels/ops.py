"""Every backend entry point (``contract.py``) as a PyTorch op, ``torch.ops.powernorm.<name>``.

torch.compile cannot trace into a C++ extension or a Triton launch, and would
break its graph at each; as ops with fake-tensor implementations (the shapes
and dtypes of their outputs) they go into the graph whole. The first argument
names the backend (``cpu`` or ``triton``); absent tensors are empty ones. The
autograd of the norms is ``functions.py``'s, which calls these ops.
"""

from typing import Tuple

import torch
from torch import Tensor

from ..clock import CLOCKS

IMPLEMENTATIONS = {}  # name -> the op's Python implementation (measure/launches.py sees through the op)


def backend(name: str):
    from . import _MODULES

    return _MODULES[name]


#: ops defined through a Library: a call costs what a built-in op's does (torch.library.custom_op's
#: Python wrapper added some 75 us to each, more than a CPU kernel of a small layer takes)
_LIBRARY = torch.library.Library("powernorm", "DEF")


def _op(mutates=()):
    def register(fn):
        name = fn.__name__
        IMPLEMENTATIONS[name] = fn
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates))
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"powernorm::{name}", _FAKES[name], lib=_LIBRARY)
        return getattr(torch.ops.powernorm, name)
    return register


def _stat(like: Tensor) -> torch.dtype:
    return torch.float64 if like.dtype == torch.float64 else torch.float32


def _fake_forward(impl, x, mask, groups, gs_eps, mean, inv, inv_eps, weight, bias, want_y, want_stats, center):
    P, dtype = backend(impl).parts(x, groups, "_channel_forward", not want_y)
    return (torch.empty_like(x) if want_y else x.new_empty(0),
            x.new_empty(x.size(0), groups, dtype=_stat(x)) if groups > 0 else x.new_empty(0),
            x.new_empty(P, 3, x.size(1), dtype=dtype) if want_stats else x.new_empty(0))


def _fake_finish_stats(impl, part, mean_buf, second_buf, steps, update, momentum, eps, warmup, clock):
    C, sd = part.size(-1), second_buf.dtype
    return (part.new_empty(C if update == "bn" else 0, dtype=sd), part.new_empty(C, dtype=sd),
            part.new_empty(C, dtype=sd), part.new_empty(1, dtype=torch.float64))


def _fake_backward(impl, x, mask, scale, grad_y, weight, mean, inv_fwd, inv_bwd, A, B, b_scale, groups,
                   correct_pads, want_gx, want_sums):
    P, dtype = backend(impl).parts(x, groups, "_channel_backward", not want_gx)
    return (torch.empty_like(x) if want_gx else x.new_empty(0),
            x.new_empty(P, 5, x.size(1), dtype=dtype) if want_sums else x.new_empty(0))


def _fake_finish_backward(impl, part, weight, n, nu, rate, kind, center, rows):
    C = part.size(-1)
    sd = nu.dtype if nu.numel() else _stat(weight)
    exact = kind == "exact"
    return (torch.empty_like(weight), torch.empty_like(weight),
            part.new_empty(C if exact and center else 0, dtype=sd), part.new_empty(C if exact else 0, dtype=sd))


def _fake_rows(impl, x, *args):
    return torch.empty_like(x), x.new_empty(x.size(0) + backend(impl).ROW_TICKET, dtype=_stat(x))


def _fake_scalenorm_backward(impl, x, norms, grad_y, scale, eps):
    return torch.empty_like(x), torch.empty_like(scale)


def _fake_rmsnorm_backward(impl, x, rstd, grad_y, weight):
    return torch.empty_like(x), torch.empty_like(weight)


_FAKES = dict(forward=_fake_forward, finish_stats=_fake_finish_stats, backward=_fake_backward,
              finish_backward=_fake_finish_backward, scalenorm_forward=_fake_rows,
              scalenorm_backward=_fake_scalenorm_backward, rmsnorm_forward=_fake_rows,
              rmsnorm_backward=_fake_rmsnorm_backward)


@_op()
def forward(impl: str, x: Tensor, mask: Tensor, groups: int, gs_eps: float, mean: Tensor, inv: Tensor,
            inv_eps: float, weight: Tensor, bias: Tensor, want_y: bool, want_stats: bool,
            center: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return tuple(backend(impl).forward(x=x, mask=mask, groups=groups, gs_eps=gs_eps, mean=mean, inv=inv,
                                       inv_eps=inv_eps, weight=weight, bias=bias, want_y=want_y,
                                       want_stats=want_stats, center=center))


@_op(mutates=("mean_buf", "second_buf", "steps"))
def finish_stats(impl: str, part: Tensor, mean_buf: Tensor, second_buf: Tensor, steps: Tensor, update: str,
                 momentum: float, eps: float, warmup: int, clock: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``clock``: the key of PN's warmup clock (``norms/clock.py``) to advance, or -1."""
    out = tuple(backend(impl).finish_stats(part=part, mean_buf=mean_buf, second_buf=second_buf, steps=steps,
                                           update=update, momentum=momentum, eps=eps, warmup=warmup))
    if clock >= 0:
        CLOCKS[clock].advance(steps)
    return out


@_op()
def backward(impl: str, x: Tensor, mask: Tensor, scale: Tensor, grad_y: Tensor, weight: Tensor, mean: Tensor,
             inv_fwd: Tensor, inv_bwd: Tensor, A: Tensor, B: Tensor, b_scale: float, groups: int,
             correct_pads: bool, want_gx: bool, want_sums: bool) -> Tuple[Tensor, Tensor]:
    return tuple(backend(impl).backward(x=x, mask=mask, scale=scale, grad_y=grad_y, weight=weight, mean=mean,
                                        inv_fwd=inv_fwd, inv_bwd=inv_bwd, A=A, B=B, b_scale=b_scale, groups=groups,
                                        correct_pads=correct_pads, want_gx=want_gx, want_sums=want_sums))


@_op(mutates=("nu",))
def finish_backward(impl: str, part: Tensor, weight: Tensor, n: Tensor, nu: Tensor, rate: float, kind: str,
                    center: bool, rows: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(backend(impl).finish_backward(part=part, weight=weight, n=n, nu=nu, rate=rate, kind=kind,
                                               center=center, rows=rows))


@_op()
def scalenorm_forward(impl: str, x: Tensor, scale: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    return tuple(backend(impl).scalenorm_forward(x=x, scale=scale, eps=eps))


@_op()
def scalenorm_backward(impl: str, x: Tensor, norms: Tensor, grad_y: Tensor, scale: Tensor,
                       eps: float) -> Tuple[Tensor, Tensor]:
    return tuple(backend(impl).scalenorm_backward(x=x, norms=norms, grad_y=grad_y, scale=scale, eps=eps))


@_op()
def rmsnorm_forward(impl: str, x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    return tuple(backend(impl).rmsnorm_forward(x=x, weight=weight, eps=eps))


@_op()
def rmsnorm_backward(impl: str, x: Tensor, rstd: Tensor, grad_y: Tensor, weight: Tensor) -> Tuple[Tensor, Tensor]:
    return tuple(backend(impl).rmsnorm_backward(x=x, rstd=rstd, grad_y=grad_y, weight=weight))
