"""The GPU backend: Triton kernels of the channel-statistics norms (BN, PN-V,
PN), ScaleNorm and RMSNorm, with the interface of the CPU backend (``cpu.py``).

Rows are tokens (N = T * B), columns channels (C). A channel norm's kernel
runs on a grid of (row ranges, column chunks); a chunk is one group of the
original code's group scaling when that is on, so a token's group is scaled
while it is in registers. Each program walks its rows once: it reads x (and
dy), writes y (or dx), and keeps per-channel sums of its rows, which it
writes as one row of partial sums (over at most ``MAX_ROWS`` rows, in
float32 for float32 and half inputs). A small finishing kernel, on a grid over the channels, adds the
partial sums in float64 in a fixed order and does the per-channel rest
(statistics, running buffers, nu, parameter gradients); its last program to
arrive commits the running buffers for every channel or for none. Arrivals
are counted in a ticket of the launch's own: the first element of the
partial sums' last row, which one extra program of the pass before, past
the last row, writes as 0 with the rest of its (empty) sums (the row
kernels: one element past the forward's per-row statistic, set to 0 by its
first program). Two launches in flight, or one aborted, share nothing.
Nothing is read back to the host. Half inputs are read as they are and
computed in float32; float64 inputs in float64 (the tests compare them with
float64 references). The kernels read fairseq's (B, T) padding mask.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (Triton's
interpreter), which is how CI checks their numbers without a GPU.
"""

import functools
import os
import sys
import types

import torch

from . import contract
from .contract import Mode, Update
# each launch: through Triton's JIT once per variant, then its compiled kernel, held (launcher.py)
from .launcher import OBSERVERS, observed  # noqa: F401 (the measuring tools' hooks)
from .launcher import launch as _launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the plain path or the CPU kernels serve instead
    triton = None

NAME = "triton"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
failure = None if triton is not None else "triton is not installed"


#: whether Triton's interpreter runs the kernels, read when this module (and so its kernels) is imported,
#: as ``triton.jit`` reads it for each kernel then
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    return _INTERPRETING


def available() -> bool:
    return triton is not None


#: the multiprocessors of a stand-in device (measure/standin.py), or None: CPU tensors then launch through
#: Triton's CUDA launcher on a stand-in driver, which records each launch and runs nothing
_STAND_IN = None


def stand_in(multiprocessors) -> None:
    """Take CPU tensors as a device with ``multiprocessors`` would (None: as before)."""
    global _STAND_IN
    _STAND_IN = multiprocessors


def takes(x: torch.Tensor) -> bool:
    return x.is_cuda or ((interpreting() or _STAND_IN is not None) and x.is_cpu)


#: resident programs per multiprocessor that each main kernel's grid launches
#: (float64, which only the tests run, half as many): each launch bounds its
#: registers to what this allows (``registers``, ptxas's .maxnreg), and every
#: variant compiled for sm_90 spills nothing within it (measure/sm90.py, checked in CI)
PROGRAMS_PER_SM = {"_channel_forward": 4, "_channel_backward": 3, "_scalenorm_forward": 4,
                   "_scalenorm_backward": 3, "_rmsnorm_forward": 4, "_rmsnorm_backward": 3, "_dyt_forward": 4,
                   "_dyt_backward": 3}
WARPS = 4  # of every kernel (triton's default)
REGISTERS_PER_SM, WARP = 65536, 32
#: elements of a tile (rows x columns) of a channel kernel and of a per-row one
TILE, ROW_TILE = 1024, 2048
#: the widest group (channel kernels) and row (per-row kernels) held in registers
#: whole; a wider one is walked in sub-chunks of this many columns (``WIDE``)
WIDEST_GROUP, WIDEST_ROW, SUB_CHUNK = 1024, 2048, 1024
#: rows a program sums at most, in float32 tile by tile: a longer input gets more programs
#: (a grid of several waves), and the finishing kernels add the programs' sums in float64
MAX_ROWS = 1024


def programs_per_sm(kernel: str, float64: bool = False) -> int:
    return max(1, PROGRAMS_PER_SM[kernel] // 2) if float64 else PROGRAMS_PER_SM[kernel]


def registers(kernel: str, float64: bool = False) -> int:
    """A main kernel's launch bound: the registers per thread (allocated in
    units of 8, at most 255) with which its grid's programs per
    multiprocessor are resident at once. ptxas, left unbounded, spills a few
    bytes in some variants to stay under a budget of its own choosing."""
    return min(255, REGISTERS_PER_SM // (programs_per_sm(kernel, float64) * WARPS * WARP)) // 8 * 8


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs(x: torch.Tensor, kernel: str) -> int:
    """How many programs to spread rows over: as many per multiprocessor as are resident at once."""
    if x.is_cuda or _STAND_IN is not None:
        sms = _multiprocessors(x.device) if x.is_cuda else _STAND_IN
        return programs_per_sm(kernel, x.dtype == torch.float64) * sms
    return 4  # the interpreter runs programs one after another


# The host's arithmetic of the launches, in plain Python: triton.cdiv and
# triton.next_power_of_2 are wrappers for kernels that cost microseconds a
# call on the host, about 18 of them a step of a PN layer.
def _cdiv(a, b):
    return -(-a // b)


def _pow2(n) -> int:
    """The least power of two >= n (a width: a symbolic one is fixed here, as its kernel's block is)."""
    return 1 << (int(n) - 1).bit_length()


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _layout(x, groups, kernel, tall=False):
    """(chunk width, its power-of-two block, chunks, rows per step, rows per
    program, row programs). A group wider than ``WIDEST_GROUP`` is one chunk
    walked in blocks of ``SUB_CHUNK`` columns (``WIDE``: block < width); its
    width goes to the kernels at run time (``cw``, the constexpr ``CW`` 0), so
    that one variant serves every wide group, where a narrower group's
    kernels are compiled for its width."""
    N, C = x.numel() // x.size(-1), x.size(-1)
    if groups > 0:
        cw = C // groups
    else:
        cw = min(_pow2(C), 128)
    block_c = _pow2(cw)
    if block_c > WIDEST_GROUP:
        block_c = SUB_CHUNK
    chunks = _cdiv(C, cw)
    # a pass that writes nothing row-sized (statistics only) holds fewer live
    # tiles and takes them twice as tall (some shorter ones spill on sm_90)
    block_n = max(1, min(32, (2 if tall else 1) * TILE // block_c))
    # as many row programs as are resident at once, whatever N (those past the last row sum nothing), and more
    # only past MAX_ROWS rows each: the per-program sums' shape does not follow the sequence length, so
    # torch.compile keeps one graph for every length of a batch (a single guard, N <= progs * MAX_ROWS)
    progs = max(_cdiv(_programs(x, kernel), chunks), _cdiv(N, MAX_ROWS))
    per_prog = _cdiv(_cdiv(N, progs), block_n) * block_n
    return cw, block_c, chunks, block_n, per_prog, progs


def parts(x, groups, kernel, tall):
    """(rows, dtype) of the per-program statistics ``forward`` and ``backward``
    return (``tall``: a statistics-only pass): a row per program, and the
    arrival ticket of the finishing kernel."""
    return _layout(x, groups, kernel, tall)[-1] + 1, _acc(x)


#: rows past the per-program ones in a part, and elements past the N per-row
#: statistics of the row kernels' forward: the finishing kernel's arrival ticket
TICKET_ROWS, ROW_TICKET = 1, 1


_NOTHING = {}


def _nothing(device):
    """A one-element placeholder for the pointer of an input a variant does not read."""
    if device not in _NOTHING:
        _NOTHING[device] = torch.zeros(1, device=device)
    return _NOTHING[device]


def _mask_args(mask, device):
    """(pointer, batch size, sequence length) of a (B, T) padding mask (None: none), rows r = t * B + b."""
    if mask is None:
        return _nothing(device), 1, 1
    return mask, mask.size(0), mask.size(1)


def _rows(x):
    """x, (N, C) or (T, B, C), as the kernels read its rows r = t * B + b:
    (x, N, C, (B, row stride of t, row stride of b)). Rows of unit column
    stride are read where they lie, at any row strides: fairseq's residual
    stream, the transposed view of a (B, T, C) tensor, is not copied."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    C = x.size(-1)
    N = x.numel() // C
    if x.dim() == 3 and not x.is_contiguous():
        return x, N, C, (x.size(1), x.stride(0), x.stride(1))
    return x, N, C, (1, x.stride(0) if x.dim() == 2 else C, 0)


_FINISH_BLOCK = 64  # columns per program of the finishing kernels


class _Plan:
    """What a channel pass's launch takes besides its tensors, worked out once
    per input layout and variant (``_PLANS``): a step then allocates its
    outputs and launches, with no other host arithmetic."""

    __slots__ = ("rows", "C", "grid", "scalars", "constexprs", "part", "scale", "dots", "nothing", "acc")


_PLANS = {}
#: plans kept at most (of each kind): a layout per batch shape, and batch shapes vary; past this many,
#: the plans are made anew as the shapes come
_KEPT_PLANS = 4096


def _plan(kernel, x, mask, groups, tall, want_rows, want_part, sums, constexprs):
    """The :class:`_Plan` of ``kernel`` over x's rows (``_rows``: unit column
    stride) with padding ``mask`` (or none); ``sums``: rows of the part."""
    x, N, C, geometry = _rows(x)
    cw, block_c, chunks, block_n, per_prog, progs = _layout(x, groups, kernel, tall)
    acc, wide = _acc(x), block_c < cw
    m, nb, nt = _mask_args(mask, x.device)
    plan = _Plan()
    plan.rows, plan.C, plan.nothing, plan.acc = N, C, _nothing(x.device), acc
    # with the part, one program more than the rows need: it has no rows, and so writes the part's last row
    # as zeros, the first of which is the finishing kernel's ticket
    plan.grid = (progs + int(want_part), chunks)
    plan.scalars = (N, C, *geometry, nb, nt, per_prog, cw)
    plan.constexprs = dict(zip(constexprs[::2], constexprs[1::2]), HAS_MASK=mask is not None, GROUPED=groups > 0,
                           F64=acc == torch.float64, WIDE=wide, BLOCK_N=block_n, BLOCK_C=block_c,
                           CW=0 if wide else cw, num_warps=WARPS, maxnreg=registers(kernel, acc == torch.float64))
    plan.part = (progs + 1, sums, C) if want_part else None
    plan.scale = (N, groups) if groups > 0 else None
    plan.dots = (N, groups) if wide and want_rows and kernel == "_channel_backward" else None
    return plan


def _planned(kernel, x, mask, groups, tall, want_rows, want_part, sums, constexprs):
    """(x with unit column stride, the :class:`_Plan` of the launch over x with
    padding ``mask`` (None: none), made on its first use); ``constexprs``: the
    variant's, as a flat (name, value, ...) tuple. Inline tests, no helpers:
    a step's host calls are counted (measure/host.py)."""
    strides = x.stride()
    if strides[-1] != 1:
        x = x.contiguous()
        strides = x.stride()
    key = (kernel, x.shape, strides, x.dtype, x.device, None if mask is None else mask.shape, groups, constexprs)
    if key in _PLANS:
        return x, _PLANS[key]
    if len(_PLANS) > _KEPT_PLANS:
        _PLANS.clear()
    plan = _PLANS[key] = _plan(kernel, x, mask, groups, tall, want_rows, want_part, sums, constexprs)
    return x, plan


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
            UPDATE=int(update), HAS_STEPS=steps is not None, BLOCK=_FINISH_BLOCK)
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
    x, plan = _planned("_channel_backward", x, mask, groups, not want_gx, want_gx, want_sums, 5,
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
            MODE=int(kind), CENTER=center, HAS_NU=nu is not None, BLOCK=_FINISH_BLOCK)
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
               _scalenorm_backward, _rmsnorm_forward, _rmsnorm_backward, _dyt_forward, _dyt_backward]
    constants = dict(programs_per_sm=[PROGRAMS_PER_SM.get(k.__name__, 0) for k in kernels], warps=WARPS, warp=WARP,
                     registers_per_sm=REGISTERS_PER_SM, tile=TILE, row_tile=ROW_TILE, widest_group=WIDEST_GROUP,
                     widest_row=WIDEST_ROW, sub_chunk=SUB_CHUNK, max_rows=MAX_ROWS, finish_block=_FINISH_BLOCK)
    from .launcher import from_node

    return node.bind_gpu(kernels, constants, from_node)


def _row_layout(x, kernel):
    """(columns per block, rows per step, rows per program, programs): a row
    wider than ``WIDEST_ROW`` is walked in blocks of ``SUB_CHUNK`` columns."""
    N, C = x.numel() // x.size(-1), x.size(-1)
    block_c = _pow2(C)
    if block_c > WIDEST_ROW:
        block_c = SUB_CHUNK
    block_n = max(1, min(32, ROW_TILE // block_c))
    progs = max(1, min(_cdiv(N, block_n), max(_programs(x, kernel), _cdiv(N, MAX_ROWS))))
    per_prog = _cdiv(_cdiv(N, progs), block_n) * block_n
    return block_c, block_n, per_prog, _cdiv(N, per_prog)


_ROW_PLANS = {}  # at most _KEPT_PLANS, as _PLANS


def _row_plan(kernel, x):
    """(x with unit column stride, its rows N, programs, the launch's integer
    arguments, its constexprs, the accumulation dtype) of per-row ``kernel`` over the rows of x
    (``_rows``), worked out once per kernel, layout and dtype: the kernel
    takes (x, its tensors, N, C, x's row geometry, rows per program, its scalars)."""
    strides = x.stride()
    if strides[-1] != 1:
        x = x.contiguous()
        strides = x.stride()
    key = (kernel, x.shape, strides, x.dtype, x.device)
    if key in _ROW_PLANS:
        return (x, *_ROW_PLANS[key])
    _, N, C, geometry = _rows(x)
    block_c, block_n, per_prog, progs = _row_layout(x, kernel.__name__)
    f64 = x.dtype == torch.float64
    if len(_ROW_PLANS) > _KEPT_PLANS:
        _ROW_PLANS.clear()
    plan = _ROW_PLANS[key] = (N, C, progs, (N, C, *geometry, per_prog), dict(
        F64=f64, WIDE=block_c < C, BLOCK_N=block_n, BLOCK_C=block_c, num_warps=WARPS,
        maxnreg=registers(kernel.__name__, f64)), _acc(x))
    return (x, *plan)


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
    """dL/dx = r (g - x r^2 mean(g x)), g = dy * w; dL/dw = sum dy x r, summed
    by the last program in a fixed order."""
    x, N, C, progs, shape, constexprs, acc = _row_plan(_rmsnorm_backward, x)
    gx, grad_w = x.new_empty(N, C), torch.empty_like(weight)
    part = torch.empty(progs, C, dtype=acc, device=x.device)  # a program's sums of dy x r
    _launch(_rmsnorm_backward, (progs,), x, rstd, grad_y, weight, gx, part, grad_w, rstd[N:], *shape, **constexprs)
    return gx, grad_w


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
    _launch(_dyt_backward, (progs,), x, grad_y, alpha, weight, gx, grad_alpha, grad_w, grad_b, part, ticket, *shape,
            **constexprs)
    return gx, grad_alpha, grad_w, grad_b


# Integer arguments that change with every batch (row counts, per-program
# rows) are not specialised on (value 1, multiple of 16): each new value would
# otherwise compile another variant during training. Channel counts are.
if triton is not None:
    # the contract's enumerations as the kernels' compile-time constants
    BN, PN_V, PN_WARM, PN = (tl.constexpr(int(u)) for u in (Update.BN, Update.PN_V, Update.PN_WARM, Update.PN))
    REFERENCE_RUN, EXACT, REFERENCE = (tl.constexpr(int(Update.REFERENCE)), tl.constexpr(int(Mode.EXACT)),
                                       tl.constexpr(int(Mode.REFERENCE)))


    @triton.jit
    def _f(v, F64: tl.constexpr):
        """``v`` in the accumulation dtype."""
        if F64:
            return v.to(tl.float64)
        else:
            return v.to(tl.float32)

    @triton.jit
    def _row_tile(X, XB, XST, XSB, first, N, C, cols, cmask, BLOCK_N: tl.constexpr, F64: tl.constexpr):
        """Rows first .. first + BLOCK_N of ``X`` at columns ``cols``: (rows,
        their mask, the tile's mask, its offsets in a contiguous (N, C) tensor,
        the tile in the accumulation dtype, 0 outside). Row r = t * XB + b of X
        starts at t * XST + b * XSB (_rows: a (T, B, C) view read where it lies)."""
        rows = first + tl.arange(0, BLOCK_N)
        rmask = rows < N
        m2 = rmask[:, None] & cmask[None, :]
        at = rows[:, None].to(tl.int64) * C + cols[None, :]
        xrow = (rows // XB).to(tl.int64) * XST + (rows % XB).to(tl.int64) * XSB
        return rows, rmask, m2, at, _f(tl.load(X + xrow[:, None] + cols[None, :], mask=m2, other=0.0), F64)

    @triton.jit
    def _cast(v, PTR):
        """float64 ``v`` in the dtype of what ``PTR`` points to (half by way of float32)."""
        if PTR.dtype.element_ty == tl.float64:
            return v
        else:
            return v.to(tl.float32).to(PTR.dtype.element_ty)

    @triton.jit
    def _keep(MASK, rows, rmask, nb, nt, HAS_MASK: tl.constexpr, F64: tl.constexpr):
        """1 at the real rows, 0 at padding and past the end: row r = t * B + b
        is token t of sentence b, padding where the (B, T) mask says so."""
        keep = _f(rmask.to(tl.float32), F64)
        if HAS_MASK:
            pad = tl.load(MASK + (rows % nb).to(tl.int64) * nt + rows // nb, mask=rmask, other=1)
            keep = tl.where(pad != 0, 0.0, keep)
        return keep

    @triton.jit
    def _last_to_arrive(TICKET):
        """Whether this program is the grid's last to get here, counted in the
        launch's own ticket (a float the pass before set to 0; counts stay
        exact); the last one sets it back to 0, for a second backward of the
        same graph. Everything a program stored before is visible to the last
        one (acquire-release)."""
        total = tl.num_programs(0) * tl.num_programs(1)
        arrived = tl.atomic_add(TICKET, 1.0, sem="acq_rel")
        last = arrived == total - 1
        if last:
            tl.store(TICKET, 0.0)
        return last

    @triton.jit
    def _all_set(FLAGS, n):
        ok = tl.load(FLAGS) != 0
        for i in range(1, n):
            ok = ok & (tl.load(FLAGS + i) != 0)
        return ok

    # A channel kernel's program holds one chunk of columns of a row tile; a
    # group wider than a block (WIDE, gpu.WIDEST_GROUP) is walked in blocks:
    # a first pass writes each row's group scale (forward) or the dot product
    # its backward needs (backward) to a per-row buffer, the main pass reads it.

    @triton.jit
    def _at_group(P, rows, chunk):
        """Where rows' values for group ``chunk`` lie in a per-row, per-group (N, groups) buffer."""
        return P + rows.to(tl.int64) * tl.num_programs(1) + chunk

    @triton.jit
    def _inv_rms(sum_sq, n, eps):
        """1 / sqrt(mean(x^2) + eps) from a sum of n squares: RMSNorm's and the group scaling's factor."""
        return 1.0 / tl.sqrt(sum_sq / n + eps)

    @triton.jit
    def _group_scales(X, XB, XST, XSB, SCALE, start, per_prog, N, C, chunk, gs_eps, width,
                      F64: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        """SCALE[row, chunk] = 1 / sqrt(mean(x^2) + eps) over the chunk's ``width`` columns, block by block."""
        offs = tl.arange(0, BLOCK_C)
        for r0 in range(0, per_prog, BLOCK_N):
            rows = start + r0 + tl.arange(0, BLOCK_N)
            rmask = rows < N
            ss = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
            for s0 in range(0, width, BLOCK_C):
                cols = chunk * width + s0 + offs
                x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, (s0 + offs < width) & (cols < C), BLOCK_N,
                              F64)[4]
                ss += tl.sum(x * x, axis=1)
            tl.store(_at_group(SCALE, rows, chunk), _inv_rms(ss, width, gs_eps), mask=rmask)

    @triton.jit
    def _group_scale(SCALE, rows, rmask, x, chunk, gs_eps, F64: tl.constexpr, WIDE: tl.constexpr,
                     CW: tl.constexpr):
        """The rows' group scales: from the tile x (the whole group), or as the first pass wrote them (WIDE)."""
        if WIDE:
            return _f(tl.load(_at_group(SCALE, rows, chunk), mask=rmask, other=0.0), F64)
        else:
            return _inv_rms(tl.sum(x * x, axis=1), CW, gs_eps)

    @triton.jit(do_not_specialize=["N", "nb", "nt", "per_prog"])
    def _channel_forward(X, MASK, MEAN, INV, W, Bias, Y, SCALE, PART,
                         N, C, XB, XST, XSB, nb, nt, per_prog, cw, gs_eps, inv_eps,
                         HAS_MASK: tl.constexpr, HAS_MEAN: tl.constexpr, INV_RUNNING: tl.constexpr,
                         GROUPED: tl.constexpr, WANT_Y: tl.constexpr, WANT_STATS: tl.constexpr,
                         CENTER: tl.constexpr, F64: tl.constexpr, WIDE: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, CW: tl.constexpr):
        pid_n = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = tl.arange(0, BLOCK_C)
        start = pid_n * per_prog
        if WIDE:  # the chunk's width: run-time for a wide group, else the constexpr (_layout)
            width = cw
        else:
            width = CW
        if WIDE:
            _group_scales(X, XB, XST, XSB, SCALE, start, per_prog, N, C, chunk, gs_eps, width, F64, BLOCK_N, BLOCK_C)
        for s0 in range(0, width, BLOCK_C):  # one block unless WIDE
            cols = chunk * width + s0 + offs
            cmask = (s0 + offs < width) & (cols < C)
            zero = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
            mul = zero
            add = zero
            sub = zero
            if WANT_Y:  # y = (xs - mean) * mul + add: centred first, which no FMA contraction can cancel
                if INV_RUNNING:  # a running second moment (PN after warmup, Algorithm 2's psi_{t-1}),
                    # its scale in float64 and rounded as finish_stats returns it
                    run = tl.load(INV + cols, mask=cmask, other=1.0).to(tl.float64)
                    inv = _f((1.0 / tl.sqrt(run + inv_eps)).to(INV.dtype.element_ty), F64)
                else:
                    inv = _f(tl.load(INV + cols, mask=cmask, other=0.0), F64)
                mul = inv * _f(tl.load(W + cols, mask=cmask, other=0.0), F64)
                add = _f(tl.load(Bias + cols, mask=cmask, other=0.0), F64)
                if HAS_MEAN:
                    sub = _f(tl.load(MEAN + cols, mask=cmask, other=0.0), F64)
            count = tl.sum(zero, axis=0)
            s1 = zero
            s2 = zero
            shift = zero
            if WANT_STATS and CENTER:  # shifted data: the masked mean of the program's first tile
                rows, rmask, m2, at, x = _row_tile(X, XB, XST, XSB, start, N, C, cols, cmask, BLOCK_N, F64)
                if GROUPED:
                    x = x * _group_scale(SCALE, rows, rmask, x, chunk, gs_eps, F64, WIDE, CW)[:, None]
                keep = _keep(MASK, rows, rmask, nb, nt, HAS_MASK, F64)
                shift = tl.sum(x * keep[:, None], axis=0) / tl.maximum(tl.sum(keep, axis=0), 1.0)
            for r0 in range(0, per_prog, BLOCK_N):
                rows, rmask, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cmask, BLOCK_N, F64)
                if GROUPED:  # the original code's layer scale: this chunk is one group
                    r = _group_scale(SCALE, rows, rmask, x, chunk, gs_eps, F64, WIDE, CW)
                    if WANT_Y and not WIDE:
                        tl.store(_at_group(SCALE, rows, chunk), r, mask=rmask)
                    x = x * r[:, None]
                if WANT_STATS:
                    keep = _keep(MASK, rows, rmask, nb, nt, HAS_MASK, F64)
                    d = tl.where(m2, x - shift[None, :], 0.0)
                    dk = d * keep[:, None]
                    count += tl.sum(keep, axis=0)
                    s1 += tl.sum(dk, axis=0)
                    s2 += tl.sum(dk * d, axis=0)
                if WANT_Y:
                    y = (x - sub[None, :]) * mul[None, :] + add[None, :]
                    tl.store(Y + at, y.to(Y.dtype.element_ty), mask=m2)
            if WANT_STATS:
                base = PART + pid_n.to(tl.int64) * 3 * C
                tl.store(base + cols, zero + count, mask=cmask)
                if CENTER:  # this program's mean and sum of squared deviations from it
                    s1n = s1 / tl.maximum(count, 1.0)
                    tl.store(base + C + cols, shift + s1n, mask=cmask)
                    tl.store(base + 2 * C + cols, s2 - s1 * s1n, mask=cmask)
                else:
                    tl.store(base + C + cols, zero, mask=cmask)
                    tl.store(base + 2 * C + cols, s2, mask=cmask)

    @triton.jit(do_not_specialize=["P", "warmup"])
    def _finish_stats(PART, RA, RB, STEPS, MEAN, INV, INVB, NOUT, SCRATCH, FLAGS, TICKET,
                      P, C, momentum, eps, warmup,
                      UPDATE: tl.constexpr, HAS_STEPS: tl.constexpr, BLOCK: tl.constexpr):
        """UPDATE: an Update (contract.py)."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cm = cols < C
        z = tl.zeros([BLOCK], dtype=tl.float64)
        n = z
        s1 = z
        s2 = z
        for p in range(0, P):  # in a fixed order: the same result every run
            base = PART + p * 3 * C + cols
            cnt = tl.load(base, mask=cm, other=0.0).to(tl.float64)
            n += cnt
            s1 += cnt * tl.load(base + C, mask=cm, other=0.0).to(tl.float64)
            s2 += tl.load(base + 2 * C, mask=cm, other=0.0).to(tl.float64)
        ns = tl.maximum(n, 1.0)
        mean = s1 / ns
        if UPDATE == BN:  # Chan et al.'s pairwise formula: each program's M2 plus its mean's spread
            m2 = z
            for p in range(0, P):
                base = PART + p * 3 * C + cols
                cnt = tl.load(base, mask=cm, other=0.0).to(tl.float64)
                dm = tl.load(base + C, mask=cm, other=0.0).to(tl.float64) - mean
                m2 += tl.load(base + 2 * C, mask=cm, other=0.0).to(tl.float64) + cnt * dm * dm
            second = tl.maximum(m2 / ns, 0.0)
        else:
            second = s2 / ns
        real = n > 0.0
        old_b = tl.load(RB + cols, mask=cm, other=1.0).to(tl.float64)
        inv_batch = 1.0 / tl.sqrt(second + eps)
        inv_run = 1.0 / tl.sqrt(old_b + eps)
        k = z + 1.0
        if HAS_STEPS:
            k = z + (tl.load(STEPS).to(tl.float64) + 1.0)
        if UPDATE == BN:
            old_a = tl.load(RA + cols, mask=cm, other=0.0).to(tl.float64)
            tl.store(MEAN + cols, tl.where(real, mean, old_a).to(MEAN.dtype.element_ty), mask=cm)
            tl.store(SCRATCH + cols, (old_a + momentum * (mean - old_a)).to(SCRATCH.dtype.element_ty), mask=cm)
            unbiased = second * n / tl.maximum(n - 1.0, 1.0)
            new_b = tl.where(n > 1.0, old_b + momentum * (unbiased - old_b), old_b)
        elif UPDATE == PN_V:
            new_b = old_b + momentum * (second - old_b)
        elif UPDATE == PN_WARM:  # cumulative mean
            new_b = old_b * ((k - 1.0) / k) + second / k
        elif UPDATE == PN:  # Algorithm 2: psi_t^2 = alpha psi_{t-1}^2 + (1 - alpha) psi_B^2
            new_b = old_b + momentum * (second - old_b)
        else:
            new_b = tl.where(k < warmup, old_b * ((k - 1.0) / k) + second / k, old_b)
            new_b = new_b + momentum * (second - new_b)
        if UPDATE == PN or UPDATE == REFERENCE_RUN:  # the forward normalised with the running psi^2_{t-1}
            inv = inv_run
        else:
            inv = tl.where(real, inv_batch, inv_run)
        tl.store(INV + cols, inv.to(INV.dtype.element_ty), mask=cm)
        # the batch's own scale (the released backward's), the running one for a batch of padding
        tl.store(INVB + cols, tl.where(real, inv_batch, inv_run).to(INVB.dtype.element_ty), mask=cm)
        tl.store(SCRATCH + C + cols, new_b.to(SCRATCH.dtype.element_ty), mask=cm)
        finite = (second == second) & (second < float("inf"))
        if UPDATE == BN:
            finite = finite & (mean == mean) & (tl.abs(mean) < float("inf"))
        ok = tl.sum(tl.where(cm & ~finite, 1, 0), axis=0) == 0
        tl.store(FLAGS + tl.program_id(0), ok.to(tl.int32))
        n0 = tl.sum(tl.where(cols == tl.program_id(0) * BLOCK, n, 0.0), axis=0)
        if _last_to_arrive(TICKET):
            # every program's candidates in, or none: a non-finite statistic
            # (overflowed half activations) or a batch of padding leaves them all
            if _all_set(FLAGS, tl.num_programs(0)) & (n0 > 0.0):
                for c0 in range(0, C, BLOCK):
                    cc = c0 + tl.arange(0, BLOCK)
                    if UPDATE == BN:
                        tl.store(RA + cc, tl.load(SCRATCH + cc, mask=cc < C), mask=cc < C)
                    tl.store(RB + cc, tl.load(SCRATCH + C + cc, mask=cc < C), mask=cc < C)
            if HAS_STEPS:
                tl.store(STEPS, tl.load(STEPS) + (n0 > 0.0).to(tl.int64))
            tl.store(NOUT, n0)

    @triton.jit
    def _backward_vectors(INVF, MEAN, W, INVB, A, Bc, cols, cmask, b_scale, HAS_MEAN: tl.constexpr,
                          HAS_A: tl.constexpr, HAS_B: tl.constexpr, WANT_GX: tl.constexpr, F64: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        """The per-channel factors of the backward at ``cols``: (inv_fwd, mean, w, inv_bwd, A, b_scale B)."""
        zero = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
        invf = _f(tl.load(INVF + cols, mask=cmask, other=0.0), F64)
        shift = zero  # xh = (xs - shift) * invf: centred first, which no FMA contraction can cancel
        if HAS_MEAN:
            shift = _f(tl.load(MEAN + cols, mask=cmask, other=0.0), F64)
        w = _f(tl.load(W + cols, mask=cmask, other=0.0), F64)
        invb = zero
        a = zero
        b = zero
        if WANT_GX:
            invb = _f(tl.load(INVB + cols, mask=cmask, other=0.0), F64)
            if HAS_A:
                a = _f(tl.load(A + cols, mask=cmask, other=0.0), F64)
            if HAS_B:
                b = _f(tl.load(Bc + cols, mask=cmask, other=0.0), F64) * b_scale
        return invf, shift, w, invb, a, b

    @triton.jit
    def _backward_tile(X, XB, XST, XSB, SCALE, GY, MASK, first, N, C, nb, nt, cols, cmask, chunk, invf, shift,
                       HAS_MASK: tl.constexpr, GROUPED: tl.constexpr, F64: tl.constexpr, BLOCK_N: tl.constexpr):
        """A row tile for the backward: (rows, rmask, m2, at, xs, xh, dy, keep, group scale r)."""
        rows, rmask, m2, at, xs = _row_tile(X, XB, XST, XSB, first, N, C, cols, cmask, BLOCK_N, F64)
        r = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
        if GROUPED:
            r = _f(tl.load(_at_group(SCALE, rows, chunk), mask=rmask, other=0.0), F64)
            xs = xs * r[:, None]
        xh = tl.where(m2, (xs - shift[None, :]) * invf[None, :], 0.0)
        gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
        keep = _keep(MASK, rows, rmask, nb, nt, HAS_MASK, F64)
        return rows, rmask, m2, at, xs, xh, gy, keep, r

    @triton.jit
    def _gxs(gy, w, keep, rmask, a, b, xh, invb, CORRECT_PADS: tl.constexpr, F64: tl.constexpr):
        """dL/dxs, the gradient before the group scaling (Eq. 3 / Eq. 6 with PN's A and B)."""
        m = keep
        if CORRECT_PADS:
            m = _f(rmask.to(tl.float32), F64)
        return (gy * w[None, :] - m[:, None] * (a[None, :] + b[None, :] * xh)) * invb[None, :]

    @triton.jit(do_not_specialize=["N", "nb", "nt", "per_prog"])
    def _channel_backward(X, MASK, SCALE, GY, W, MEAN, INVF, INVB, A, Bc, GX, PART, DOTS,
                          N, C, XB, XST, XSB, nb, nt, per_prog, cw, b_scale,
                          HAS_MASK: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_A: tl.constexpr,
                          HAS_B: tl.constexpr, GROUPED: tl.constexpr, CORRECT_PADS: tl.constexpr,
                          WANT_GX: tl.constexpr, WANT_SUMS: tl.constexpr, F64: tl.constexpr, WIDE: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, CW: tl.constexpr):
        pid_n = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = tl.arange(0, BLOCK_C)
        start = pid_n * per_prog
        if WIDE:  # the chunk's width: run-time for a wide group, else the constexpr (_layout)
            width = cw
        else:
            width = CW
        if WIDE and WANT_GX:  # first pass: each row's mean(dxs * xs) over its group, block by block
            for r0 in range(0, per_prog, BLOCK_N):
                rows = start + r0 + tl.arange(0, BLOCK_N)
                rmask = rows < N
                dot = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
                for s0 in range(0, width, BLOCK_C):
                    cols = chunk * width + s0 + offs
                    cmask = (s0 + offs < width) & (cols < C)
                    invf, shift, w, invb, a, b = _backward_vectors(INVF, MEAN, W, INVB, A, Bc, cols, cmask, b_scale,
                                                                   HAS_MEAN, HAS_A, HAS_B, WANT_GX, F64, BLOCK_C)
                    _, _, m2, at, xs, xh, gy, keep, r = _backward_tile(
                        X, XB, XST, XSB, SCALE, GY, MASK, start + r0, N, C, nb, nt, cols, cmask, chunk, invf, shift,
                        HAS_MASK, GROUPED, F64, BLOCK_N)
                    dot += tl.sum(_gxs(gy, w, keep, rmask, a, b, xh, invb, CORRECT_PADS, F64) * xs, axis=1)
                tl.store(_at_group(DOTS, rows, chunk), dot / width, mask=rmask)
        for s0 in range(0, width, BLOCK_C):  # one block unless WIDE
            cols = chunk * width + s0 + offs
            cmask = (s0 + offs < width) & (cols < C)
            invf, shift, w, invb, a, b = _backward_vectors(INVF, MEAN, W, INVB, A, Bc, cols, cmask, b_scale,
                                                           HAS_MEAN, HAS_A, HAS_B, WANT_GX, F64, BLOCK_C)
            zero = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
            s0_ = zero  # dy * xh, every row
            s1 = zero  # dy, every row
            s2 = zero  # dy * xh, real rows
            s3 = zero  # xh^2, real rows
            s4 = zero  # xh^2, every row
            for r0 in range(0, per_prog, BLOCK_N):
                rows, rmask, m2, at, xs, xh, gy, keep, r = _backward_tile(
                    X, XB, XST, XSB, SCALE, GY, MASK, start + r0, N, C, nb, nt, cols, cmask, chunk, invf, shift,
                    HAS_MASK, GROUPED, F64, BLOCK_N)
                if WANT_SUMS:
                    gxh = gy * xh
                    xh2 = xh * xh
                    s0_ += tl.sum(gxh, axis=0)
                    s1 += tl.sum(gy, axis=0)
                    s2 += tl.sum(gxh * keep[:, None], axis=0)
                    s3 += tl.sum(xh2 * keep[:, None], axis=0)
                    s4 += tl.sum(xh2, axis=0)
                if WANT_GX:
                    gxs = _gxs(gy, w, keep, rmask, a, b, xh, invb, CORRECT_PADS, F64)
                    if GROUPED:  # back through the group's scale: r (d - xs mean(d xs))
                        if WIDE:
                            dot = _f(tl.load(_at_group(DOTS, rows, chunk), mask=rmask, other=0.0), F64)
                        else:
                            dot = tl.sum(gxs * xs, axis=1) / CW
                        gxs = r[:, None] * (gxs - xs * dot[:, None])
                    tl.store(GX + at, gxs.to(GX.dtype.element_ty), mask=m2)
            if WANT_SUMS:
                base = PART + pid_n.to(tl.int64) * 5 * C
                tl.store(base + cols, s0_, mask=cmask)
                tl.store(base + C + cols, s1, mask=cmask)
                tl.store(base + 2 * C + cols, s2, mask=cmask)
                tl.store(base + 3 * C + cols, s3, mask=cmask)
                tl.store(base + 4 * C + cols, s4, mask=cmask)

    @triton.jit(do_not_specialize=["P", "rows"])
    def _finish_backward(PART, W, NIN, NU, GW, GB, A, Bc, SCRATCH, FLAGS, TICKET, P, C, rate, rows,
                         MODE: tl.constexpr, CENTER: tl.constexpr, HAS_NU: tl.constexpr, BLOCK: tl.constexpr):
        """MODE: a Mode (contract.py): EXACT, the exact gradient's A and B (Eq. 3
        / Eq. 6); REFERENCE, the released code's nu update; else Algorithm 2's."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cm = cols < C
        z = tl.zeros([BLOCK], dtype=tl.float64)
        s0 = z
        s1 = z
        s2 = z
        s3 = z
        s4 = z
        for p in range(0, P):  # in a fixed order: the same result every run
            base = PART + p * 5 * C + cols
            s0 += tl.load(base, mask=cm, other=0.0).to(tl.float64)
            s1 += tl.load(base + C, mask=cm, other=0.0).to(tl.float64)
            s2 += tl.load(base + 2 * C, mask=cm, other=0.0).to(tl.float64)
            s3 += tl.load(base + 3 * C, mask=cm, other=0.0).to(tl.float64)
            s4 += tl.load(base + 4 * C, mask=cm, other=0.0).to(tl.float64)
        w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float64)
        tl.store(GW + cols, _cast(s0, GW), mask=cm)
        tl.store(GB + cols, _cast(s1, GB), mask=cm)
        n = tl.load(NIN).to(tl.float64)
        ns = tl.maximum(n, 1.0)
        if MODE == EXACT:  # means over the real tokens of sums over every position
            tl.store(Bc + cols, (w * s0 / ns).to(Bc.dtype.element_ty), mask=cm)
            if CENTER:
                tl.store(A + cols, (w * s1 / ns).to(A.dtype.element_ty), mask=cm)
        if HAS_NU:
            nu = tl.load(NU + cols, mask=cm, other=0.0).to(tl.float64)
            if MODE == REFERENCE:  # the released update: mean over every position of g' * xh, g' = g - (1 - a) nu xh
                new = tl.where(n > 0.0, nu + (w * s0 - rate * nu * s4) / rows, nu)
                tl.store(NU + cols, new.to(NU.dtype.element_ty), mask=cm)
            else:  # Algorithm 2: Lambda_t = mean(g xh), Gamma_t = mean(xh^2) over the real tokens
                lam = w * s2 / ns
                gam = s3 / ns
                new = nu * (1.0 - rate * gam) + rate * lam
                tl.store(SCRATCH + cols, new.to(SCRATCH.dtype.element_ty), mask=cm)
                finite = (lam == lam) & (tl.abs(lam) < float("inf")) & (gam == gam) & (gam < float("inf"))
                ok = tl.sum(tl.where(cm & ~finite, 1, 0), axis=0) == 0
                tl.store(FLAGS + tl.program_id(0), ok.to(tl.int32))
                if _last_to_arrive(TICKET):
                    # a gradient that overflowed (a float16 loss-scale overflow, whose
                    # step the optimizer skips) or a batch of padding leaves nu alone
                    if _all_set(FLAGS, tl.num_programs(0)) & (n > 0.0):
                        for c0 in range(0, C, BLOCK):
                            cc = c0 + tl.arange(0, BLOCK)
                            tl.store(NU + cc, tl.load(SCRATCH + cc, mask=cc < C), mask=cc < C)

    # The per-row kernels hold a row tile in registers; with WIDE, a row wider
    # than that (gpu.WIDEST_ROW) is walked twice in blocks of columns: once for
    # the row's sums, once to write (the second read finds the rows in cache).

    @triton.jit
    def _row_sum(X, XB, XST, XSB, Y, W, first, N, C, cols, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                 F64: tl.constexpr, HAS_W: tl.constexpr, SQUARE: tl.constexpr):
        """Per row of rows first .. first + BLOCK_N: the sum over every column
        of x * y (* w), y the (N, C) ``Y`` or, with SQUARE, x itself."""
        total = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + cols
            rows, rmask, m2, at, x = _row_tile(X, XB, XST, XSB, first, N, C, cc, cc < C, BLOCK_N, F64)
            y = x
            if not SQUARE:
                y = _f(tl.load(Y + at, mask=m2, other=0.0), F64)
            if HAS_W:
                y = y * _f(tl.load(W + cc, mask=cc < C, other=0.0), F64)[None, :]
            total += tl.sum(x * y, axis=1)
        return total

    @triton.jit
    def _sum_parts(PART, OUT, C, cols, BLOCK_C: tl.constexpr):
        """OUT[c] = the programs' partial sums PART[p, c], added in a fixed order in float64."""
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + cols
            acc = tl.load(PART + cc, mask=cc < C, other=0.0).to(tl.float64)
            for p in range(1, tl.num_programs(0)):
                acc += tl.load(PART + p * C + cc, mask=cc < C, other=0.0).to(tl.float64)
            tl.store(OUT + cc, _cast(acc, OUT), mask=cc < C)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _scalenorm_forward(X, S, Y, NORMS, N, C, XB, XST, XSB, per_prog, eps, F64: tl.constexpr, WIDE: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        cols = tl.arange(0, BLOCK_C)
        g = _f(tl.load(S), F64)
        if tl.program_id(0) == 0:  # the backward's arrival ticket, past the N norms
            tl.store(NORMS + N, 0.0)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            rows = start + r0 + tl.arange(0, BLOCK_N)
            if WIDE:
                ss = _row_sum(X, XB, XST, XSB, X, X, start + r0, N, C, cols, BLOCK_N, BLOCK_C, F64, False, True)
            else:
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cols < C, BLOCK_N, F64)
                ss = tl.sum(x * x, axis=1)
            norm = tl.maximum(tl.sqrt(ss), eps)
            tl.store(NORMS + rows, norm, mask=rows < N)
            for c0 in range(0, C if WIDE else 1, BLOCK_C):
                if WIDE:
                    _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, c0 + cols, c0 + cols < C,
                                                BLOCK_N, F64)
                tl.store(Y + at, (x * (g / norm)[:, None]).to(Y.dtype.element_ty), mask=m2)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _scalenorm_backward(X, NORMS, GY, S, GX, PART, GS, TICKET, N, C, XB, XST, XSB, per_prog, eps, F64: tl.constexpr,
                            WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        cols = tl.arange(0, BLOCK_C)
        g = _f(tl.load(S), F64)
        total = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            rows = start + r0 + tl.arange(0, BLOCK_N)
            rmask = rows < N
            norm = _f(tl.load(NORMS + rows, mask=rmask, other=1.0), F64)
            if WIDE:
                dot = _row_sum(X, XB, XST, XSB, GY, X, start + r0, N, C, cols, BLOCK_N, BLOCK_C, F64, False, False)
            else:
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cols < C, BLOCK_N, F64)
                gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                dot = tl.sum(gy * x, axis=1)
            total += tl.where(rmask, dot / norm, 0.0)
            k = tl.where(norm > eps, dot / (norm * norm), 0.0)
            for c0 in range(0, C if WIDE else 1, BLOCK_C):
                if WIDE:
                    _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, c0 + cols, c0 + cols < C,
                                                BLOCK_N, F64)
                    gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                gx = (g / norm)[:, None] * (gy - x * k[:, None])
                tl.store(GX + at, gx.to(GX.dtype.element_ty), mask=m2)
        tl.store(PART + tl.program_id(0), tl.sum(total, axis=0))
        if _last_to_arrive(TICKET):  # dL/dg: the programs' sums, in a fixed order
            _sum_parts(PART, GS, 1, tl.arange(0, 1), 1)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _rmsnorm_forward(X, W, Y, RSTD, N, C, XB, XST, XSB, per_prog, eps, F64: tl.constexpr, WIDE: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        cols = tl.arange(0, BLOCK_C)
        w = _f(tl.load(W + cols, mask=cols < C, other=0.0), F64)
        if tl.program_id(0) == 0:  # the backward's arrival ticket, past the N statistics
            tl.store(RSTD + N, 0.0)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            rows = start + r0 + tl.arange(0, BLOCK_N)
            if WIDE:
                ss = _row_sum(X, XB, XST, XSB, X, X, start + r0, N, C, cols, BLOCK_N, BLOCK_C, F64, False, True)
            else:
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cols < C, BLOCK_N, F64)
                ss = tl.sum(x * x, axis=1)
            r = _inv_rms(ss, C, eps)
            tl.store(RSTD + rows, r, mask=rows < N)
            for c0 in range(0, C if WIDE else 1, BLOCK_C):
                if WIDE:
                    _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, c0 + cols, c0 + cols < C,
                                                BLOCK_N, F64)
                    w = _f(tl.load(W + c0 + cols, mask=c0 + cols < C, other=0.0), F64)
                tl.store(Y + at, (x * r[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=m2)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _rmsnorm_backward(X, RSTD, GY, W, GX, PART, GW, TICKET, N, C, XB, XST, XSB, per_prog, F64: tl.constexpr,
                          WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        """dL/dw's per-program sums stay in registers, or with WIDE in the
        program's row of PART, added to block by block."""
        cols = tl.arange(0, BLOCK_C)
        part = PART + tl.program_id(0).to(tl.int64) * C
        w = _f(tl.load(W + cols, mask=cols < C, other=0.0), F64)
        gw = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
        if WIDE:
            for c0 in range(0, C, BLOCK_C):
                tl.store(part + c0 + cols, gw, mask=c0 + cols < C)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            rows = start + r0 + tl.arange(0, BLOCK_N)
            r = _f(tl.load(RSTD + rows, mask=rows < N, other=0.0), F64)
            if WIDE:
                dot = _row_sum(X, XB, XST, XSB, GY, W, start + r0, N, C, cols, BLOCK_N, BLOCK_C, F64, True,
                               False) * r / C
            else:
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cols < C, BLOCK_N, F64)
                gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                dot = tl.sum(gy * w[None, :] * x * r[:, None], axis=1) / C
            for c0 in range(0, C if WIDE else 1, BLOCK_C):
                if WIDE:
                    cc = c0 + cols
                    _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cc, cc < C, BLOCK_N, F64)
                    gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                    w = _f(tl.load(W + cc, mask=cc < C, other=0.0), F64)
                xr = x * r[:, None]
                g = gy * w[None, :]
                gx = r[:, None] * (g - xr * dot[:, None])
                tl.store(GX + at, gx.to(GX.dtype.element_ty), mask=m2)
                if WIDE:  # one program reads back what it wrote: a barrier orders it
                    tl.store(part + cc, tl.load(part + cc, mask=cc < C, other=0.0) + tl.sum(gy * xr, axis=0),
                             mask=cc < C)
                    tl.debug_barrier()
                else:
                    gw += tl.sum(gy * xr, axis=0)
        if not WIDE:
            tl.store(part + cols, gw, mask=cols < C)
        if _last_to_arrive(TICKET):  # dL/dw: the programs' sums, in a fixed order
            _sum_parts(PART, GW, C, cols, BLOCK_C)

    @triton.jit
    def _tanh(u):
        """tanh(u) from exp alone (the interpreter has no libdevice): sign(u) (1 - e) / (1 + e), e = exp(-2|u|),
        which cannot overflow; below |u| = 1/16, where 1 - e would cancel, its odd series to u^9 (within a
        float64 rounding there), its coefficients as integer ratios that round in u's own dtype."""
        au = tl.abs(u)
        e = tl.exp(-2.0 * au)
        u2 = u * u
        near = au * (1 - u2 / 3 * (1 - u2 * 2 / 5 * (1 - u2 * 17 / 42 * (1 - u2 * 62 / 153))))
        t = tl.where(au < 0.0625, near, (1.0 - e) / (1.0 + e))
        return tl.where(u < 0, -t, t)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _dyt_forward(X, ALPHA, W, B, Y, TICKET, N, C, XB, XST, XSB, per_prog, F64: tl.constexpr, WIDE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        """y = w tanh(alpha x) + b per entry (Zhu et al., 2025, Eq. 1), a wide row in blocks of columns;
        program 0 sets the backward's arrival ticket to 0."""
        cols = tl.arange(0, BLOCK_C)
        a = _f(tl.load(ALPHA), F64)
        if tl.program_id(0) == 0:
            tl.store(TICKET, 0.0)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            for c0 in range(0, C, BLOCK_C):
                cc = c0 + cols
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cc, cc < C, BLOCK_N, F64)
                w = _f(tl.load(W + cc, mask=cc < C, other=0.0), F64)
                b = _f(tl.load(B + cc, mask=cc < C, other=0.0), F64)
                tl.store(Y + at, (_tanh(a * x) * w[None, :] + b[None, :]).to(Y.dtype.element_ty), mask=m2)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _dyt_backward(X, GY, ALPHA, W, GX, GA, GW, GB, PART, TICKET, N, C, XB, XST, XSB, per_prog,
                      F64: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        """dL/dx = alpha d, d = dy w (1 - t^2), t = tanh(alpha x). Each program's sums go to PART: dy t
        (dL/dw) in its row of a (P, C) block, dy (dL/db) in a second, d x (dL/dalpha) in a (P,) one; in
        registers, or with WIDE in PART itself, added to block by block (as _rmsnorm_backward's)."""
        cols = tl.arange(0, BLOCK_C)
        P = tl.num_programs(0)
        pid = tl.program_id(0).to(tl.int64)
        pw, pb = PART + pid * C, PART + (P + pid) * C
        a = _f(tl.load(ALPHA), F64)
        gw = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
        gb = gw
        ga = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
        if WIDE:
            for c0 in range(0, C, BLOCK_C):
                tl.store(pw + c0 + cols, gw, mask=c0 + cols < C)
                tl.store(pb + c0 + cols, gw, mask=c0 + cols < C)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            for c0 in range(0, C, BLOCK_C):
                cc = c0 + cols
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cc, cc < C, BLOCK_N, F64)
                gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                w = _f(tl.load(W + cc, mask=cc < C, other=0.0), F64)
                t = _tanh(a * x)
                d = gy * w[None, :] * (1 - t * t)
                tl.store(GX + at, (a * d).to(GX.dtype.element_ty), mask=m2)
                ga += tl.sum(d * x, axis=1)
                if WIDE:  # one program reads back what it wrote: a barrier orders it
                    tl.store(pw + cc, tl.load(pw + cc, mask=cc < C, other=0.0) + tl.sum(gy * t, axis=0), mask=cc < C)
                    tl.store(pb + cc, tl.load(pb + cc, mask=cc < C, other=0.0) + tl.sum(gy, axis=0), mask=cc < C)
                    tl.debug_barrier()
                else:
                    gw += tl.sum(gy * t, axis=0)
                    gb += tl.sum(gy, axis=0)
        if not WIDE:
            tl.store(pw + cols, gw, mask=cols < C)
            tl.store(pb + cols, gb, mask=cols < C)
        tl.store(PART + 2 * P * C + pid, tl.sum(ga, axis=0))
        if _last_to_arrive(TICKET):  # the programs' sums, in a fixed order
            _sum_parts(PART, GW, C, cols, BLOCK_C)
            _sum_parts(PART + P * C, GB, C, cols, BLOCK_C)
            _sum_parts(PART + 2 * P * C, GA, 1, tl.arange(0, 1), 1)


contract.check(sys.modules[__name__], "triton")
