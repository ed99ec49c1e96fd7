"""The fused C++ kernels (``csrc/norms.cpp``), compiled on first use.

They are built with torch's C++ extension loader and cached, so only the first
process on a machine pays the compile (about a minute). Where no compiler is
present, or ``POWERNORM_KERNELS=0`` is set, the norms run their plain PyTorch
path instead (same math, several passes over memory) and a warning says so.
"""

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "norms.cpp"
_module = None
_failed = None


def load():
    """The compiled module, or None (with one warning) when it cannot be built."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    if os.environ.get("POWERNORM_KERNELS", "1") == "0":
        _failed = "disabled by POWERNORM_KERNELS=0"
        return None
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
    except Exception as err:  # no compiler, no ninja, a build error: fall back, loudly
        _failed = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else err}"
        logger.warning("powernorm_fairseq: fused C++ kernels unavailable (%s); "
                       "using the plain PyTorch path, which is slower", _failed)
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


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels take this input (CPU, float32/float64)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and load() is not None
