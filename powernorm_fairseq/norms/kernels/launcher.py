"""How the Triton path launches a kernel: once through Triton's JIT, then
through the compiled kernel that launch returned, held.

Triton's JIT launch (``kernel[grid](...)``, ``JITFunction.run``) binds and
specialises every argument, hashes a cache key, checks the kernel's globals
and builds launch metadata on every call, before its C launcher and the
driver's launch. On this project's CPU machine under Triton's real launch
code and a stand-in driver (``measure/standin.py``) that is most of a norm
step's host time. Here the first launch of a *variant* goes through the JIT,
which compiles it (or finds it compiled) and returns its ``CompiledKernel``;
the kernel is held under a fingerprint of everything Triton's specialisation
reads (each tensor's dtype and 16-byte alignment, each integer's value, each
scalar's type, the constexprs, the current device), and every later launch
with the same fingerprint calls its launcher as ``JITFunction.run`` ends by
doing: the grid, torch's current stream, the kernel's function and packed
metadata, and every parameter in order (constexprs included; the launcher
skips them). The fingerprint is finer than Triton's specialisation (an
integer's value, not its class), so a held kernel is always the one Triton
would launch. ``tests/test_launches.py`` launches every step both ways under
the stand-in driver and compares the recorded launches byte for byte.

The JIT path is kept where something watches it: the plugin's observers
(``OBSERVERS``, ``measure/launches.py``), Triton's launch hooks (a profiler)
or a kernel's pre-run hooks, and under Triton's interpreter.
"""

import contextlib
import os

import torch

#: what watches the launches: callables ``observer(kernel_name)``, each a
#: context manager entered around the launch; empty unless a measuring tool
#: (``powernorm_fairseq.measure.launches``) adds one
OBSERVERS = []
#: held compiled kernels, by (id of the kernel, fingerprint): the kernels are the modules' own, alive for good;
#: the JIT launches a variant not here, and it is added
_HELD = {}
_KEPT = 4096  # variants held at most; past this many they are held anew as they come
_POSITIONS = {}  # id of a kernel -> the positions of its tensor arguments, and of the others
#: whether launches go through held kernels (False: every launch through Triton's JIT, as a test compares)
HOLD = True
#: Triton's interpreter runs the kernels (read at import, as gpu.py reads it): no compiled kernel to hold
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def observed(name: str):
    """The observers' contexts around one launch of kernel ``name``."""
    around = contextlib.ExitStack()
    for observer in OBSERVERS:
        around.enter_context(observer(name))
    return around


def launch(kernel, grid, *args, **constexprs):
    """``kernel[grid](*args, **constexprs)``, through the held compiled kernel where there is one."""
    if OBSERVERS:
        with observed(getattr(kernel, "__name__", None) or str(kernel)):
            kernel[grid](*args, **constexprs)
        return
    if _INTERPRETING or not HOLD or _watched(kernel):
        kernel[grid](*args, **constexprs)
        return
    from triton.runtime import driver

    device = driver.active.get_current_device()
    positions = _POSITIONS.get(id(kernel))
    if positions is None:  # the kernel's pointer parameters (where its launches pass tensors), and the others
        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        positions = _POSITIONS[id(kernel)] = (tensors, tuple(i for i in range(len(args)) if i not in tensors))
    tensors, scalars = positions
    try:  # what Triton specialises on: a tensor's dtype and 16-byte alignment, an int's value, a scalar's type
        key = (id(kernel), device, len(args), tuple(constexprs.items()),  # (a JITFunction hashes in Python)
               tuple((args[i].dtype, args[i].data_ptr() & 15 == 0) for i in tensors),
               tuple(args[i] if type(args[i]) is int else type(args[i]) for i in scalars))
    except (AttributeError, IndexError):  # another layout of arguments than the kernel's first launch had
        kernel[grid](*args, **constexprs)
        return
    held = _HELD.get(key)
    if held is None:
        compiled = kernel[grid](*args, **constexprs)  # compiles, or finds it compiled, and launches it
        if compiled is not None:  # (None: Triton compiles it elsewhere, and launched nothing to hold)
            if len(_HELD) > _KEPT:
                _HELD.clear()
            _HELD[key] = (compiled, _tail(kernel, len(args), constexprs))
        return
    compiled, tail = held
    g0, g1, g2 = (*grid, 1, 1)[:3]
    compiled.run(g0, g1, g2, driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *tail)


def _tail(kernel, given: int, constexprs: dict) -> tuple:
    """The parameters of ``kernel`` after the ``given`` positional ones: each a
    constexpr, given by name or by its default (the launcher skips them, but
    takes every parameter in order)."""
    tail = []
    for param in kernel.params[given:]:
        if not param.is_constexpr:
            raise TypeError(f"{kernel.__name__}: parameter {param.name} is no constexpr; pass it by position")
        tail.append(constexprs[param.name] if param.name in constexprs else param.default)
    return tuple(tail)


def _watched(kernel) -> bool:
    """Whether a launch hook (a profiler) or a pre-run hook of ``kernel`` would see the JIT's launch."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return bool(kernel.pre_run_hooks) or any(h is not None and getattr(h, "calls", True) for h in hooks)
