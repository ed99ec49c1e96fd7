"""The CPU backend: C++ kernels (``csrc/norms.cpp``), compiled on first use.

They are built with torch's C++ extension loader and cached, so only the first
process on a machine pays the compile (about a minute). Where no compiler is
present the norms run their plain PyTorch path instead, and the dispatch
(``kernels/__init__.py``) says so.
"""

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

NAME = "cpu"
DTYPES = (torch.float32, torch.float64)  # half inputs are upcast by the caller

_SOURCE = Path(__file__).parent / "csrc" / "norms.cpp"
_module = None
failure = None  # why the kernels could not be built, once tried


def load():
    """The compiled module, or None (``failure`` says why) when it cannot be built."""
    global _module, failure
    if _module is not None or failure is not None:
        return _module
    try:
        from torch.utils.cpp_extension import load as load_extension

        with _venv_tools_on_path():
            _module = load_extension(
                name="powernorm_fairseq_kernels",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as err:  # no compiler, no ninja, a build error: the caller falls back, loudly
        text = str(err).strip()
        failure = f"{type(err).__name__}: {text.splitlines()[-1] if text else err}"
    return _module


@contextmanager
def _venv_tools_on_path():
    """The build calls `ninja` by name: find the one installed beside this
    interpreter (requirements.txt) even when the environment is not activated."""
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def available() -> bool:
    return load() is not None


def takes(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


# The backend interface (the same in gpu.py); the math is in functions.py.
def forward(x, keep, groups, gs_eps, mean, inv, weight, bias, want_y, want_stats):
    return load().forward(x, keep, groups, gs_eps, mean, inv, weight.to(x.dtype), bias.to(x.dtype),
                          want_y, want_stats)


def backward(x, keep, scale, grad_y, weight, mean, inv_fwd, inv_bwd, A, B, groups, correct_pads, want_gx,
             want_sums):
    cast = (lambda t: t.to(x.dtype) if t.numel() else t)
    return load().backward(x, keep, scale, grad_y, weight.to(x.dtype), mean, cast(inv_fwd), cast(inv_bwd),
                           cast(A), cast(B), groups, correct_pads, want_gx, want_sums)


def scalenorm_forward(x, scale, eps):
    return load().scalenorm_forward(x, float(scale), eps)


def scalenorm_backward(x, norms, grad_y, scale, eps):
    return load().scalenorm_backward(x, norms, grad_y, float(scale), eps)
