"""The GPU backend: Triton kernels of the channel-statistics norms (BN, PN-V,
PN) and the per-row and per-entry kinds, with the interface of the CPU backend
(``cpu.py``). Each idea in one home: the kernels (``gpu_channel.py``,
``gpu_rows.py``), their plans and the plans' constants (``plans.py``), the
passes that allocate and launch (``csrc/gpu_passes.h``, in the compiled
module) and the launches (``launcher.py``, ``csrc/launch.h``).

The entry points here are the contract's (``contract.py``), for the ops
(``ops.py``: torch.compile, --norm-sync, a step something observes); an eager
step calls the same C++ passes from its autograd node (``csrc/steps.h``).
Each launch is Triton's JIT launch the first time, and the node's own held
launch after it, or Triton's JIT every time where the launches are watched
(Triton's interpreter, ``TRITON_INTERPRET=1``, which is how CI checks the
kernels' numbers without a GPU; a launch observer; ``POWERNORM_HOLD=0``).
"""

import sys

import torch

from . import compiled, contract, launcher, plans
from .contract import Mode, Update
from .launcher import OBSERVERS, observed  # noqa: F401 (the measuring tools' hooks)
from .plans import (MAX_ROWS, PROGRAMS_PER_SM, REGISTERS_PER_SM, ROW_TICKET, SUB_CHUNK, TICKET_ROWS,  # noqa: F401
                    TILE, ROW_TILE, WARP, WARPS, WIDEST_GROUP, WIDEST_ROW, _acc, interpreting, parts,
                    programs_per_sm, registers, stand_in, stand_in_size)
from . import gpu_channel, gpu_rows
from .gpu_channel import triton

NAME = "triton"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: the kernels the passes launch, by name (csrc/gpu_passes.h's kKernelNames)
KERNELS = {k.__name__: k for k in gpu_channel.KERNELS + gpu_rows.KERNELS} if triton is not None else {}
failure = None if triton is not None else "triton is not installed"
_NODE = None  # the compiled module whose passes are bound (bind_node)
_BOUND_AS = None  # the value eager steps name them by


def available() -> bool:
    global failure
    if triton is None:
        return False
    if _NODE is None and _node() is None:
        failure = f"the compiled module is unavailable ({compiled.failure or 'not built'})"
        return False
    return True


# a constant to torch.compile: traced, the load runs at once (it reads files), as cpu.available
available._dynamo_marked_constant = True


def failure_reason():
    return failure


def takes(x: torch.Tensor) -> bool:
    return x.is_cuda or ((interpreting() or stand_in_size() is not None) and x.is_cpu)


def _node():
    """The compiled module, its Triton passes bound (once), or None without one."""
    if _NODE is None:
        node = compiled.NODE if compiled.NODE is not None else compiled.load()
        if node is not None:
            bind_node(node)
    return _NODE


def bind_node(node):
    """Bind the kernels (by name), ``plans.py`` as the passes' planner and Triton's JIT launch into the
    compiled module's passes, once; the value eager steps name them by (``bound_as``)."""
    global _NODE, _BOUND_AS
    if _NODE is node:
        return _BOUND_AS
    _BOUND_AS = node.bind_gpu({name: (k, _parameters(k)) for name, k in KERNELS.items()}, plans,
                              launcher.from_node)
    launcher.watch(list(KERNELS.values()), node.triton_changed, node.watch_launches, interpreting())
    plans._FORGET.append(node.forget_plans)
    _NODE = node
    return _BOUND_AS


def _parameters(kernel) -> list:
    """(name, whether a constexpr, do_not_specialize) of each parameter of a JIT function (or of the
    function Triton's interpreter runs), in order."""
    if hasattr(kernel, "params"):
        return [(p.name, bool(p.is_constexpr), bool(p.do_not_specialize)) for p in kernel.params]
    import inspect

    signature = inspect.signature(kernel.fn).parameters
    return [(name, "constexpr" in str(p.annotation), False) for name, p in signature.items()]


def _empty(t, like, dtype=None):
    """An absent result (None) as the contract's empty tensor."""
    return like.new_empty(0, dtype=dtype) if t is None else t


def _rows(t, x):
    """A pass's result in x's rows (N, C), as the contract gives it."""
    return t if t is None or t.dim() == 2 else t.view(-1, x.size(-1))


def forward(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, w_offset, bias, want_y, want_stats, center):
    """y = (xs - mean) * inv * (w + w_offset) + b over the rows, and per-program statistics
    of the real rows (``part``, (P, 3, C): count, then mean and sum of squared
    deviations when ``center``, else 0 and the sum of xs^2). With ``inv_eps``
    >= 0, ``inv`` is a running second moment and the scale is 1 / sqrt(inv + inv_eps).

    Returns (y or empty, group scales (N, G) or empty, part or empty)."""
    n = _NODE or _node()
    y, scale, part = n.gpu_forward(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, w_offset, bias, want_y,
                                   want_stats, center)
    return _empty(_rows(y, x), x), _empty(scale, x), _empty(part, x, _acc(x))


def finish_stats(part, mean_buf, second_buf, steps, update, momentum, eps, warmup):
    """The batch's statistics from ``forward``'s per-program ``part`` and the
    running statistics' update, in one kernel (contract.py; plain.py has the same in PyTorch ops)."""
    update = Update(update)  # a ValueError names an unknown one
    mean, inv, inv_batch, n = (_NODE or _node()).gpu_finish_stats(part, mean_buf, second_buf, steps, int(update),
                                                                  momentum, eps, warmup)
    return _empty(mean, second_buf), inv, inv_batch, n


def backward(x, mask, scale, grad_y, weight, w_offset, mean, inv_fwd, inv_bwd, A, B, b_scale, groups, correct_pads,
             want_gx, want_sums):
    """dL/dx = back through the group scaling of (g - m (A + b_scale B xh)) * inv_bwd, g = dy * (w + w_offset),
    and per-program sums ``part`` (P, 5, C): dy*xh and dy over every row,
    dy*xh and xh^2 over the real rows, xh^2 over every row.

    Returns (dL/dx or empty, part or empty)."""
    gx, part = (_NODE or _node()).gpu_backward(x, mask, scale, grad_y, weight, w_offset, mean, inv_fwd, inv_bwd, A, B,
                                               b_scale, groups, correct_pads, want_gx, want_sums)
    return _empty(_rows(gx, x), x), _empty(part, x, _acc(x))


def finish_backward(part, weight, w_offset, n, nu, rate, kind, center, rows):
    """The weight and bias gradients from ``backward``'s ``part``, the exact
    gradient's A and B (``kind`` EXACT) and nu's update, in one kernel
    (contract.py; plain.py has the same in PyTorch ops)."""
    kind = Mode(kind)  # a ValueError names an unknown one
    grad_w, grad_b, A, B = (_NODE or _node()).gpu_finish_backward(part, weight, w_offset, n, nu, rate, int(kind),
                                                                  center, rows)
    sd = nu.dtype if nu.numel() else _acc(part)  # the statistics' dtype, as the pass makes A and B in
    return grad_w, grad_b, _empty(A, part, sd), _empty(B, part, sd)


def row_forward(kind, x, params, w_offset, eps):
    """A per-row or per-entry kind's forward (contract.RowKind): (y, the statistic its backward reads and
    the backward's arrival ticket past it)."""
    y, stat = (_NODE or _node()).gpu_row_forward(kind, x, params, w_offset, eps)
    return _rows(y, x), stat


def row_backward(kind, x, stat, grad_y, params, w_offset, eps):
    """[dL/dx, one gradient per parameter], the parameters' sums added in a fixed order (by the last
    program, or ``_sum_columns``: plans.row_for_node)."""
    gx, *grads = (_NODE or _node()).gpu_row_backward(kind, x, stat, grad_y, params, w_offset, eps)
    return [_rows(gx, x), *grads]


contract.check(sys.modules[__name__], "triton")
