"""The fused norms as autograd functions, on whichever backend the dispatch
chose (``k``: the CPU C++ kernels or the GPU kernels, one interface): the same
math as the plain PyTorch code of each norm, in one or two passes over memory
per direction instead of one per elementary op.

With xs the input after the optional group scaling, N the real tokens and
xh = (xs - mean) * inv, every backward here is

    dL/dxs = (g - m * (A + B * xh)) * inv_bwd,   g = gamma * dL/dy,

with m = 1 at real tokens (and at padding only for the released code's
backward), and per mode:

* ``exact`` (BN, PN-V, PN during warmup; paper Eq. 3 and 6): inv from the batch,
  A = mean(g) for BN (0 without centring), B = mean(g * xh), the means taken
  over N with sums over every position, as autograd of the masked statistics
  gives. A first pass sums, a second applies.
* ``paper`` (Algorithm 2): A = 0, B = nu_{t-1}, inv the running one.
* ``reference`` (the released code): A = 0, B = (1 - alpha_bwd) * nu, padding
  included, inv_bwd from the batch statistic.
* ``fixed`` (the causal mode's running statistics): A = B = 0, the statistics
  constants of the gradient; PN's nu still follows Algorithm 2.

Every backward here gives first derivatives only: a backward asked to build
a graph through one of these norms (``create_graph=True``) raises, on every
backend.

Per-channel vectors are kept in the statistics dtype (float32 for half
inputs), activations in their own; per-program sums are added in float64.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from .. import sync as sync_mod
from .. import clock as clocks
from ..stats import GROUP_EPS, update_nu, upcast
from . import ops  # registers torch.ops.powernorm
from . import cpu, launcher, select
from .contract import Mode, Update

P = ops.CALLS


class Step(NamedTuple):
    """What one :class:`FusedChannelNorm` call does beyond its tensors."""

    backend: str  # "plain", "cpu" or "triton" (ops.py)
    groups: int  # group scaling of each row in this many channel groups (0: none)
    center: bool  # subtract the mean (BN), or not (PN-V, PN)
    update: Update  # how the running statistics are updated
    mode: Mode  # which backward (module doc)
    momentum: float  # of the running statistics' EMA
    eps: float
    warmup: int = 0  # the released PN's warmup (reference updates)
    rate: float = 0.0  # PN's 1 - alpha_bwd
    sync: str = "none"  # --norm-sync where workers are synchronised: "batch" or "running" (sync.py)
    clock: int = -1  # the key of PN's warmup clock, advanced once the step is committed (norms/clock.py)
    #: the backend's passes (``gpu.DIRECT``), called directly where nothing observed the forward (absent
    #: tensors None both ways); else None, and each call goes through its op (``ops.py``), which compile,
    #: export and modes see
    direct: object = None
    #: the direct path's tensors that take no gradient (mask, buffers, given statistics): autograd's
    #: ``apply`` costs the host a little for each argument, and these need nothing of it
    rest: tuple = ()


def channel_norm(x: Tensor, pad_mask, weight, bias, *, update: Update, mode: Mode, center: bool, groups: int,
                 momentum: float, eps: float, sync: str, second_buf: Tensor, mean_buf=None, steps=None, nu=None,
                 given_mean=None, given_inv=None, warmup: int = 0, rate: float = 0.0, clock: int = -1,
                 replay: bool = False):
    """One training step of BN, PN-V or PN over x (T, B, C) on the backend
    :func:`kernels.select` gives it: (y in x's dtype, the inv it normalised
    with). ``replay``: activation checkpointing's recomputation, which gives
    the first forward's output again (with its ``given_*`` statistics) and
    updates copies of the running statistics.

    Where nothing observes the call (``ops.observed``) and no workers
    synchronise, the step is one C++ autograd node (``csrc/steps.h``,
    ChannelStep) that makes :class:`FusedChannelNorm`'s calls: the same passes
    in the same order, the CPU kernels' own or the Triton path's, planned and
    launched by the node itself (``csrc/gpu_passes.h``; gpu.py's DIRECT, bound
    once, where launches are watched), with one call from Python each way and
    no Python in between (the host code between the kernels took longer than
    the kernels of a small layer). Without the compiled module (no
    compiler), :class:`FusedChannelNorm` calls the passes directly."""
    k = select(x)
    xk = x if x.dtype in k.DTYPES else upcast(x)
    if replay:
        mean_buf, second_buf, steps = (None if t is None else t.clone() for t in (mean_buf, second_buf, steps))
    sync, clock = sync if sync != "none" and sync_mod.active(sync) else "none", -1 if replay else clock
    tensors = (xk, pad_mask, weight, bias, mean_buf, second_buf, steps, nu, given_mean, given_inv)
    quiet, node = _quiet(tensors) if sync == "none" and k.NAME != "plain" else (False, None)
    if quiet and node is not None:  # one C++ autograd node (ChannelStep) around the backend's passes
        bound = _BOUND[k] if k in _BOUND else _bind(k, node)
        bound_as = bound[0] if launcher.HOLD and not launcher.OBSERVERS else bound[1]
        y, inv = node.channel_step(*tensors, GROUP_EPS, groups, center, update, mode, momentum, eps, warmup, rate,
                                   bound_as)  # absent tensors as None; x and the mask as they are
        clocks.advance(clock, steps)  # as the finish_stats op does (ops.py)
        return (y if y.dtype == x.dtype else y.to(x.dtype)), inv
    x2 = rows(xk)
    mask = None if pad_mask is None else pad_mask.contiguous()
    tensors = (x2, mask, *tensors[2:])
    if quiet:
        # no C++ node (no compiler): the passes called from the autograd function without the ops' round trip
        step = Step(k.NAME, groups, center, update, mode, momentum, eps, warmup, rate, sync, clock, k.DIRECT,
                    (mask, *tensors[4:]))
        y, inv = FusedChannelNorm.direct_apply(x2, weight, bias, step)
    else:  # absent tensors as distinct empty ones (dynamo takes no input twice)
        step = Step(k.NAME, groups, center, update, mode, momentum, eps, warmup, rate, sync, clock)
        y, inv = FusedChannelNorm.apply(x2, weight, bias, _none(x2, mask, torch.bool),
                                        *(_none(x2, t) for t in tensors[4:]), step)
    return _as(y.view(x2.shape), x), inv  # a view outside the function: in-place ops on y work


def _quiet(values) -> tuple:
    """(whether nothing observes a call with ``values``, ``ops.observed``; the
    compiled C++ module, or None): the module tests what ``ops.observed`` does
    in one call (Python's is a call each), but for torch.compile, which dynamo
    must see in Python, and which loads nothing (a load reads files)."""
    if torch.compiler.is_compiling():
        return False, None
    node = cpu.NODE if cpu.NODE is not None else cpu.load()
    return not (ops.observed(values) if node is None else node.observed(values)), node


#: backend module -> the indices its passes are bound under in the C++ nodes: (where nothing watches the
#: launches, where something does: launcher.OBSERVERS, or launcher.HOLD False); the CPU kernels' own: -1
_BOUND = {}


def _bind(k, node) -> tuple:
    """Bind backend ``k``'s passes into the C++ nodes, once: its Python
    passes (ChannelStep's, ``DIRECT``, and RowStep's), each launch through
    launcher.py; and the Triton path's passes in C++ (``gpu.bind_node``),
    which plan and launch a step with no Python, where compiled kernels run."""
    if k.NAME == "cpu":
        _BOUND[k] = (-1, -1)
        return _BOUND[k]
    watched = node.bind_passes(
        k.DIRECT.forward, k.DIRECT.finish_stats, k.DIRECT.backward, k.DIRECT.finish_backward, k.scalenorm_forward,
        k.scalenorm_backward, k.rmsnorm_forward, k.rmsnorm_backward, k.dyt_forward, k.dyt_backward)
    direct = k.bind_node(node) if hasattr(k, "bind_node") else None
    _BOUND[k] = (watched if direct is None else direct, watched)
    return _BOUND[k]


class FusedChannelNorm(torch.autograd.Function):
    """One training step of BN, PN-V or PN: y = (xs - mean) * inv * gamma +
    beta with the running statistics updated, and the backward of ``step.mode``.

    Launches per forward + backward: after PN's warmup, 2 + 2 (the forward
    normalises with psi^2_{t-1} while it sums psi_B^2; the backward reads
    nu_{t-1}); otherwise 3 + 3 (statistics, then normalising; sums, then the
    gradient). Each pass is followed, or separated, by one small kernel that
    reduces the per-program sums in a fixed order and updates the running
    statistics (``finish_stats``, ``finish_backward``). Nothing is read back to
    the host: the real-token count stays on the device.

    ``given_mean`` and ``given_inv`` (empty when not given) fix the statistics
    the forward normalises with, in one pass that still sums the batch's for
    the running update: the causal mode's running statistics, or a
    recomputation's replay of the scale its first forward used. Returns y and
    the inv it normalised with (not differentiable).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, *args):
        """x: (T, B, C) rows (:func:`rows`); args: the step (:class:`Step`)
        alone where nothing observes it, its other tensors then in
        ``step.rest`` (autograd's ``apply`` costs the host a little for each
        argument, and these take no gradient); else those tensors first:
        mask, the (B, T) padding mask or empty; mean_buf, second_buf: the
        running statistics (BN's mean or empty); steps: PN's step counter or
        empty; nu: PN's running nu or empty; given_mean, given_inv."""
        *tensors, s = args
        mask, mean_buf, second_buf, steps, nu, given_mean, given_inv = tensors or s.rest
        if given_inv is not None and given_inv.numel():
            y, scale, part = _forward(s, x, mask, mean=given_mean, inv=given_inv, weight=weight, bias=bias,
                                      center=s.center)
            _, _, inv_batch, n, n_all = _statistics(s, part, mean_buf, second_buf, steps)
            # an absent mean saved as the statistics' own (the ops' empty one, the direct path's None), as a
            # recomputation (activation checkpointing) must save what its first forward did
            mean, inv = given_mean if given_mean is not None or s.direct is not None else x.new_empty(0), given_inv
        elif s.update.running_scale:
            y, scale, part = _forward(s, x, mask, inv=second_buf, inv_eps=s.eps, weight=weight, bias=bias)
            mean, inv, inv_batch, n, n_all = _statistics(s, part, mean_buf, second_buf, steps)
        else:
            _, _, part = _forward(s, x, mask, want_y=False, center=s.center)
            mean, inv, inv_batch, n, n_all = _statistics(s, part, mean_buf, second_buf, steps)
            y, scale, _ = _forward(s, x, mask, mean=mean, inv=inv, weight=weight, bias=bias, want_stats=False)
        ctx.save_for_backward(x, mask, scale, weight, mean, inv, inv_batch, n, n_all)
        ctx.step, ctx.nu, ctx.rest = s, nu, len(args)  # nu: a buffer the backward updates, not a saved value
        ctx.mark_non_differentiable(inv)
        ctx.set_materialize_grads(False)  # inv's gradient is never used: no zeros made for it
        return y, inv  # (N, C): the caller views it as x, a view autograd records

    @staticmethod
    def backward(ctx, grad_y, _):
        if grad_y is None:  # no gradient reached y (gradients are not materialised): nothing flows back
            return (None,) * (3 + ctx.rest)
        if grad_y.requires_grad:  # only a backward that builds a graph: no call otherwise
            first_derivative_only("bn, pn-v and pn", grad_y)
        x, mask, scale, weight, mean, inv, inv_batch, n, n_all = ctx.saved_tensors
        s, nu, gy = ctx.step, ctx.nu, grad_y.contiguous()
        saved = dict(x=x, mask=mask, scale=scale, grad_y=gy, weight=weight, mean=mean, inv_fwd=inv)
        if s.mode == Mode.EXACT:  # the batch terms of Eq. 3 / Eq. 6 first, then the gradient
            _, part = _backward(s, **saved, want_gx=False)
            grad_w, grad_b, A, B = _backward_terms(s, part, weight, n, n_all, nu, x.numel() // x.size(-1))
            grad_x, _ = _backward(s, **saved, inv_bwd=inv, A=A, B=B, want_sums=False)
        else:
            # B = nu_{t-1} (Algorithm 2), (1 - alpha_bwd) nu over every position (the released code),
            # or none: statistics that did not come from this batch (FIXED) are constants of the gradient
            reference = s.mode == Mode.REFERENCE
            grad_x, part = _backward(s, **saved, inv_bwd=inv_batch if reference else inv,
                                     B=nu if s.mode != Mode.FIXED else None, b_scale=s.rate if reference else 1.0,
                                     correct_pads=reference)
            grad_w, grad_b, _, _ = _backward_terms(s, part, weight, n, n_all, nu, x.numel() // x.size(-1))
        return (grad_x.view_as(x), grad_w, grad_b) + (None,) * ctx.rest


def _none(like: Tensor, t, dtype=None) -> Tensor:
    return like.new_empty(0, dtype=dtype) if t is None else t


def _forward(s: Step, x, mask, *, mean=None, inv=None, inv_eps=-1.0, weight=None, bias=None, want_y=True,
             want_stats=True, center=False):
    """The contract's forward on the step's backend; absent tensors empty."""
    if s.direct is not None:
        return s.direct.forward(x, mask, s.groups, GROUP_EPS, mean, inv, inv_eps, weight, bias, want_y, want_stats,
                                center)
    return P.forward(impl=s.backend, x=x, mask=mask, groups=s.groups, gs_eps=GROUP_EPS, mean=_none(x, mean),
                     inv=_none(x, inv), inv_eps=inv_eps, weight=_none(x, weight), bias=_none(x, bias),
                     want_y=want_y, want_stats=want_stats, center=center)


def _backward(s: Step, x, mask, scale, grad_y, weight, mean, inv_fwd, *, inv_bwd=None, A=None, B=None,
              b_scale=1.0, correct_pads=False, want_gx=True, want_sums=True):
    """The contract's backward on the step's backend; absent tensors empty."""
    if s.direct is not None:
        return s.direct.backward(x, mask, scale, grad_y, weight, mean, inv_fwd, inv_bwd, A, B, b_scale, s.groups,
                                 correct_pads, want_gx, want_sums)
    return P.backward(impl=s.backend, x=x, mask=mask, scale=scale, grad_y=grad_y, weight=weight, mean=mean,
                      inv_fwd=inv_fwd, inv_bwd=_none(x, inv_bwd), A=_none(x, A), B=_none(x, B), b_scale=b_scale,
                      groups=s.groups, correct_pads=correct_pads, want_gx=want_gx, want_sums=want_sums)


def _backward_terms(s: Step, part, weight, n, n_all, nu, rows):
    """(grad_weight, grad_bias, A, B) and nu's update from the backward's part."""
    if s.sync != "none":
        return _synced_terms(s, part, weight, n, n_all, nu, exact=s.mode == Mode.EXACT)
    kind = Mode.PAPER if s.mode == Mode.FIXED else s.mode  # nu follows Algorithm 2
    if s.direct is not None:
        return s.direct.finish_backward(part, weight, n, nu, s.rate, kind, s.center, rows)
    return P.finish_backward(impl=s.backend, part=part, weight=weight, n=n, nu=nu, rate=s.rate, kind=kind,
                             center=s.center, rows=rows)


def first_derivative_only(kinds: str, grad_y: Tensor):
    """The fused backwards compute no graph of their own: a backward asked for
    one (``create_graph=True`` through this norm) is refused, on every backend."""
    if torch.is_grad_enabled() and grad_y.requires_grad:
        raise RuntimeError(f"{kinds} have no second derivative here (a backward with create_graph=True went "
                           "through one): use ln, layernorm-simple or none for double backward")


def _statistics(s: Step, part, mean_buf, second_buf, steps):
    """(mean, inv, inv of the batch, n for the gradient, n of the global
    batch) from ``forward``'s part, the running statistics updated. Under
    --norm-sync the workers' counts and sums are added in one all-reduce and
    the running statistics follow the global batch; ``running`` normalises
    each worker's batch with its own statistics."""
    if s.sync == "none":
        mean, inv, inv_batch, n = _finish_stats(s, part, mean_buf, second_buf, steps)
        return mean, inv, inv_batch, n, n
    local = _totals(_rows_of(part, s))
    mean, inv, inv_batch, n_all = _finish_stats(s, _as_part(sync_mod.all_sum(local), s), mean_buf, second_buf, steps)
    if s.sync == "batch" or s.update.running_scale or s.mode == Mode.FIXED:  # the forward used running ones
        return mean, inv, inv_batch, n_all, n_all
    n = local[:1]
    real, ns = n > 0, n.clamp(min=1)
    C = part.size(-1)
    local_mean = local[1:C + 1] / ns
    second = local[C + 1:] / ns - (local_mean ** 2 if s.center else 0)
    sd = second_buf.dtype
    inv = torch.where(real, torch.rsqrt(second.clamp(min=0) + s.eps), torch.rsqrt(second_buf.double() + s.eps))
    if s.center:
        mean = torch.where(real, local_mean, mean_buf.double()).to(sd)
    return mean, inv.to(sd), inv_batch, n, n_all


def _finish_stats(s: Step, part, mean_buf, second_buf, steps):
    if s.direct is not None:
        out = s.direct.finish_stats(part, mean_buf, second_buf, steps, s.update, s.momentum, s.eps, s.warmup)
        clocks.advance(s.clock, steps)  # as the finish_stats op does (ops.py)
        return out
    return P.finish_stats(impl=s.backend, part=part, mean_buf=mean_buf, second_buf=second_buf, steps=steps,
                          update=s.update, momentum=s.momentum, eps=s.eps, warmup=s.warmup, clock=s.clock)


def _rows_of(part: Tensor, s: Step) -> Tensor:
    """The per-program rows of a part, without the backend's ticket rows."""
    tickets = ops.backend(s.backend).TICKET_ROWS
    return part[:part.size(0) - tickets] if tickets else part


def _totals(part: Tensor) -> Tensor:
    """(count, sum, sum of squares) over this worker's real rows from
    ``forward``'s per-program part, float64, packed (2C + 1,) for one all-reduce."""
    p = part.double()
    count = p[:, 0]
    return torch.cat([count[:, :1].sum(0), (count * p[:, 1]).sum(0), (p[:, 2] + count * p[:, 1] ** 2).sum(0)])


def _as_part(totals: Tensor, s: Step) -> Tensor:
    """:func:`_totals` of the global batch as one row of ``forward``'s part:
    count, mean, sum of squared deviations (and the backend's zeroed ticket rows)."""
    C = (totals.numel() - 1) // 2
    n, s1, s2 = totals[:1], totals[1:C + 1], totals[C + 1:]
    mean = s1 / n.clamp(min=1)
    row = torch.stack([n.expand(C), mean, s2 - s1 * mean]).unsqueeze(0)
    tickets = ops.backend(s.backend).TICKET_ROWS  # a ticket set to 0
    return torch.cat([row, row.new_zeros(tickets, 3, C)]) if tickets else row


def _synced_terms(s: Step, part, weight, n, n_all, nu, exact: bool):
    """Under --norm-sync: this worker's weight and bias gradients, the exact
    gradient's A and B (of the global batch under ``batch``), and nu's
    Algorithm-2 update over the global batch, with one all-reduce."""
    sums = _rows_of(part, s).double().sum(0)
    w = weight.double()
    # the rows all workers add (a slice: indexing by a list would copy it to the device)
    first, last = (0 if exact and s.sync == "batch" else 2), (4 if nu.numel() else 2)
    total = dict(zip(range(first, last), sync_mod.all_sum(sums[first:last]))) if first < last else {}
    sd = nu.dtype if nu.numel() else (torch.float64 if weight.dtype == torch.float64 else torch.float32)
    A, B = weight.new_empty(0, dtype=sd), weight.new_empty(0, dtype=sd)
    if exact:  # Eq. 3 / Eq. 6 over the global batch, or over this worker's (running)
        terms, count = (total, n_all) if s.sync == "batch" else ({0: sums[0], 1: sums[1]}, n)
        B = (w * terms[0] / count.clamp(min=1)).to(sd)
        if s.center:
            A = (w * terms[1] / count.clamp(min=1)).to(sd)
    if nu.numel():  # Algorithm 2: Lambda_t and Gamma_t of the global batch
        count = n_all.clamp(min=1)
        update_nu(nu, s.rate, gamma_t=total[3] / count, lambda_t=w * total[2] / count)
    return sums[0].to(weight.dtype, copy=True), sums[1].to(weight.dtype, copy=True), A, B


def rows(x: Tensor) -> Tensor:
    """x (T, B, C) as every backend takes it: where it lies, at any row strides
    (fairseq's residual stream is the transposed view of a (B, T, C) tensor),
    copied only if its channels are not adjacent. The backends' (N, C)
    results, rows r = t * B + b, are given back in x's shape by the autograd
    functions (a view made there is not one autograd records); the padding
    mask goes to them as a contiguous (B, T) bool tensor, or empty for none."""
    return x if x.stride(2) == 1 else x.contiguous()


def _as(y: Tensor, x: Tensor) -> Tensor:
    """y in x's dtype (a cast only where they differ: even a no-op ``to`` is an autograd call)."""
    return y if y.dtype == x.dtype else y.to(x.dtype)


def row_norm(fused, x: Tensor, params: tuple, eps=None) -> Tensor:
    """A per-row or per-entry norm's autograd Function ``fused``
    (FusedScaleNorm, FusedRMSNorm or FusedDyT) over the rows of x (T, B, C)
    with its ``params``, on the backend that takes x, in a dtype that backend
    reads; y in x's dtype."""
    k = select(x)
    xk = x if x.dtype in k.DTYPES else upcast(x)
    # where nothing observes the call: one C++ autograd node (RowStep) around the backend's passes
    quiet, node = _quiet((xk, *params)) if k.NAME != "plain" else (False, None)
    if quiet and node is not None:
        p = params + (None, None)
        bound = _BOUND[k] if k in _BOUND else _bind(k, node)
        bound_as = bound[0] if launcher.HOLD and not launcher.OBSERVERS else bound[1]
        y = node.row_step(fused.ROW_KIND, xk, p[0], p[1], p[2], 0.0 if eps is None else eps, bound_as)
    else:  # each call through its op (no compiled module: the backend's own functions)
        xk = xk if xk.stride(-1) == 1 else xk.contiguous()  # as rows(): channels adjacent, rows anywhere
        y = (fused.direct_apply(xk, *params, (eps, k)) if quiet
             else fused.apply(xk, *params, (eps, k.NAME))).view(xk.shape)  # (N, C) rows, viewed outside
    return y if y.dtype == x.dtype else y.to(x.dtype)


class FusedScaleNorm(torch.autograd.Function):
    """ScaleNorm in one pass each way. ``how``: (eps, backend), the backend a
    name (each call through its op) or, where nothing observes the call, its module."""

    ROW_KIND = 0  # csrc/steps.h's RowKind, for RowStep, the same step as one C++ node

    @staticmethod
    def forward(ctx, x, scale, how):
        eps, backend = how
        y, norms = (P.scalenorm_forward(impl=backend, x=x, scale=scale, eps=eps) if type(backend) is str
                    else backend.scalenorm_forward(x, scale, eps))
        ctx.save_for_backward(x, norms, scale)
        ctx.eps, ctx.backend = eps, backend
        return y  # (N, C), as FusedChannelNorm's

    @staticmethod
    def backward(ctx, grad_y):
        if grad_y.requires_grad:  # only a backward that builds a graph: no call otherwise
            first_derivative_only("scalenorm", grad_y)
        x, norms, scale = ctx.saved_tensors
        gy = grad_y.contiguous()
        grad_x, grad_scale = (
            P.scalenorm_backward(impl=ctx.backend, x=x, norms=norms, grad_y=gy, scale=scale, eps=ctx.eps)
            if type(ctx.backend) is str else ctx.backend.scalenorm_backward(x, norms, gy, scale, ctx.eps))
        return grad_x.view_as(x), grad_scale, None


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm in one pass each way."""

    ROW_KIND = 1

    @staticmethod
    def forward(ctx, x, weight, how):
        eps, backend = how
        y, rstd = (P.rmsnorm_forward(impl=backend, x=x, weight=weight, eps=eps) if type(backend) is str
                   else backend.rmsnorm_forward(x, weight, eps))
        ctx.save_for_backward(x, rstd, weight)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if grad_y.requires_grad:  # only a backward that builds a graph: no call otherwise
            first_derivative_only("rmsnorm", grad_y)
        x, rstd, weight = ctx.saved_tensors
        gy = grad_y.contiguous()
        grad_x, grad_weight = (P.rmsnorm_backward(impl=ctx.backend, x=x, rstd=rstd, grad_y=gy, weight=weight)
                               if type(ctx.backend) is str else ctx.backend.rmsnorm_backward(x, rstd, gy, weight))
        return grad_x.view_as(x), grad_weight, None


class FusedDyT(torch.autograd.Function):
    """DyT in one pass each way: tanh(alpha x) is computed again in the
    backward, so only x is kept. A backward that builds a graph
    (``create_graph=True``) takes the same formula in PyTorch ops, which
    autograd differentiates again: DyT keeps its second derivative."""

    ROW_KIND = 2

    @staticmethod
    def forward(ctx, x, alpha, weight, bias, how):
        _, backend = how
        y, ticket = (P.dyt_forward(impl=backend, x=x, alpha=alpha, weight=weight, bias=bias) if type(backend) is str
                     else backend.dyt_forward(x, alpha, weight, bias))
        ctx.save_for_backward(x, alpha, weight, ticket)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, alpha, weight, ticket = ctx.saved_tensors
        if grad_y.requires_grad and torch.is_grad_enabled():  # a graph of the gradient: PyTorch ops
            grad_y = grad_y.view_as(x)  # y's rows in x's shape
            t = torch.tanh(alpha * x)
            d = grad_y * weight * (1 - t * t)
            rows = tuple(range(x.dim() - 1))
            return d * alpha, (d * x).sum(), (grad_y * t).sum(rows), grad_y.sum(rows), None
        gy = grad_y.contiguous()
        gx, grad_alpha, grad_w, grad_b = (
            P.dyt_backward(impl=ctx.backend, x=x, grad_y=gy, alpha=alpha, weight=weight, ticket=ticket)
            if type(ctx.backend) is str else ctx.backend.dyt_backward(x, gy, alpha, weight, ticket))
        return gx.view_as(x), grad_alpha, grad_w, grad_b, None


def _without_wrapper(function):
    """``function.apply`` as autograd's own C++ ``apply``, without
    torch.autograd.Function's Python wrapper (1.4 us of a small layer's 22 us
    step on the CPU). For the direct paths alone: there ``ops.observed`` has
    ruled out functorch's transforms, the one case the wrapper routes
    elsewhere (it also binds default arguments, which these functions have
    none of)."""
    return super(torch.autograd.Function, function).apply


for _function in (FusedChannelNorm, FusedScaleNorm, FusedRMSNorm, FusedDyT):
    _function.direct_apply = _without_wrapper(_function)
