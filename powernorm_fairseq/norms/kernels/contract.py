"""The one interface every kernel backend implements: its functions and their
arguments, by name and in order.

``ops.py`` calls the backends with these names as keywords; the GPU
backend's Python functions (``gpu.py``) and the compiled CPU module
(``csrc/norms.cpp``, whose pybind11 definitions name each argument) are
checked against them when they load, so a backend that drifts from the
contract fails at once, naming the function and both argument lists.

Tensors that an entry point may go without are passed as empty tensors, not
None, and come back as empty tensors: ``ops.py`` registers every entry point
as a PyTorch op, and ops take and give tensors.
"""

import re

CONTRACT = {
    # y = (xs - mean) * inv * weight + bias over the rows, xs the row after the
    # optional group scaling (groups > 0, eps gs_eps); inv_eps >= 0: inv holds
    # a running second moment and the scale is 1 / sqrt(inv + inv_eps). mask:
    # the (B, T) padding mask, rows r = t * B + b. With want_stats, per-program
    # statistics of the real rows, part (P, 3, C): count, then (center) mean
    # and sum of squared deviations from it, or 0 and the sum of xs^2.
    # Returns (y, group scales (N, groups), part), each empty where not asked.
    "forward": ("x", "mask", "groups", "gs_eps", "mean", "inv", "inv_eps", "weight", "bias", "want_y",
                "want_stats", "center"),
    # the batch's statistics from forward's part and the running statistics'
    # update (functions.UPDATES), in a fixed order; steps counts PN's steps.
    # Returns (mean (bn) or empty, inv for the forward, inv of the batch, n (1,) float64).
    "finish_stats": ("part", "mean_buf", "second_buf", "steps", "update", "momentum", "eps", "warmup"),
    # dL/dxs = (g - m * (A + b_scale * B * xh)) * inv_bwd, g = grad_y * weight,
    # back through the group scaling; m = 1 at real rows, and at padding too
    # when correct_pads (the released code's backward). With want_sums,
    # per-program sums part (P, 5, C): dy*xh and dy over every row, dy*xh and
    # xh^2 over the real rows, xh^2 over every row. Returns (dL/dx, part).
    "backward": ("x", "mask", "scale", "grad_y", "weight", "mean", "inv_fwd", "inv_bwd", "A", "B", "b_scale",
                 "groups", "correct_pads", "want_gx", "want_sums"),
    # from backward's part: the weight and bias gradients, A and B of the exact
    # gradient (kind "exact"), and nu's update (kind "paper": Algorithm 2, or
    # "exact" with a nu; "reference": the released code's). rows: N.
    # Returns (grad_weight, grad_bias, A or empty, B or empty).
    "finish_backward": ("part", "weight", "n", "nu", "rate", "kind", "center", "rows"),
    # ScaleNorm: y = scale * x / max(||x||, eps) per row; returns (y, norms)
    "scalenorm_forward": ("x", "scale", "eps"),
    # returns (dL/dx, dL/dscale)
    "scalenorm_backward": ("x", "norms", "grad_y", "scale", "eps"),
    # RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight per row; returns (y, 1 / rms)
    "rmsnorm_forward": ("x", "weight", "eps"),
    # returns (dL/dx, dL/dweight)
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
