"""What a norm step costs the host, measured on the CPU.

A GPU norm step of a small or mid-sized layer is host time: Python between
the kernels and the launches' own binding. Both are measured here without a
GPU. The Triton path runs under Triton's interpreter with every launch
replaced by nothing (:func:`no_launches`), so what remains is the host code
that would drive a GPU; the CPU backend runs as it is. Each step is one
forward + backward of a layer in training mode at 4 x 4 x 64 (T x B x C),
one sequence padded by a token, beside ``nn.LayerNorm``'s step in the same
harness:

* ``calls``: the Python-level calls of one step, the ``call`` and
  ``c_call`` events of ``sys.setprofile`` (Python functions, and builtins
  or C functions called from Python). Deterministic: a test can hold them.
* ``time``: the median over 20 interleaved rounds (LN, kind, kind, LN) of a
  step's wall time, as a ratio to ``nn.LayerNorm``'s in the same round, and
  the least of those ratios (``bench/run.py --sections host``).
"""

import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

import torch

SHAPE = (4, 4, 64)


def _launch(*args, **kwargs):
    return None


@contextmanager
def no_launches():
    """Every Triton kernel launch under the interpreter, ``kernel[grid](...)``,
    is one call of a function that does nothing (its outputs keep whatever
    memory they were given): neither the interpreter's nor a GPU launcher's
    own work is counted, only the host code around the launches."""
    from triton.runtime import interpreter

    getitem = interpreter.InterpretedFunction.__getitem__
    interpreter.InterpretedFunction.__getitem__ = lambda self, grid: _launch
    try:
        yield
    finally:
        interpreter.InterpretedFunction.__getitem__ = getitem


def python_calls(fn) -> int:
    """The ``call`` and ``c_call`` events of one call of ``fn()``."""
    count = [0]

    def profile(frame, event, arg):
        if event == "call" or event == "c_call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def step(kind: str, shape=SHAPE, seed: int = 0):
    """One training forward + backward of a ``kind`` layer (``nn.LayerNorm``
    for "nn.LayerNorm"), as a function of nothing; its input is made once."""
    from ..norms import build_norm

    T, B, C = shape
    g = torch.Generator().manual_seed(seed)
    x0, dy = torch.randn(T, B, C, generator=g), torch.randn(T, B, C, generator=g)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -1] = True
    if kind == "nn.LayerNorm":
        module = torch.nn.LayerNorm(C)
        layer = lambda x: module(x)  # noqa: E731
    else:
        module = build_norm(kind, C).train()
        layer = lambda x: module(x, pad)  # noqa: E731

    def run():
        x = x0.detach().requires_grad_(True)
        layer(x).backward(dy)

    return run


def measure(kinds, backend: str, rounds: int = 20, reps: int = 40, shape=SHAPE, block: int = 10):
    """{kind: (calls, median time / nn.LayerNorm's, least)} on ``backend``,
    with ``nn.LayerNorm``'s own row (calls, 1.0, 1.0) first (:func:`measure_with`)."""
    from ..norms import kernels

    with kernels.use(backend), (no_launches() if backend == "triton" else nullcontext()):
        return measure_with(["nn.LayerNorm", *kinds], kinds, shape, rounds, reps, block=block)


def measure_with(names, kinds, shape, rounds=20, reps=40, block=10):
    """:func:`measure`'s rows on the backend the caller set. Each round times
    each kind against ``nn.LayerNorm`` in blocks of ``block`` steps in the
    order LN, kind, kind, LN (``reps`` steps of each a round), so that a drift
    of the machine within the round weighs on both alike; a kind's ratio is
    the median over the rounds, beside the least (a kind timed apart from its
    baseline took 0.4-1.7x of it from run to run on a shared 2-core machine;
    the least of a few rounds is biased low there). One torch thread: at this
    size the intra-op pool's wake-ups are not the host's work, and with two
    threads they moved LayerNorm's own step by 2x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(names, kinds, shape, rounds, reps, block)
    finally:
        torch.set_num_threads(threads)


def _measure(names, kinds, shape, rounds, reps, block):
    steps = {name: step(name, shape) for name in names}
    for run in steps.values():
        for _ in range(3):  # the first calls build caches and kernels
            run()
    calls = {name: python_calls(run) for name, run in steps.items()}
    ratios = {name: [] for name in kinds}
    order = ("nn.LayerNorm", None, None, "nn.LayerNorm")  # None: the kind
    for _ in range(rounds):
        for name in kinds:
            spent = {name: 0.0, "nn.LayerNorm": 0.0}
            for _ in range(max(1, reps // (2 * block))):
                for timed in order:
                    timed = timed or name
                    run, start = steps[timed], time.perf_counter()
                    for _ in range(block):
                        run()
                    spent[timed] += time.perf_counter() - start
            ratios[name].append(spent[name] / spent["nn.LayerNorm"])
    out = {"nn.LayerNorm": (calls["nn.LayerNorm"], 1.0, 1.0)}
    out.update({name: (calls[name], statistics.median(ratios[name]), min(ratios[name])) for name in kinds})
    return out
