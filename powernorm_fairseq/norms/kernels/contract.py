"""The one interface every kernel backend implements: its functions and their
arguments, by name and in order.

``ops.py`` calls the backends with these names as keywords; the GPU
backend's Python functions (``gpu.py``) and the compiled CPU module
(``csrc/norms.cpp``, whose pybind11 definitions name each argument) are
checked against them when they load, so a backend that drifts from the
contract fails at once, naming the function and both argument lists.

Tensors that an entry point may go without are passed as empty tensors, not
None, and come back as empty tensors: ``ops.py`` registers every entry point
as a PyTorch op, and ops take and give tensors.
"""

import re
from enum import IntEnum
from typing import Callable, NamedTuple, Optional

import torch


class _Enumeration(IntEnum):
    """An enumeration of the contract: an unknown value is refused in one line naming the allowed ones."""

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"unknown {cls.__name__.lower()} {value!r} (contract.py's {cls.__name__}: "
                         f"0 to {len(cls) - 1})")


class Update(_Enumeration):
    """How ``finish_stats`` updates the running statistics: BN's mean and
    unbiased variance (EMA), PN-V's psi^2 (EMA), PN's psi^2 as a cumulative
    mean in its warmup and Algorithm 2's EMA after, and the released PN's (a
    cumulative mean that stops a step before its warmup, an EMA on top)."""

    BN = 0
    PN_V = 1
    PN_WARM = 2
    PN = 3
    REFERENCE_WARM = 4
    REFERENCE = 5

    @property
    def running_scale(self) -> bool:
        """Whether the forward normalises with the running psi^2_{t-1}."""
        return self in (Update.PN, Update.REFERENCE)


#: the updates whose forward normalises with the running psi^2_{t-1} (a set: a property is a call)
RUNNING_SCALE = frozenset(u for u in Update if u.running_scale)


class Mode(_Enumeration):
    """Which backward (``functions.py``): the exact gradient (Eq. 3 / Eq. 6),
    Algorithm 2's, the released code's, or statistics that are constants of
    the gradient (the causal mode's running ones; nu still follows Algorithm 2)."""

    EXACT = 0
    PAPER = 1
    REFERENCE = 2
    FIXED = 3


class RowKind(NamedTuple):
    """A per-row or per-entry kind as every backend takes it, the one
    description each kind's module gives (:func:`row_kind`): its ``name``
    (the compiled module's row kinds, csrc/cpu_rows.h, by name), its
    parameters' names in order (the backward reads at most the first three),
    whether its statistic has one value per row, its two passes in PyTorch
    ops (the plain backend's: ``forward(x, *params, eps)`` -> (y, statistic),
    ``backward(x, statistic, grad_y, *params, eps)`` -> [dL/dx, one gradient
    per parameter]), the gradients of a backward that builds a graph
    (``twice(x, grad_y, *params)``; None: first derivatives only) and the
    name of its gain, which every backend reads as gain + ``w_offset``
    (a unit-offset gain's 1 + gamma)."""

    name: str
    params: tuple
    per_row: bool
    forward: Callable
    backward: Callable
    twice: Optional[Callable] = None
    gain: str = "weight"

    def shifted(self, params, w_offset: float) -> tuple:
        """``params`` with the gain read as gain + ``w_offset``, at least in float32 (a half gain near 1 would
        round away the small gamma the offset stores): PyTorch ops, the plain backend's."""
        if not w_offset:
            return tuple(params)
        at = self.params.index(self.gain)
        return tuple(p.to(torch.promote_types(p.dtype, torch.float32)) + w_offset if i == at else p
                     for i, p in enumerate(params))


#: name -> RowKind: the per-row and per-entry kinds, each registered by its module
ROW_KINDS = {}


def row_kind(kind: RowKind) -> RowKind:
    """Register ``kind`` by its name and return it."""
    ROW_KINDS[kind.name] = kind
    return kind


#: name -> (arguments, results), in the schema language of PyTorch's ops; ``Tensor(a!)`` is updated in place
SCHEMAS = {
    # y = (xs - mean) * inv * weight + bias over the rows, xs the row after the
    # optional group scaling (groups > 0, eps gs_eps); inv_eps >= 0: inv holds
    # a running second moment and the scale is 1 / sqrt(inv + inv_eps). mask:
    # the (B, T) padding mask, rows r = t * B + b. With want_stats, per-program
    # statistics of the real rows, part (P, 3, C): count, then (center) mean
    # and sum of squared deviations from it, or 0 and the sum of xs^2.
    # Returns (y, group scales (N, groups), part), each empty where not asked.
    # Every gain is read as weight + w_offset (1 for a unit-offset gain, --norm-unit-offset; else 0).
    "forward": ("Tensor x, Tensor mask, int groups, float gs_eps, Tensor mean, Tensor inv, float inv_eps, "
                "Tensor weight, float w_offset, Tensor bias, bool want_y, bool want_stats, bool center", 3),
    # the batch's statistics from forward's part and the running statistics'
    # update (an Update), in a fixed order; steps counts PN's steps.
    # Returns (mean (bn) or empty, inv for the forward, inv of the batch, n (1,) float64).
    "finish_stats": ("Tensor part, Tensor(a!) mean_buf, Tensor(b!) second_buf, Tensor(c!) steps, int update, "
                     "float momentum, float eps, int warmup", 4),
    # dL/dxs = (g - m * (A + b_scale * B * xh)) * inv_bwd, g = grad_y * (weight + w_offset),
    # back through the group scaling; m = 1 at real rows, and at padding too
    # when correct_pads (the released code's backward). With want_sums,
    # per-program sums part (P, 5, C): dy*xh and dy over every row, dy*xh and
    # xh^2 over the real rows, xh^2 over every row. Returns (dL/dx, part).
    "backward": ("Tensor x, Tensor mask, Tensor scale, Tensor grad_y, Tensor weight, float w_offset, Tensor mean, "
                 "Tensor inv_fwd, Tensor inv_bwd, Tensor A, Tensor B, float b_scale, int groups, bool correct_pads, "
                 "bool want_gx, bool want_sums", 2),
    # from backward's part: the weight and bias gradients, A and B of the exact
    # gradient (kind EXACT, a Mode), and nu's update (Algorithm 2; the released
    # code's under REFERENCE). rows: N, a SymInt: under torch.compile a sequence length that varies from batch
    # to batch stays symbolic (an int would guard each graph on one length). Returns (grad_weight, grad_bias,
    # A or empty, B or empty).
    "finish_backward": ("Tensor part, Tensor weight, float w_offset, Tensor n, Tensor(a!) nu, float rate, int kind, "
                        "bool center, SymInt rows", 4),
    # a per-row or per-entry kind (a RowKind, by name) over the rows with its parameters (in the order its
    # descriptor names them), its gain (RowKind.gain) read as gain + w_offset: returns (y, the statistic its
    # backward reads: one value per row and the GPU kernels' arrival ticket past them, or the ticket alone
    # where it has none per row)
    "row_forward": ("str kind, Tensor x, Tensor[] params, float w_offset, float eps", 2),
    # returns [dL/dx, one gradient per parameter]
    "row_backward": ("str kind, Tensor x, Tensor stat, Tensor grad_y, Tensor[] params, float w_offset, float eps",
                     "Tensor[]"),
}
#: name -> its argument names, in order: what every backend's function takes
CONTRACT = {name: tuple(arg.split()[-1] for arg in args.split(", ")) for name, (args, _) in SCHEMAS.items()}


def schema(name: str, before: str = "", after: str = "") -> str:
    """The op schema of entry point ``name``, with arguments ``before`` and ``after`` its own."""
    args, results = SCHEMAS[name]
    return f"({before}{args}{after}) -> " + (results if isinstance(results, str) else
                                            f"({', '.join(['Tensor'] * results)})")


def argument_names(function) -> tuple:
    """The argument names of a Python function, or of a pybind11 function
    from the signature its docstring opens with."""
    code = getattr(function, "__code__", None)
    if code is not None:
        return code.co_varnames[:code.co_argcount]
    return tuple(name for name, _ in _pybind_arguments(function))


def _pybind_arguments(function) -> tuple:
    """((name, type), ...) from the signature a pybind11 function's docstring opens with."""
    match = re.match(r"\w+\((.*?)\)\s*->", (function.__doc__ or "").strip())
    if match is None:
        return ()
    return tuple(tuple(part.strip() for part in arg.split(":", 1)) for arg in re.split(r",\s*", match.group(1)))


def _schema_type(pybind: str) -> str:
    """The schema's name of a type as pybind11 writes it ("torch.Tensor",
    "int", or "typing.SupportsInt | typing.SupportsIndex" in newer releases;
    "list[torch.Tensor]", or "collections.abc.Sequence[torch.Tensor]")."""
    for word, name in (("list[", "Tensor[]"), ("Sequence[", "Tensor[]"), ("Tensor", "Tensor"), ("str", "str"),
                       ("bool", "bool"), ("Int", "int"), ("int", "int"), ("Float", "float"), ("float", "float")):
        if word in pybind:
            return name
    return pybind


def check(module, name: str) -> None:
    """Raise TypeError unless ``module`` defines every entry point with the
    contract's argument names in its order (and, compiled, their types)."""
    for function, wanted in CONTRACT.items():
        have = argument_names(getattr(module, function, None)) if hasattr(module, function) else None
        if have != wanted:
            raise TypeError(f"the {name} kernels' {function} takes {have}, the contract "
                            f"(norms/kernels/contract.py) says {wanted}")
        typed = tuple(_schema_type(t) for _, t in _pybind_arguments(getattr(module, function)))
        types = tuple(arg.split()[0].split("(")[0].replace("SymInt", "int") for arg in SCHEMAS[function][0].split(", "))
        if typed and typed != types:
            raise TypeError(f"the {name} kernels' {function} takes types {typed}, the contract "
                            f"(norms/kernels/contract.py) says {types}")
