"""The Triton path's plans, the one home of their arithmetic and constants:
how each launch spreads a pass over a GPU.

A channel norm's kernel runs on a grid of (row ranges, column chunks): as
many row programs as the multiprocessors hold at once (``PROGRAMS_PER_SM``,
whose registers bound each variant's), and more only past ``MAX_ROWS`` rows
each; a chunk is one group of the released code's group scaling when that is
on. A per-row kernel's grid is its row ranges. The passes (``csrc/gpu_passes.h``)
ask for a plan once per kernel and input layout (``channel_for_node``,
``row_for_node``, ``finish_for_node``) and replay it after; the ops' fake
implementations (``ops.py``, torch.compile) read the shapes of what a pass
returns from here too (``parts``).
"""

import functools
import os

import torch

#: whether Triton's interpreter runs the kernels, read when this module (and so its kernels) is imported,
#: as ``triton.jit`` reads it for each kernel then
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    return _INTERPRETING


#: the multiprocessors of a stand-in device (measure/standin.py), or None: CPU tensors then launch through
#: Triton's CUDA launcher on a stand-in driver, which records each launch and runs nothing
_STAND_IN = None


def stand_in(multiprocessors) -> None:
    """Take CPU tensors as a device with ``multiprocessors`` would (None: as before); the passes ask
    their plans anew."""
    global _STAND_IN
    _STAND_IN = multiprocessors
    forget()


def forget() -> None:
    """Have the passes ask every plan anew (what one reads changed)."""
    for call in _FORGET:
        call()


_FORGET = []  # what to call when the plans change: the passes' cache (gpu.bind_node)


def stand_in_size():
    """The stand-in device's multiprocessors, or None (no stand-in)."""
    return _STAND_IN


#: resident programs per multiprocessor that each kernel's grid launches (float64,
#: which only the tests run, half as many): each launch bounds its registers to
#: what this allows (``registers``, ptxas's .maxnreg), and every variant compiled
#: for sm_90 spills nothing within it (measure/sm90.py, checked in CI)
PROGRAMS_PER_SM = 4
WARPS = 8  # of every kernel
REGISTERS_PER_SM, WARP = 65536, 32
#: elements of a tile (rows x columns) of a channel kernel and of a per-row one
TILE, ROW_TILE = 512, 1024
#: the widest group (channel kernels) and row (per-row kernels) held in registers
#: whole; a wider one is walked in sub-chunks of this many columns (``WIDE``)
WIDEST_GROUP, WIDEST_ROW, SUB_CHUNK = 512, 1024, 256
#: rows a program sums at most, in float32 tile by tile: a longer input gets more programs
#: (a grid of several waves), and the finishing kernels add the programs' sums in float64
MAX_ROWS = 1024


def programs_per_sm(kernel: str, float64: bool = False) -> int:
    """Of every kernel, as yet (``kernel``: where one needs another count)."""
    return max(1, PROGRAMS_PER_SM // 2) if float64 else PROGRAMS_PER_SM


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
    # the forward's statistics pass (it writes nothing row-sized) holds fewer live
    # tiles and takes them twice as tall (some shorter ones spill on sm_90), but for a wide group's blocks
    block_n = max(1, min(32, (2 if tall and block_c >= cw else 1) * TILE // block_c))
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


FINISH_BLOCK = 64  # columns per program of the finishing kernels
SUM_ROWS = 8  # rows of per-program sums a finishing program adds at a time


def channel_for_node(kernel: str, x, mask, groups: int, tall: bool) -> tuple:
    """The plan of channel ``kernel`` over the rows of x (unit column stride) with padding ``mask`` (None:
    none) as the passes replay it: (N, C, row programs, column chunks, the launch's integers after its
    tensors (N, C, x's row geometry, the mask's (B, T), rows per program, the chunk's width), the common
    constexprs (HAS_MASK, GROUPED, F64, WIDE, BLOCK_N, BLOCK_C, CW, num_warps, maxnreg)). A group wider than
    ``WIDEST_GROUP`` is one chunk walked in blocks of ``SUB_CHUNK`` columns (``WIDE``), its width given at
    run time (``CW`` 0), so that one variant serves every wide group."""
    _, N, C, geometry = _rows(x)
    cw, block_c, chunks, block_n, per_prog, progs = _layout(x, groups, kernel, tall)
    f64, wide = x.dtype == torch.float64, block_c < cw
    nb, nt = (1, 1) if mask is None else (mask.size(0), mask.size(1))
    return (N, C, progs, chunks, (N, C, *geometry, nb, nt, per_prog, cw),
            (mask is not None, groups > 0, f64, wide, block_n, block_c, 0 if wide else cw, WARPS,
             registers(kernel, f64)))


def row_for_node(kernel: str, x) -> tuple:
    """The plan of per-row ``kernel`` over the rows of x as the passes replay it: (N, C, programs, the
    launch's integers (N, C, x's row geometry, rows per program), its constexprs (F64, WIDE, BLOCK_N,
    BLOCK_C, num_warps, maxnreg), whether a backward's last program adds the programs' parameter sums
    itself (:func:`sums_here`))."""
    _, N, C, geometry = _rows(x)
    block_c, block_n, per_prog, progs = _row_layout(x, kernel)
    f64 = x.dtype == torch.float64
    return (N, C, progs, (N, C, *geometry, per_prog),
            (f64, block_c < C, block_n, block_c, WARPS, registers(kernel, f64)), sums_here(progs, per_prog))


def sums_here(progs: int, per_prog: int) -> bool:
    """Whether a row backward's last program adds the programs' parameter sums itself: where those (P x C)
    are at most what each program moves (3 x its rows x C), so that it does at most twice the mean's
    work; else a launch of their own does, over channel blocks (``_sum_columns``)."""
    return progs <= 3 * per_prog


def finish_for_node(kernel: str, f64: bool) -> tuple:
    """A finishing kernel's plan: (columns per program, its constexprs BLOCK_R, BLOCK, num_warps, maxnreg)."""
    return FINISH_BLOCK, (SUM_ROWS, FINISH_BLOCK, WARPS, registers(kernel, f64))

