"""How the Triton path launches a kernel: through Triton's JIT in Python,
or through the C++ passes' held variants, which that launch gives them.

Triton's JIT launch (``kernel[grid](...)``, ``JITFunction.run``) binds and
specialises every argument, hashes a cache key, checks the kernel's globals
and builds launch metadata on every call, before its C launcher and the
driver's launch: on this project's CPU machine, under Triton's real launch
code and a stand-in driver (``measure/standin.py``), that was most of a norm
step's host time. The C++ passes (``csrc/gpu_passes.h``, ``csrc/launch.h``)
launch the first launch of each variant through here (:func:`from_node`),
through the JIT, which compiles it (or finds it compiled), and its launch ABI,
read from the compiled kernel (:func:`abi`), goes back to the node, which
launches every later one itself through the driver. ``tests/test_launches.py``
launches every step both ways under the stand-in driver and compares what the
driver received, byte for byte.

Where the launches are watched, every launch comes here, through Triton's JIT
(:func:`watched`): under Triton's interpreter, while a launch observer
(``OBSERVERS``) or a recorder (:func:`watching`) is on, and with the held
launch off (``POWERNORM_HOLD=0``, read once, or :func:`hold`): the switch that
sends every launch through Triton's own launcher.
"""

import contextlib
import os
import re

_SETTERS = []  # what to tell whether the launches are watched: each compiled module's switch


def _telling(doc, call):
    """A list class whose every change calls ``call()`` after it."""
    def telling(original):
        def changed(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            finally:
                call()
        return changed

    listed = type("_Telling", (list,), {"__doc__": doc})
    for name in ("append", "extend", "insert", "remove", "pop", "clear", "__setitem__", "__delitem__", "__iadd__"):
        setattr(listed, name, telling(getattr(list, name)))
    return listed


#: what watches the launches: callables ``observer(kernel_name)``, each a
#: context manager entered around the launch; empty unless a measuring tool
#: (``powernorm_fairseq.measure.launches``) adds one
OBSERVERS = _telling("The launch observers, which say when they change.", lambda: _sync())()
_HOLD = os.environ.get("POWERNORM_HOLD", "1").strip() != "0"
_RECORDERS = [0]
_INTERPRETING = [False]  # whether Triton's interpreter runs the kernels (watch's ``interpreting``)


def watched() -> bool:
    """Whether every launch goes through Triton's JIT (none held)."""
    return _INTERPRETING[0] or bool(OBSERVERS) or not _HOLD or _RECORDERS[0] > 0


def _sync():
    on = watched()
    for setter in _SETTERS:
        setter(on)


def hold(on: bool) -> None:
    """Let the passes hold the variants Triton's JIT launched and launch them themselves (True, the
    default), or send every launch through Triton's JIT (False: ``POWERNORM_HOLD=0``)."""
    global _HOLD
    _HOLD = bool(on)
    _sync()


@contextlib.contextmanager
def watching():
    """Every launch through :func:`launch` inside the block (a recorder patches it)."""
    _RECORDERS[0] += 1
    _sync()
    try:
        yield
    finally:
        _RECORDERS[0] -= 1
        _sync()


def observed(name: str):
    """The observers' contexts around one launch of kernel ``name``."""
    around = contextlib.ExitStack()
    for observer in OBSERVERS:
        around.enter_context(observer(name))
    return around


def launch(kernel, grid, *args, **constexprs):
    """``kernel[grid](*args, **constexprs)``, seen by the observers; what Triton's JIT returns."""
    if OBSERVERS:
        with observed(getattr(kernel, "__name__", None) or str(kernel)):
            return kernel[grid](*args, **constexprs)
    return kernel[grid](*args, **constexprs)


def _watched(kernel) -> bool:
    """Whether a launch hook (a profiler) or a pre-run hook of ``kernel`` would see the JIT's launch:
    a variant launched then is not given to the node, whose later launches the hook would miss."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return bool(kernel.pre_run_hooks) or any(h is not None and getattr(h, "calls", True) for h in hooks)


# ---------------------------------------------------------------- the C++ nodes' launches (csrc/launch.h)

_CHANGED = []  # what to call when something Triton's JIT consults at each launch may have changed


def _notify():
    for call in _CHANGED:
        call()


def watch(kernels, changed, set_watched, interpreting=False):
    """Call ``changed()`` whenever something Triton's JIT launch consults at each call may change, so that
    the node drops its held variants and launches through the JIT again, as Triton would: a knob set or
    reset (``triton.knobs.runtime.debug``, ``launch_enter_hook``, ``compilation.instrumentation_mode``, any
    attribute of any of Triton's knob groups), a hook added to or removed from one of Triton's hook chains
    (Proton's way), a pre-run hook of one of ``kernels``, or an environment variable the knobs read. Reading
    them at each launch instead is what the node saves; installed once, for every node. ``set_watched``:
    the node's switch of :func:`watched` launches, told now and at each change; ``interpreting``: whether
    Triton's interpreter runs the kernels (every launch watched)."""
    from triton import knobs

    _INTERPRETING[0] = _INTERPRETING[0] or interpreting
    _SETTERS.append(set_watched)
    set_watched(watched())
    _CHANGED.append(changed)
    if len(_CHANGED) > 1:
        return

    def wrap(owner, name, after=None):
        original = getattr(owner, name)

        def wrapped(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            finally:
                if after is None or after(self, *args):
                    _notify()

        wrapped.__wrapped__ = original
        setattr(owner, name, wrapped)

    wrap(knobs.base_knobs, "__setattr__")
    wrap(knobs.base_knobs, "__delattr__")
    wrap(knobs.HookChain, "add")
    wrap(knobs.HookChain, "remove")
    keys = {d.key for group in vars(knobs).values() if isinstance(group, knobs.base_knobs)
            for d in group.knob_descriptors.values() if isinstance(getattr(d, "key", None), str)}
    environ = type(os.environ)

    def relevant(_, key, *rest):
        return isinstance(key, str) and (key in keys or key.startswith("TRITON"))

    wrap(environ, "__setitem__", relevant)
    wrap(environ, "__delitem__", relevant)
    for kernel in kernels:
        kernel.pre_run_hooks = _Hooks(kernel.pre_run_hooks)


_Hooks = _telling("A kernel's pre-run hooks, which say when they change (:func:`watch`).", lambda: _notify())

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
    compiled = launch(kernel, grid, *args, **constexprs)
    if not hold or compiled is None or _watched(kernel):
        return None
    held = abi(compiled, len(args))
    return None if held is None else (*held, compiled)  # the node keeps the compiled kernel (its module) alive


def abi(compiled, given: int):
    """How the driver takes a launch of ``compiled``, read from the compiled
    kernel: (function, warps, dynamic shared memory, then its :func:`layout`),
    or None where Triton launches it in a way the node does not."""
    laid = layout(compiled, given)
    if laid is None:
        return None
    return (compiled.function, compiled.metadata.num_warps, compiled.metadata.shared, *laid)


def layout(compiled, given: int):
    """The parameters of ``compiled`` as the node passes them: (the index
    among the ``given`` run-time arguments of each parameter the kernel takes,
    in order, their types (Triton's signature, constexprs removed: a
    specialised integer equal to 1 is one), and the scratch pointers after
    them (its PTX ``.entry`` counts them: Triton appends one per scratch
    buffer, null where a kernel needs none)). Each parameter's size in the
    PTX must be its type's. None where Triton launches the kernel in a way the
    node does not: clusters, a cooperative or PDL launch, scratch memory,
    tensor descriptors, oversized shared memory."""
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
    return [i for i, _ in kept], [t for _, t in kept], len(scratch)


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
