"""Every backend entry point (``contract.py``) as a PyTorch op, ``torch.ops.powernorm.<name>``.

torch.compile cannot trace into a C++ extension or a Triton launch, and would
break its graph at each; as ops with fake-tensor implementations (the shapes
and dtypes of their outputs) they go into the graph whole. The first argument
names the backend (``cpu`` or ``triton``); absent tensors are empty ones. The
autograd of the norms is ``functions.py``'s, which calls these ops through
:data:`CALLS`.
"""

import operator
from types import SimpleNamespace

import torch
from torch import Tensor

from .. import clock
from . import contract
from .contract import CONTRACT, Mode, Update, schema

IMPLEMENTATIONS = {}  # name -> the op's Python implementation (measure/launches.py sees through the op)
#: ``CALLS.<name>(impl=..., <the contract's arguments by keyword>)``: each op as the norms call it (:func:`_caller`)
CALLS = SimpleNamespace()


def implementation(func):
    """The Python implementation behind ``func``, an overload of torch.ops.powernorm.<name>."""
    return IMPLEMENTATIONS[func._schema.name.split("::", 1)[-1]]


def backend(name: str):
    if not _BACKENDS:  # kernels/__init__.py imports this module: its table is read on first use
        from . import _MODULES

        _BACKENDS.update(_MODULES)
    return _BACKENDS[name]


_BACKENDS = {}


#: ops defined through a Library: a call costs what a built-in op's does (torch.library.custom_op's
#: Python wrapper added some 75 us to each, more than a CPU kernel of a small layer takes)
_LIBRARY = torch.library.Library("powernorm", "DEF")


def _stat(like: Tensor) -> torch.dtype:
    return torch.float64 if like.dtype == torch.float64 else torch.float32


def _rows(x: Tensor) -> Tensor:
    """An (N, C) tensor like x, (N, C) or (T, B, C): what the kernels write."""
    return x.new_empty(x.numel() // x.size(-1), x.size(-1))


# The fakes: each output's shape and dtype, from the arguments they depend on (by name)

def _fake_forward(k, x, groups, want_y, want_stats, **_):
    P, dtype = k.parts(x, groups, "_channel_forward", not want_y)
    return (_rows(x) if want_y else x.new_empty(0),
            x.new_empty(x.numel() // x.size(-1), groups, dtype=_stat(x)) if groups > 0 else x.new_empty(0),
            x.new_empty(P, 3, x.size(-1), dtype=dtype) if want_stats else x.new_empty(0))


def _fake_finish_stats(k, part, second_buf, update, **_):
    C, sd = part.size(-1), second_buf.dtype
    return (part.new_empty(C if update == Update.BN else 0, dtype=sd), part.new_empty(C, dtype=sd),
            part.new_empty(C, dtype=sd), part.new_empty(1, dtype=torch.float64))


def _fake_backward(k, x, groups, want_gx, want_sums, **_):
    P, dtype = k.parts(x, groups, "_channel_backward", False)
    return (_rows(x) if want_gx else x.new_empty(0),
            x.new_empty(P, 5, x.size(-1), dtype=dtype) if want_sums else x.new_empty(0))


def _fake_finish_backward(k, part, weight, nu, kind, center, **_):
    C = part.size(-1)
    sd = nu.dtype if nu.numel() else _stat(weight)
    exact = kind == Mode.EXACT
    return (torch.empty_like(weight), torch.empty_like(weight),
            part.new_empty(C if exact and center else 0, dtype=sd), part.new_empty(C if exact else 0, dtype=sd))


def _fake_row_forward(k, kind, x, **_):
    per_row = x.numel() // x.size(-1) if contract.ROW_KINDS[kind].per_row else 0
    return _rows(x), x.new_empty(per_row + k.ROW_TICKET, dtype=_stat(x))


def _fake_row_backward(k, x, params, **_):
    return [_rows(x), *(torch.empty_like(p) for p in params)]


_FAKES = dict(forward=_fake_forward, finish_stats=_fake_finish_stats, backward=_fake_backward,
              finish_backward=_fake_finish_backward, row_forward=_fake_row_forward, row_backward=_fake_row_backward)


def _define(name: str):
    """``torch.ops.powernorm.<name>(impl, <the contract's arguments>)``: the
    entry point of backend ``impl``. ``finish_stats`` takes one more,
    ``clock``: the key of PN's warmup clock (``norms/clock.py``) to advance
    once the running statistics are committed, or -1."""
    names = CONTRACT[name]
    steps = names.index("steps") if name == "finish_stats" else None  # and the clock after the contract's

    listed = isinstance(contract.SCHEMAS[name][1], str)  # Tensor[]: a list, as the op returns it

    def run(impl, *args):  # the dispatcher passes every argument in the schema's order
        out = getattr(backend(impl), name)(*args[:len(names)])
        out = list(out) if listed else tuple(out)
        if steps is not None:
            clock.advance(args[-1], args[steps])
        return out

    def fake(impl, *args):
        return _FAKES[name](backend(impl), **dict(zip(names, args)))

    run.__name__ = name
    IMPLEMENTATIONS[name] = run
    _LIBRARY.define(name + schema(name, "str impl, ", ", int clock" if steps is not None else ""))
    _LIBRARY.impl(name, run, "CompositeExplicitAutograd")
    torch.library.register_fake(f"powernorm::{name}", fake, lib=_LIBRARY)
    setattr(CALLS, name, _caller(name, run, names + (("clock",) if steps is not None else ())))


#: the types of the arguments of a call nothing observes: plain tensors and parameters, the
#: contract's scalars and None (a tensor subclass, or anything else, takes the op's way)
_PLAIN_TYPES = frozenset((Tensor, torch.nn.Parameter, bool, int, float, str, Update, Mode, type(None)))


def observed(values) -> bool:
    """Whether something may watch or transform the ops a call with arguments
    ``values`` dispatches: torch.compile and torch.export, a dispatch or
    function mode (FakeTensor, functionalization, FlopCounterMode, the launch
    counter), functorch, the JIT tracer, the profiler, or a tensor subclass
    among the arguments."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active()
            or torch._C._is_tracing() or torch._C._autograd._profiler_enabled()  # torch.jit.is_tracing's own test
            or not _plain(values))


def _plain(values) -> bool:
    """Whether every value is of a plain type, or a list of them (a row kind's parameters)."""
    return _PLAIN_TYPES.issuperset(map(type, values)) or all(
        type(v) in _PLAIN_TYPES or (type(v) in (list, tuple) and _PLAIN_TYPES.issuperset(map(type, v)))
        for v in values)


def _caller(name: str, run, order: tuple):
    """Op ``name`` called by keyword. Where nothing observes the call, its
    implementation ``run`` is called at once, with the arguments in the
    schema's ``order``: the dispatcher's round trip into a Python op costs
    about 30 us a call on a CPU (more than a small layer's kernel) and does
    nothing else there. Otherwise the call is the op's."""
    op = getattr(torch.ops.powernorm, name)
    in_order = operator.itemgetter(*order)

    def call(impl: str, **args):
        if observed(args.values()):
            return op(impl=impl, **args)
        return run(impl, *in_order(args))

    call.__name__ = name
    return call


for _name in CONTRACT:
    _define(_name)
