"""Triton's interpreter, without its repeated patching of the language.

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor.__call__``)
patches ``triton.language`` for the whole launch, as seen from the kernel's
module, and restores it at the end. Each call of a ``@triton.jit`` function
inside the kernel (``InterpretedFunction.__call__``: the kernel's helpers,
and ``tl.zeros`` and its like from ``triton.language.standard``) patches the
language modules that function's module sees, and never restores that. A
second patch of the same modules within a launch finds every builtin patched
already and only scans the modules again: in this suite, half or more of the
interpreter's time. :func:`install` makes a launch patch each set of modules
once; the first call from each module is Triton's own. ``tests/test_support.py``
checks that the kernels compute the same, bit for bit, with and without it.
"""

import contextlib

_LAUNCHED = []  # per launch, innermost last: the sets of language modules it has patched
_MODULES = {}  # a module's globals (by id) -> the language modules they hold
_ORIGINAL = {}  # what install() replaced


def install() -> bool:
    """Skip the repeated patch; returns whether this Triton has what it wraps
    (otherwise nothing changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid, device = interpreter.GridExecutor, interpreter.InterpretedFunction
    if _ORIGINAL or not all(hasattr(interpreter, name) for name in ("_patch_lang", "_get_np_dtype", "tl")):
        return bool(_ORIGINAL)
    launch, call, np_dtype = grid.__call__, device.__call__, interpreter._get_np_dtype
    answers = {}

    def kept_np_dtype(tt_dtype):  # a block's answer is its element type's
        key = tt_dtype.element_ty if isinstance(tt_dtype, interpreter.tl.block_type) else tt_dtype
        if isinstance(key, interpreter.tl.pointer_type):  # unhashable; answered at once
            return np_dtype(key)
        if key not in answers:
            answers[key] = np_dtype(key)
        return answers[key]

    def launched(self, *args, **kwargs):
        _LAUNCHED.append({_modules(self.fn.__globals__)})
        try:
            return launch(self, *args, **kwargs)
        finally:
            _LAUNCHED.pop()

    def called(self, *args, **kwargs):
        seen = _modules(self.fn.__globals__)
        if not _LAUNCHED or seen not in _LAUNCHED[-1]:
            if _LAUNCHED:
                _LAUNCHED[-1].add(seen)
            return call(self, *args, **kwargs)
        patch = interpreter._patch_lang

        def skipped_once(fn):  # this call's own patch; the calls it makes patch as Triton does
            interpreter._patch_lang = patch
            return contextlib.nullcontext()

        interpreter._patch_lang = skipped_once
        try:
            return call(self, *args, **kwargs)
        finally:
            interpreter._patch_lang = patch

    _ORIGINAL.update(launch=launch, call=call, np_dtype=np_dtype)
    grid.__call__, device.__call__, interpreter._get_np_dtype = launched, called, kept_np_dtype
    return True


def uninstall():
    """Triton's interpreter as it came."""
    from triton.runtime import interpreter

    if _ORIGINAL:
        interpreter.GridExecutor.__call__ = _ORIGINAL.pop("launch")
        interpreter.InterpretedFunction.__call__ = _ORIGINAL.pop("call")
        interpreter._get_np_dtype = _ORIGINAL.pop("np_dtype")


def _modules(namespace):
    """The language modules that Triton's ``_patch_lang`` patches for a function of this namespace."""
    key = id(namespace)
    if key not in _MODULES:
        import triton.language as tl

        _MODULES[key] = frozenset(id(v) for v in namespace.values() if v is tl or v is tl.core)
    return _MODULES[key]
