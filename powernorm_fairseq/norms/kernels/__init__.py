"""Where the norms' fused kernels live, and the one place that chooses them.

Three backends, side by side:

* ``plain``: the same entry points in PyTorch operations (``plain.py``); it
  runs anywhere, on any dtype.
* ``cpu``: C++ kernels for CPU tensors in float32/float64 (``cpu.py``,
  ``csrc/``), compiled at install or on first use.
* ``triton``: Triton kernels for CUDA tensors in float16, bfloat16, float32 and
  float64 (``gpu.py``); on CPU tensors under Triton's interpreter
  (``TRITON_INTERPRET=1``), which is how the tests check them without a GPU.

:func:`select` picks one by the tensor's device and what is available, and
logs once per process which backend the norms run on. ``POWERNORM_KERNELS=0``
forces the plain path; ``POWERNORM_BACKEND=plain|cpu|triton`` (or
:func:`use`) forces one backend, and fails loudly where it cannot run. The
two variables are read once per process, when the norms first choose a
backend; :func:`use` switches in a running process.
"""

import logging
import os
from contextlib import contextmanager
from typing import Optional

import torch

from . import compiled, cpu, gpu, plain

logger = logging.getLogger(__name__)

BACKENDS = ("plain", "cpu", "triton")
_MODULES = {"plain": plain, "cpu": cpu, "triton": gpu}
_forced: Optional[str] = None
_environment: Optional[tuple] = None  # (the backend the environment forces, or None), once read
_said = set()


def forced() -> Optional[str]:
    """The backend forced by :func:`use` or the environment, or None (automatic)."""
    global _environment
    if _forced is not None:
        return _forced
    if _environment is None:  # read once: os.environ.get costs more than a small layer's host code
        _environment = (_from_environment(),)
    return _environment[0]


def _from_environment() -> Optional[str]:
    switch = os.environ.get("POWERNORM_KERNELS", "1").strip()
    if switch not in ("0", "1"):
        raise ValueError(f"POWERNORM_KERNELS={switch!r}: 0 (the plain PyTorch path) or 1 (the kernels, the default)")
    if switch == "0":
        return "plain"
    name = os.environ.get("POWERNORM_BACKEND", "").strip() or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"POWERNORM_BACKEND={name!r}: choose one of {', '.join(BACKENDS)}")
    return name


@contextmanager
def use(name: Optional[str]):
    """Force backend ``name`` (None: automatic) inside the block."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    before, _forced = _forced, name
    try:
        yield
    finally:
        _forced = before


#: (use()'s backend, the environment's, device) -> the backend module chosen there, once its choice
#: was said (the environment's is read by the first choice: no key holds it unread)
_CHOSEN = {}


def _chosen_on(forced_name, device) -> str:
    """Traced code's choice, a constant of its graph: for ``device``, as :func:`select` makes it (the
    ``forced_name`` argument: a guard, so that a graph under another use() is traced anew)."""
    return (_CHOSEN.get((forced_name, _environment, device)) or _select(torch.empty(1, device=device))).NAME


# torch._dynamo.assume_constant_result's mark, without importing torch._dynamo (seconds, in every process)
_chosen_on._dynamo_marked_constant = True


def select(x: torch.Tensor):
    """The backend module for input ``x``."""
    if torch.compiler.is_compiling() and 0 not in x.shape:  # no guard on _CHOSEN, which eager steps fill
        return _MODULES[_chosen_on(_forced, x.device)]
    if (_forced, _environment, x.device) in _CHOSEN and 0 not in x.shape:  # no call: a step is host time
        return _CHOSEN[_forced, _environment, x.device]
    k = _select(x)
    if 0 not in x.shape:
        _CHOSEN[_forced, _environment, x.device] = k
    return k


def _select(x: torch.Tensor):
    """:func:`select`'s choice, each time."""
    name = forced()
    if name is None:  # automatic: the device's kernels where they are available
        name = "triton" if x.is_cuda else "cpu" if x.is_cpu else "plain"
        k = _MODULES[name]
        if not (k.available() and k.takes(x)):
            _say(f"plain PyTorch path ({name} kernels unavailable: {_why(k)})", warn=True)
            return plain
    elif name != "plain":
        k = _MODULES[name]
        if not k.available():
            raise RuntimeError(f"POWERNORM_BACKEND={name}: the {name} kernels are unavailable ({_why(k)})")
        if not k.takes(x):
            raise RuntimeError(f"POWERNORM_BACKEND={name}: the {name} kernels do not take "
                               f"{x.device.type} tensors")
    if name == "plain":
        _say("plain PyTorch path")
        return plain
    said = f"{name} kernels"
    if said not in _said:  # a call less per step once said (measure/host.py counts them)
        _say(said)
    if x.numel() == 0:  # an empty batch: nothing to launch; the plain path gives its (empty) result
        return plain
    return _MODULES[name]


def check_environment() -> None:
    """Refuse, before a run starts, what the environment asks for and cannot
    get (``POWERNORM_BACKEND``, ``POWERNORM_BUILD_WAIT``): ValueError, one line."""
    name = forced()
    compiled.build_wait()
    if name == "triton" and not gpu.available():
        raise ValueError(f"POWERNORM_BACKEND=triton: the triton kernels are unavailable ({_why(gpu)})")
    if name == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("POWERNORM_BACKEND=triton needs a GPU, or TRITON_INTERPRET=1 to run the kernels "
                         "in Triton's interpreter on the CPU (slowly: for tests)")


def describe(x: torch.Tensor) -> str:
    """The name of the backend that :func:`select` gives ``x``."""
    return select(x).NAME


def _why(k) -> str:
    return k.failure_reason() or "not installed"


def _say(what: str, warn: bool = False):
    if what not in _said and not torch.compiler.is_compiling():  # said by the eager call before a compile
        _said.add(what)
        (logger.warning if warn else logger.info)("powernorm_fairseq: norms run on the %s", what)


__all__ = ["BACKENDS", "check_environment", "cpu", "describe", "forced", "gpu", "select", "use"]
