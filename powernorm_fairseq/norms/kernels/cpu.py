"""The CPU backend: C++ kernels (``csrc/norms.cpp``), compiled on first use.

They are built with torch's C++ extension loader and cached, so only the first
process on a machine pays the compile (about a minute). Where no compiler is
present the norms run their plain PyTorch path instead, and the dispatch
(``kernels/__init__.py``) says so.
"""

import hashlib
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from . import contract
from ..stats import group_scale

logger = logging.getLogger(__name__)

NAME = "cpu"
DTYPES = (torch.float32, torch.float64)  # half inputs are upcast by the caller

_SOURCE = Path(__file__).parent / "csrc" / "norms.cpp"
#: how long a process waits for another one's build of the kernels (a build takes about a minute)
BUILD_WAIT_S = int(os.environ.get("POWERNORM_BUILD_WAIT", "600"))
_module = None
failure = None  # why the kernels could not be built, once tried


def load():
    """The compiled module, or None (``failure`` says why) when it cannot be built."""
    global _module, failure
    if _module is not None or failure is not None:
        return _module
    try:
        from torch.utils.cpp_extension import load as load_extension

        build = build_directory()
        build.mkdir(parents=True, exist_ok=True)
        with _venv_tools_on_path(), _build_lock(build):
            module = load_extension(
                name="powernorm_fairseq_kernels",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
        contract.check(module, "compiled cpu", contract.COMPILED_CPU)  # a module that drifted from the contract is not used
        _module = module
    except Exception as err:  # no compiler, no ninja, a build error: the caller falls back, loudly
        text = str(err).strip()
        failure = f"{type(err).__name__}: {text.splitlines()[-1] if text else err}"
    return _module


def build_directory() -> Path:
    """Where torch's loader builds and caches the kernels: under its own root,
    one directory per source and environment, so that two checkouts (or two
    virtual environments) on one machine never build into, or load from, each
    other's directory. (With one directory, torch's loader sees another
    environment's include paths in the build file and rebuilds, each in turn.)"""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    flavour = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    source = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    environment = hashlib.sha256(f"{sys.prefix}\n{_SOURCE}".encode()).hexdigest()[:8]
    return (Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}"
            / f"powernorm_fairseq_kernels-{source}-{environment}")


@contextmanager
def _build_lock(build: Path):
    """One build at a time, under a lock that dies with its holder.

    torch's loader guards a build with a file (``lock``) that a killed build
    leaves behind, and the next process then waits for it forever. Processes
    here first take a file lock (``filelock``: an flock, which the system
    releases when its holder exits), and say in one line when they wait for
    one. Holding it, a ``lock`` file can only be one left by a build that was
    killed: it is removed.
    """
    from filelock import FileLock, Timeout

    held = FileLock(build / "powernorm-build.flock", preserve_lock_file=True)
    try:
        held.acquire(timeout=0)
    except Timeout:
        logger.warning("powernorm_fairseq: waiting for another process to build the CPU kernels "
                       "(lock %s, at most %d s)", held.lock_file, BUILD_WAIT_S)
        try:  # bounded: past it the caller falls back to the plain path, with a warning
            held.acquire(timeout=BUILD_WAIT_S, poll_interval=0.5)
        except Timeout:
            raise TimeoutError(f"another process has held {held.lock_file} for over {BUILD_WAIT_S} s") from None
    try:
        stale = build / "lock"
        if stale.exists():
            logger.warning("powernorm_fairseq: removing %s, left by a kernel build that was interrupted", stale)
            stale.unlink()
        yield
    finally:
        held.release()


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


# The backend interface (contract.py): the C++ kernels make the passes over
# the rows; the small per-channel work around them is PyTorch's (on a CPU,
# launches cost nothing to speak of). The math is in functions.py.
def parts(x, groups, kernel, tall):
    """(rows, dtype) of the per-program statistics: the threads' sums come back added."""
    return 1, torch.float64


def _keep(mask, x):
    """Per-row weights (N,) of a (B, T) padding mask, 1 at real rows; empty without one."""
    return mask if mask.numel() == 0 else (~mask).t().reshape(-1).to(x.dtype)


def _count(keep, x):
    return keep.sum(dtype=torch.float64) if keep.numel() else x.new_full((), x.size(0), dtype=torch.float64)


def _empty():
    return torch.empty(0)


def forward(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, bias, want_y, want_stats, center):
    keep = _keep(mask, x)
    if inv_eps >= 0 and want_y:
        inv = torch.rsqrt(inv + inv_eps)
    shift = _empty()
    if want_stats and center:  # a real row, as the kernel sees it (the shifted-data algorithm)
        row = x.index_select(0, keep.argmax().view(1) if keep.numel() else torch.zeros(1, dtype=torch.long))
        shift = (group_scale(row.view(1, 1, -1), groups) if groups > 0 else row).view(-1)
    y, scale, sums = load().forward(x=x, keep=keep, groups=groups, gs_eps=gs_eps, mean=mean.to(x.dtype),
                                    inv=inv.to(x.dtype), weight=weight.to(x.dtype), bias=bias.to(x.dtype),
                                    want_y=want_y, want_stats=want_stats, shift=shift.to(x.dtype))
    part = _empty()
    if want_stats:
        n = _count(keep, x)
        ns = n.clamp(min=1)
        if center:
            s1n = sums[0] / ns
            part = torch.stack([n.expand_as(s1n), shift.double() + s1n, sums[1] - sums[0] * s1n])
        else:
            part = torch.stack([n.expand_as(sums[1]), torch.zeros_like(sums[1]), sums[1]])
        part = part.unsqueeze(0)
    return _or_empty(y), _or_empty(scale), part


def _or_empty(t):
    return _empty() if t is None else t


def finish_stats(part, mean_buf, second_buf, steps, update, momentum, eps, warmup):
    sd = second_buf.dtype
    p = part.double()
    n = p[:, 0, 0].sum()
    ns = n.clamp(min=1)
    real = n > 0
    if update == "bn":  # Chan et al.'s pairwise formula over the parts
        mean = (p[:, 0] * p[:, 1]).sum(0) / ns
        second = ((p[:, 2] + p[:, 0] * (p[:, 1] - mean) ** 2).sum(0) / ns).clamp(min=0)
    else:
        mean, second = None, p[:, 2].sum(0) / ns
    old = second_buf.double()
    inv_batch = torch.rsqrt(second + eps)
    inv_run = torch.rsqrt(old + eps)
    k = steps.double() + 1 if steps.numel() else None
    if update == "bn":
        unbiased = second * n / (n - 1).clamp(min=1)
        new = torch.where(n > 1, old.lerp(unbiased, momentum), old)
    elif update in ("pn-v", "pn"):
        new = old.lerp(second, momentum)
    elif update == "pn-warm":  # cumulative mean
        new = old * ((k - 1) / k) + second / k
    else:
        new = torch.where(k < warmup, old * ((k - 1) / k) + second / k, old)
        new = new.lerp(second, momentum)
    inv = inv_run if update in ("pn", "reference") else torch.where(real, inv_batch, inv_run)
    checks = [second] if mean is None else [second, mean]
    ok = real & torch.stack([torch.isfinite(t).all() for t in checks]).all()
    mean_out = _empty()
    if mean is not None:
        mean_out = torch.where(real, mean, mean_buf.double()).to(sd)
        mean_buf.copy_(torch.where(ok, mean_buf.double().lerp(mean, momentum), mean_buf.double()))
    second_buf.copy_(torch.where(ok, new, old))
    if steps.numel():
        steps.add_(real.to(steps.dtype))
    return mean_out, inv.to(sd), torch.where(real, inv_batch, inv_run).to(sd), n.view(1)


def backward(x, mask, scale, grad_y, weight, mean, inv_fwd, inv_bwd, A, B, b_scale, groups, correct_pads,
             want_gx, want_sums):
    cast = (lambda t: t.to(x.dtype) if t.numel() else t)
    B = B * b_scale if B.numel() and b_scale != 1.0 else B
    gx, sums = load().backward(x=x, keep=_keep(mask, x), scale=scale, grad_y=grad_y, weight=weight.to(x.dtype),
                               mean=cast(mean), inv_fwd=cast(inv_fwd), inv_bwd=cast(inv_bwd), A=cast(A), B=cast(B),
                               groups=groups, correct_pads=correct_pads, want_gx=want_gx, want_sums=want_sums)
    return _or_empty(gx), (_empty() if sums is None else sums.unsqueeze(0))


def finish_backward(part, weight, n, nu, rate, kind, center, rows):
    s = part.double().sum(0)
    w = weight.double()
    ns = n.clamp(min=1)
    sd = nu.dtype if nu.numel() else (torch.float64 if weight.dtype == torch.float64 else torch.float32)
    A, B = _empty(), _empty()
    if kind == "exact":  # means over the real tokens of sums over every position
        B = (w * s[0] / ns).to(sd)
        A = (w * s[1] / ns).to(sd) if center else A
    if nu.numel():
        old = nu.double()
        if kind == "reference":  # mean over every position of g' * xh, g' = g - (1 - a) nu xh
            nu.copy_(torch.where(n > 0, old + (w * s[0] - rate * old * s[4]) / rows, old))
        else:  # Algorithm 2: Lambda_t = mean(g xh), Gamma_t = mean(xh^2) over the real tokens
            lam, gam = w * s[2] / ns, s[3] / ns
            ok = (n > 0).all() & torch.isfinite(lam).all() & torch.isfinite(gam).all()
            nu.copy_(torch.where(ok, old * (1 - rate * gam) + rate * lam, old))
    return s[0].to(weight.dtype, copy=True), s[1].to(weight.dtype, copy=True), A, B


def scalenorm_forward(x, scale, eps):
    return load().scalenorm_forward(x=x, scale=scale.to(x.dtype), eps=eps)


def scalenorm_backward(x, norms, grad_y, scale, eps):
    gx, grad_scale = load().scalenorm_backward(x=x, norms=norms, grad_y=grad_y, scale=scale.to(x.dtype), eps=eps)
    return gx, grad_scale.reshape(()).to(scale.dtype)


def rmsnorm_forward(x, weight, eps):
    return load().rmsnorm_forward(x=x, weight=weight.to(x.dtype), eps=eps)


def rmsnorm_backward(x, rstd, grad_y, weight):
    gx, grad_w = load().rmsnorm_backward(x=x, rstd=rstd, grad_y=grad_y, weight=weight.to(x.dtype))
    return gx, grad_w.to(weight.dtype)


contract.check(sys.modules[__name__], "cpu")
