"""Triton's interpreter, without its repeated patching of the language.

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor.__call__``)
patches ``triton.language`` for the whole launch, as seen from the kernel's
module, and restores it at the end. Each call of a ``@triton.jit`` helper
inside the kernel (``InterpretedFunction.__call__``) patches it again, and
never restores that. A helper of the kernel's own module finds every builtin
already patched, so its call only scans the modules again: in this suite,
a third or more of the interpreter's time. :func:`install` skips that second
patch for helpers whose module is the running kernel's; any other call is
Triton's own. ``tests/test_support.py`` checks that the kernels compute the
same, bit for bit, with and without it.
"""

import contextlib

_LAUNCHED = []  # the globals of the kernels being launched, innermost last
_ORIGINAL = {}  # what install() replaced


def install() -> bool:
    """Skip the repeated patch; returns whether this Triton has what it wraps
    (otherwise nothing changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid, device = interpreter.GridExecutor, interpreter.InterpretedFunction
    if _ORIGINAL or not hasattr(interpreter, "_patch_lang"):
        return bool(_ORIGINAL)
    launch, call = grid.__call__, device.__call__

    def launched(self, *args, **kwargs):
        _LAUNCHED.append(self.fn.__globals__)
        try:
            return launch(self, *args, **kwargs)
        finally:
            _LAUNCHED.pop()

    def called(self, *args, **kwargs):
        if not _LAUNCHED or self.fn.__globals__ is not _LAUNCHED[-1]:
            return call(self, *args, **kwargs)
        patch, interpreter._patch_lang = interpreter._patch_lang, _patched_already
        try:
            return call(self, *args, **kwargs)
        finally:
            interpreter._patch_lang = patch

    _ORIGINAL.update(launch=launch, call=call)
    grid.__call__, device.__call__ = launched, called
    return True


def uninstall():
    """Triton's interpreter as it came."""
    from triton.runtime import interpreter

    if _ORIGINAL:
        interpreter.GridExecutor.__call__ = _ORIGINAL.pop("launch")
        interpreter.InterpretedFunction.__call__ = _ORIGINAL.pop("call")


def _patched_already(fn):
    return contextlib.nullcontext()
