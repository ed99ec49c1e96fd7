"""The GPU backend: Triton kernels of the channel-statistics norms (BN, PN-V,
PN), ScaleNorm, RMSNorm and DyT, with the interface of the CPU backend
(``cpu.py``): the kernels (``gpu_channel.py``, ``gpu_rows.py``), their plans
(``plans.py``) and their launches (``launcher.py``) each in a file of their own.

Each pass here plans its launch, allocates what it writes and launches, in
Python: the path of Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors,
how CI checks the kernels' numbers without a GPU) and of a watched step (the
launch counter, ``launcher.HOLD`` False). An eager step on compiled kernels
goes through the C++ nodes instead (``bind_node``), which make the same plans
and launches with no Python in between (``csrc/gpu_passes.h``).
"""

import sys
import types

import torch

from . import contract
from .contract import Mode, Update
# each launch of the Python passes: through Triton's JIT (launcher.py); the C++ nodes hold the variants
from .launcher import OBSERVERS, observed  # noqa: F401 (the measuring tools' hooks)
from .launcher import launch as _launch
from .plans import (MAX_ROWS, PROGRAMS_PER_SM, REGISTERS_PER_SM, ROW_TICKET, SUB_CHUNK, TICKET_ROWS,  # noqa: F401
                    TILE, ROW_TILE, WARP, WARPS, WIDEST_GROUP, WIDEST_ROW, _FINISH_BLOCK, _NOTHING, _acc, _nothing,
                    SUM_ROWS, _planned, _row_plan, interpreting, parts, programs_per_sm, registers, stand_in,
                    stand_in_size)
from .gpu_channel import _channel_backward, _channel_forward, _finish_backward, _finish_stats, triton  # noqa: F401
from .gpu_rows import (_dyt_backward, _dyt_forward, _rmsnorm_backward, _rmsnorm_forward, _scalenorm_backward,
                       _scalenorm_forward, _sum_columns)

NAME = "triton"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
failure = None if triton is not None else "triton is not installed"


def available() -> bool:
    return triton is not None


def takes(x: torch.Tensor) -> bool:
    return x.is_cuda or ((interpreting() or stand_in_size() is not None) and x.is_cpu)


# The contract's four channel entry points take absent tensors as None or
# empty, and give empty ones back (ops take and give tensors). Each calls its
# pass with absent tensors as None, which gives None back: functions.py calls
# those (``DIRECT``) where nothing observes the step, without the conversions.

def _given(t):
    """An absent tensor (None, or an op's empty one) as None."""
    return None if t is None or not t.numel() else t


def _or_empty(t, like, dtype=None):
    return like.new_empty(0, dtype=dtype) if t is None else t


def forward(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, bias, want_y, want_stats, center):
    """y = (xs - mean) * inv * w + b over the rows, and per-program statistics
    of the real rows (``part``, (P, 3, C): count, then mean and sum of squared
    deviations when ``center``, else 0 and the sum of xs^2). With ``inv_eps``
    >= 0, ``inv`` is a running second moment and the scale is 1 / sqrt(inv + inv_eps).

    Returns (y or empty, group scales (N, G) or empty, part or empty)."""
    y, scale, part = _forward_pass(x, _given(mask), groups, gs_eps, _given(mean), _given(inv), inv_eps,
                                   _given(weight), _given(bias), want_y, want_stats, center)
    return _or_empty(y, x), _or_empty(scale, x), _or_empty(part, x, _acc(x))


def _forward_pass(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, bias, want_y, want_stats, center):
    """:func:`forward`'s pass, absent tensors None both ways."""
    x, plan = _planned("_channel_forward", x, mask, groups, not want_y, want_y, want_stats, 3,
                       ("HAS_MEAN", mean is not None, "INV_RUNNING", inv_eps >= 0, "WANT_Y", want_y,
                        "WANT_STATS", want_stats, "CENTER", center))
    none, dev = plan.nothing, x.device
    y = x.new_empty(plan.rows, plan.C) if want_y else None
    scale = torch.empty(plan.scale, dtype=plan.acc, device=dev) if plan.scale else None
    part = torch.empty(plan.part, dtype=plan.acc, device=dev) if plan.part else None
    _launch(_channel_forward, plan.grid, x, none if mask is None else mask, none if mean is None else mean,
            none if inv is None else inv, none if weight is None else weight, none if bias is None else bias,
            none if y is None else y, none if scale is None else scale, none if part is None else part,
            *plan.scalars, gs_eps, inv_eps, **plan.constexprs)
    return y, scale, part


def finish_stats(part, mean_buf, second_buf, steps, update, momentum, eps, warmup):
    """The batch's statistics from ``forward``'s per-program ``part`` and the
    running statistics' update, in one kernel (contract.py; plain.py has the same in PyTorch ops)."""
    if type(update) is not Update:
        update = Update(update)  # a ValueError names an unknown one
    mean, inv, inv_batch, n = _finish_stats_pass(part, _given(mean_buf), second_buf, _given(steps), update, momentum,
                                                 eps, warmup)
    return _or_empty(mean, second_buf), inv, inv_batch, n


def _finish_stats_pass(part, mean_buf, second_buf, steps, update, momentum, eps, warmup):
    """:func:`finish_stats`, absent tensors None both ways (the mean but for BN's)."""
    P, _, C = part.shape
    P -= 1  # the last row: the arrival ticket
    dev, sd = part.device, second_buf.dtype
    none = _NOTHING[dev] if dev in _NOTHING else _nothing(dev)
    progs = -(-C // _FINISH_BLOCK)
    bn = update == Update.BN
    mean = torch.empty(C, dtype=sd, device=dev) if bn else None
    inv, inv_batch = torch.empty(C, dtype=sd, device=dev), torch.empty(C, dtype=sd, device=dev)
    n = torch.empty(1, dtype=torch.float64, device=dev)
    scratch = torch.empty(2, C, dtype=sd, device=dev)
    flags = torch.empty(progs, dtype=torch.int32, device=dev)
    _launch(_finish_stats, (progs,),
            part, none if mean_buf is None else mean_buf, second_buf, none if steps is None else steps,
            none if mean is None else mean, inv, inv_batch, n, scratch, flags, part[P], P, C, momentum, eps, warmup,
            UPDATE=int(update), HAS_STEPS=steps is not None, BLOCK_R=SUM_ROWS, BLOCK=_FINISH_BLOCK,
            num_warps=WARPS, maxnreg=registers("_finish_stats", part.dtype == torch.float64))
    return mean, inv, inv_batch, n


def backward(x, mask, scale, grad_y, weight, mean, inv_fwd, inv_bwd, A, B, b_scale, groups, correct_pads,
             want_gx, want_sums):
    """dL/dx = back through the group scaling of (g - m (A + b_scale B xh)) * inv_bwd, g = dy * w,
    and per-program sums ``part`` (P, 5, C): dy*xh and dy over every row,
    dy*xh and xh^2 over the real rows, xh^2 over every row.

    Returns (dL/dx or empty, part or empty)."""
    gx, part = _backward_pass(x, _given(mask), _given(scale), grad_y, weight, _given(mean), inv_fwd,
                              _given(inv_bwd), _given(A), _given(B), b_scale, groups, correct_pads, want_gx, want_sums)
    return _or_empty(gx, x), _or_empty(part, x, _acc(x))


def _backward_pass(x, mask, scale, grad_y, weight, mean, inv_fwd, inv_bwd, A, B, b_scale, groups, correct_pads,
                   want_gx, want_sums):
    """:func:`backward`'s pass, absent tensors None both ways."""
    x, plan = _planned("_channel_backward", x, mask, groups, False, want_gx, want_sums, 5,
                       ("HAS_MEAN", mean is not None, "HAS_A", A is not None, "HAS_B", B is not None,
                        "CORRECT_PADS", correct_pads, "WANT_GX", want_gx, "WANT_SUMS", want_sums))
    none, dev = plan.nothing, x.device
    gx = x.new_empty(plan.rows, plan.C) if want_gx else None
    part = torch.empty(plan.part, dtype=plan.acc, device=dev) if plan.part else None
    # a wide group: each row's dot product with its group's gradient, from a first pass
    dots = torch.empty(plan.dots, dtype=plan.acc, device=dev) if plan.dots else none
    _launch(_channel_backward, plan.grid,  # the ticket row as in forward
            x, none if mask is None else mask, none if scale is None else scale, grad_y, weight,
            none if mean is None else mean, inv_fwd, none if inv_bwd is None else inv_bwd, none if A is None else A,
            none if B is None else B, none if gx is None else gx, none if part is None else part, dots,
            *plan.scalars, b_scale, **plan.constexprs)
    return gx, part


def finish_backward(part, weight, n, nu, rate, kind, center, rows):
    """The weight and bias gradients from ``backward``'s ``part``, the exact
    gradient's A and B (``kind`` EXACT) and nu's update, in one kernel
    (contract.py; plain.py has the same in PyTorch ops)."""
    if type(kind) is not Mode:
        kind = Mode(kind)  # a ValueError names an unknown one
    nu = _given(nu)
    grad_w, grad_b, A, B = _finish_backward_pass(part, weight, n, nu, rate, kind, center, rows)
    sd = nu.dtype if nu is not None else _acc(part)  # the statistics' dtype, as the pass makes A and B in
    return grad_w, grad_b, _or_empty(A, part, sd), _or_empty(B, part, sd)


def _finish_backward_pass(part, weight, n, nu, rate, kind, center, rows):
    """:func:`finish_backward`, absent tensors None both ways."""
    P, _, C = part.shape
    P -= 1  # the last row: the arrival ticket
    dev = part.device
    none = _NOTHING[dev] if dev in _NOTHING else _nothing(dev)
    sd = nu.dtype if nu is not None else (torch.float64 if part.dtype == torch.float64 else torch.float32)
    progs = -(-C // _FINISH_BLOCK)
    grad_w, grad_b = torch.empty_like(weight), torch.empty_like(weight)
    exact = kind == Mode.EXACT
    A = torch.empty(C, dtype=sd, device=dev) if exact and center else None
    B = torch.empty(C, dtype=sd, device=dev) if exact else None
    scratch = torch.empty(C, dtype=sd, device=dev) if nu is not None else none
    flags = torch.empty(progs, dtype=torch.int32, device=dev)
    _launch(_finish_backward, (progs,),
            part, weight, n, none if nu is None else nu, grad_w, grad_b, none if A is None else A,
            none if B is None else B, scratch, flags, part[P], P, C, rate, rows,
            MODE=int(kind), CENTER=center, HAS_NU=nu is not None, BLOCK_R=SUM_ROWS, BLOCK=_FINISH_BLOCK,
            num_warps=WARPS, maxnreg=registers("_finish_backward", part.dtype == torch.float64))
    return grad_w, grad_b, A, B


#: the channel passes as functions.py calls them where nothing observes a step: absent tensors None both ways
DIRECT = types.SimpleNamespace(forward=_forward_pass, finish_stats=_finish_stats_pass, backward=_backward_pass,
                               finish_backward=_finish_backward_pass)


def bind_node(node):
    """Bind the kernels, this file's constants and Triton's JIT launch into the C++ nodes, whose passes
    (csrc/gpu_passes.h) then plan and launch each step themselves; returns the passes' index there, or
    None under Triton's interpreter (no compiled kernel to launch)."""
    if interpreting():
        return None
    kernels = [_channel_forward, _finish_stats, _channel_backward, _finish_backward, _scalenorm_forward,
               _scalenorm_backward, _rmsnorm_forward, _rmsnorm_backward, _dyt_forward, _dyt_backward, _sum_columns]
    constants = dict(programs_per_sm=[PROGRAMS_PER_SM.get(k.__name__, 0) for k in kernels], warps=WARPS, warp=WARP,
                     registers_per_sm=REGISTERS_PER_SM, tile=TILE, row_tile=ROW_TILE, widest_group=WIDEST_GROUP,
                     widest_row=WIDEST_ROW, sub_chunk=SUB_CHUNK, max_rows=MAX_ROWS, finish_block=_FINISH_BLOCK,
                     sum_rows=SUM_ROWS)
    from .launcher import from_node, watch

    bound = node.bind_gpu(kernels, constants, from_node)
    watch(kernels, node.triton_changed)
    return bound



def scalenorm_forward(x, scale, eps):
    """y = g x / max(||x||, eps) per row; returns (y, the clamped norms (N,))."""
    x, N, C, progs, shape, constexprs, acc = _row_plan(_scalenorm_forward, x)
    y, norms = x.new_empty(N, C), torch.empty(N + ROW_TICKET, dtype=acc, device=x.device)
    _launch(_scalenorm_forward, (progs,), x, scale, y, norms, *shape, eps, **constexprs)
    return y, norms


def scalenorm_backward(x, norms, grad_y, scale, eps):
    """dL/dx = g / n (dy - x <dy, x> / n^2) (g / eps dy where clamped) and dL/dg
    = sum <dy, x> / n, summed by the last program in a fixed order."""
    x, N, C, progs, shape, constexprs, acc = _row_plan(_scalenorm_backward, x)
    gx, grad_scale = x.new_empty(N, C), torch.empty_like(scale)
    part = torch.empty(progs, dtype=acc, device=x.device)  # a program's sum of <dy, x> / n
    _launch(_scalenorm_backward, (progs,), x, norms, grad_y, scale, gx, part, grad_scale, norms[N:], *shape, eps,
            **constexprs)
    return gx, grad_scale


def rmsnorm_forward(x, weight, eps):
    """y = x / sqrt(mean(x^2) + eps) * w per row; returns (y, 1 / rms (N,))."""
    x, N, C, progs, shape, constexprs, acc = _row_plan(_rmsnorm_forward, x)
    y, rstd = x.new_empty(N, C), torch.empty(N + ROW_TICKET, dtype=acc, device=x.device)
    _launch(_rmsnorm_forward, (progs,), x, weight, y, rstd, *shape, eps, **constexprs)
    return y, rstd


def rmsnorm_backward(x, rstd, grad_y, weight):
    """dL/dx = r (g - x r^2 mean(g x)), g = dy * w; dL/dw = sum dy x r, the
    programs' sums added in a fixed order (``_sums_here``)."""
    x, N, C, progs, shape, constexprs, acc = _row_plan(_rmsnorm_backward, x)
    gx, grad_w = x.new_empty(N, C), torch.empty_like(weight)
    part = torch.empty(progs, C, dtype=acc, device=x.device)  # a program's sums of dy x r
    here = _sums_here(progs, shape)
    _launch(_rmsnorm_backward, (progs,), x, rstd, grad_y, weight, gx, part, grad_w, rstd[N:], *shape,
            SUM_HERE=here, **constexprs)
    if not here:
        _sum_columns_of(part, grad_w, None, progs, C)
    return gx, grad_w


def _sums_here(progs, shape) -> bool:
    """Whether a row backward's last program adds the programs' parameter sums itself: where those (P x C)
    are at most what each program moves (3 x its rows x C), so that it does at most twice the mean's
    work; else a launch of their own does, over channel blocks (``_sum_columns``)."""
    return progs <= 3 * shape[-1]


def _sum_columns_of(part, out, out2, rows, C):
    """``_sum_columns``: out (and out2, from the block after) the sums over ``rows`` rows of ``part``."""
    _launch(_sum_columns, (-(-C // _FINISH_BLOCK),), part, out, _nothing(part.device) if out2 is None else out2,
            rows, C, TWO=out2 is not None, BLOCK_R=SUM_ROWS, BLOCK=_FINISH_BLOCK, num_warps=WARPS,
            maxnreg=registers("_sum_columns", part.dtype == torch.float64))


def dyt_forward(x, alpha, weight, bias):
    """y = w tanh(alpha x) + b per entry; returns (y, the backward's arrival ticket, set to 0)."""
    x, N, C, progs, shape, constexprs, acc = _row_plan(_dyt_forward, x)
    y, ticket = x.new_empty(N, C), torch.empty(ROW_TICKET, dtype=acc, device=x.device)
    _launch(_dyt_forward, (progs,), x, alpha, weight, bias, y, ticket, *shape, **constexprs)
    return y, ticket


def dyt_backward(x, grad_y, alpha, weight, ticket):
    """dL/dx = alpha d, d = dy w (1 - t^2), t = tanh(alpha x); dL/dalpha, dL/dw and dL/db summed by the
    last program in a fixed order."""
    x, N, C, progs, shape, constexprs, acc = _row_plan(_dyt_backward, x)
    gx, grad_alpha = x.new_empty(N, C), torch.empty_like(alpha)
    grad_w, grad_b = torch.empty_like(weight), torch.empty_like(weight)
    part = torch.empty(progs * (2 * C + 1), dtype=acc, device=x.device)  # a program's sums (the kernel's doc)
    here = _sums_here(progs, shape)
    _launch(_dyt_backward, (progs,), x, grad_y, alpha, weight, gx, grad_alpha, grad_w, grad_b, part, ticket, *shape,
            SUM_HERE=here, **constexprs)
    if not here:
        _sum_columns_of(part, grad_w, grad_b, progs, C)
    return gx, grad_alpha, grad_w, grad_b


contract.check(sys.modules[__name__], "triton")
