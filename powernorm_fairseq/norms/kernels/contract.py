"""The one interface every kernel backend implements: its functions and their
arguments, by name and in order.

``functions.py`` calls the backends with these names as keywords; the GPU
backend's Python functions (``gpu.py``) and the compiled CPU module
(``csrc/norms.cpp``, whose pybind11 definitions name each argument) are
checked against them when they load, so a backend that drifts from the
contract fails at once, naming the function and both argument lists.

Tensors that an entry point may go without are passed as empty tensors, not
None (the C++ module takes tensors only).
"""

import re

CONTRACT = {
    # y = (xs - mean) * inv * weight + bias, xs the rows after the optional
    # group scaling (groups > 0, eps gs_eps); with want_stats the float64
    # per-channel sums of d and d^2 over the real rows, d = xs - shift.
    # Returns (y or None, group scales (N, groups) or None, sums (2, C) or None).
    "forward": ("x", "keep", "groups", "gs_eps", "mean", "inv", "weight", "bias", "want_y", "want_stats",
                "shift"),
    # dL/dxs = (g - m * (A + B * xh)) * inv_bwd, g = grad_y * weight, back
    # through the group scaling; m = 1 at real rows, and at padding too when
    # correct_pads (the released code's backward). Returns (dL/dx or None,
    # sums (5, C) float64 or None: dy*xh and dy over every row, g*xh and xh^2
    # over the real rows, xh^2 over every row).
    "backward": ("x", "keep", "scale", "grad_y", "weight", "mean", "inv_fwd", "inv_bwd", "A", "B", "groups",
                 "correct_pads", "want_gx", "want_sums"),
    # ScaleNorm: y = scale * x / max(||x||, eps) per row; returns (y, norms)
    "scalenorm_forward": ("x", "scale", "eps"),
    # returns (dL/dx, dL/dscale)
    "scalenorm_backward": ("x", "norms", "grad_y", "scale", "eps"),
}

#: entry points only the GPU backend has
GPU_ONLY = {
    "rmsnorm_forward": ("x", "weight", "eps"),
    "rmsnorm_backward": ("x", "rstd", "grad_y", "weight"),
}


def argument_names(function) -> tuple:
    """The argument names of a Python function, or of a pybind11 function
    from the signature its docstring opens with."""
    code = getattr(function, "__code__", None)
    if code is not None:
        return code.co_varnames[:code.co_argcount]
    match = re.match(r"\w+\((.*?)\)\s*->", (function.__doc__ or "").strip())
    if match is None:
        return ()
    return tuple(re.sub(r"[:=].*", "", arg).strip() for arg in re.split(r",\s*(?![^\[]*\])", match.group(1)))


def check(module, name: str, entry_points=CONTRACT) -> None:
    """Raise TypeError unless ``module`` defines each of ``entry_points`` with
    the contract's argument names, in its order."""
    for function, wanted in entry_points.items():
        have = argument_names(getattr(module, function, None)) if hasattr(module, function) else None
        if have != wanted:
            raise TypeError(f"the {name} kernels' {function} takes {have}, the contract "
                            f"(norms/kernels/contract.py) says {wanted}")
