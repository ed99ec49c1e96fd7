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
import re

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


# ---------------------------------------------------------------- the C++ nodes' launches (csrc/launch.h)

#: the largest dynamic shared memory a launch takes without an attribute of its own (Triton's launcher
#: adds one past it): a variant that needs more is launched by Triton's JIT every time
_SHARED_PLAIN = 228 * 1024
#: bytes of each type of Triton's signatures that the node passes
_TYPE_BYTES = {"i32": 4, "i64": 8, "u64": 8, "fp32": 4, "fp64": 8}


def from_node(kernel, grid, args, constexprs, hold):
    """A launch the C++ node holds no compiled variant for, or, with ``hold``
    False, one it compares: Triton's JIT launch of it. With ``hold``: the
    variant's launch ABI for the node to hold (:func:`abi`), or None where it
    cannot (a variant Triton launches in a way of its own, or one a hook watches)."""
    compiled = kernel[grid](*args, **constexprs)
    if not hold or compiled is None or _watched(kernel):
        return None
    return abi(compiled, len(args))


def abi(compiled, given: int):
    """How the driver takes a launch of ``compiled``, read from the compiled
    kernel: (function, warps, dynamic shared memory, the index among the
    ``given`` run-time arguments of each parameter it takes, in order, their
    types (Triton's signature, constexprs removed: a specialised integer equal
    to 1 is one), and the scratch pointers after them (its PTX ``.entry``
    counts them: Triton appends one per scratch buffer, null where a kernel
    needs none)). None where Triton launches it in a way the node does not:
    clusters, a cooperative or PDL launch, scratch memory, tensor descriptors,
    oversized shared memory."""
    m = compiled.metadata
    if (getattr(m, "num_ctas", 1) != 1 or getattr(m, "launch_cooperative_grid", False)
            or getattr(m, "launch_pdl", False) or getattr(m, "global_scratch_size", 0)
            or getattr(m, "profile_scratch_size", 0) or getattr(m, "tensordesc_meta", None)
            or "gsan" in (getattr(m, "instrumentation_mode", "") or "") or m.shared > _SHARED_PLAIN):
        return None
    types = list(compiled.src.signature.values())  # every parameter of the kernel, in order
    if any(t != "constexpr" for t in types[given:]):
        raise TypeError(f"{compiled.name}: a run-time parameter past the {given} the node gives")
    kept = [(i, t) for i, t in enumerate(types[:given]) if t != "constexpr"]
    sizes = ptx_params(compiled.asm["ptx"], compiled.name)
    for (i, t), size in zip(kept, sizes):
        if size != (8 if t.startswith("*") else _TYPE_BYTES.get(t)):
            raise TypeError(f"{compiled.name}: parameter {i} of type {t} is {size} bytes in its PTX")
    scratch = sizes[len(kept):]
    if len(sizes) < len(kept) or any(size != 8 for size in scratch):
        raise TypeError(f"{compiled.name}: {len(sizes)} PTX parameters for {len(kept)} of its signature")
    return (compiled.function, m.num_warps, m.shared, [i for i, _ in kept], [t for _, t in kept], len(scratch))


#: bytes of each PTX parameter type
_PTX_SIZES = {"8": 1, "16": 2, "32": 4, "64": 8}


def ptx_params(ptx: str, name: str) -> list:
    """The byte sizes of kernel ``name``'s parameters, in order, from its PTX ``.entry``."""
    entry = re.search(rf"\.entry {re.escape(name)}\((.*?)\)", ptx, re.S)
    if entry is None:
        raise ValueError(f"no .entry {name} in the PTX")
    sizes = []
    for param in re.findall(r"\.param\s+(\.[a-z0-9]+(?:\s+\.[a-z]+)*)", entry.group(1)):
        bits = re.search(r"\.[bsuf](8|16|32|64)\b", param)
        if bits is None:
            raise ValueError(f"{name}: a parameter of type {param!r}")
        sizes.append(_PTX_SIZES[bits.group(1)])
    return sizes
