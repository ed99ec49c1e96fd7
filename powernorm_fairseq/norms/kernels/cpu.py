"""The CPU backend: C++ kernels (``csrc/``, one translation unit,
``norms.cpp``), in the compiled module (``compiled.py`` builds and loads it).
Where no compiler is present the norms run their plain PyTorch path instead,
and the dispatch (``kernels/__init__.py``) says so.
"""

import torch

from . import compiled, contract

NAME = "cpu"
DTYPES = (torch.bfloat16, torch.float32, torch.float64)  # float16 inputs are upcast by the caller


def available() -> bool:
    return compiled.load() is not None


def failure_reason():
    return compiled.failure


# a constant to torch.compile: traced, the load runs at once (it reads files). What
# torch.compiler.assume_constant_result(available) sets, without importing dynamo
# (seconds) in every process that imports the norms
available._dynamo_marked_constant = True


def takes(x: torch.Tensor) -> bool:
    return x.is_cpu


TICKET_ROWS, ROW_TICKET = 0, 0  # the GPU kernels' arrival tickets (gpu.py); none here


def parts(x, groups, kernel, tall):
    """(rows, dtype) of the per-program statistics: the threads' sums come back added."""
    return 1, torch.float64


def _entry_point(name):
    def call(*args):  # in the contract's order, which load() checked the compiled module against
        return tuple(getattr(compiled.load(), name)(*args))
    call.__name__ = call.__qualname__ = name
    return call


# The backend interface (contract.py) is the compiled module's own: the C++
# kernels make the passes over the rows and the small per-channel epilogues.
globals().update({name: _entry_point(name) for name in contract.CONTRACT})
