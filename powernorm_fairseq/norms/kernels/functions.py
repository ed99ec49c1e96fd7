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
from . import compiled, select
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
    w_offset: float = 0.0  # the gain is read as weight + w_offset (1: a unit-offset gain, --norm-unit-offset)


#: the updates of PN's warmup, whose steps advance its host clock (norms/clock.py)
_WARM = (Update.PN_WARM, Update.REFERENCE_WARM)


class ChannelConfig:
    """A BN, PN-V or PN module's step configuration: its constants and its
    running buffers (absent ones None), made once per module and made again
    when its buffers, settings or device change (``base.Norm.step_config``), and
    the compiled node's own copy of it per backend (``StepConfig``), made on
    the first eager step there. ``clock``: the key of PN's warmup clock
    (norms/clock.py), -1 for none; ``w_offset``: what the kernels add to the
    stored gain (1 for a unit-offset gain, else 0)."""

    __slots__ = ("center", "groups", "momentum", "eps", "sync", "warmup", "rate", "clock", "w_offset", "mean_buf",
                 "second_buf", "steps", "nu", "made", "made_as", "held")

    def __init__(self, *, center, groups, momentum, eps, sync, second_buf, mean_buf=None, steps=None, nu=None,
                 warmup=0, rate=0.0, clock=-1, w_offset=0.0):
        self.center, self.groups, self.momentum, self.eps, self.sync = center, groups, momentum, eps, sync
        self.warmup, self.rate, self.clock, self.w_offset = warmup, rate, clock, w_offset
        self.mean_buf, self.second_buf, self.steps, self.nu = mean_buf, second_buf, steps, nu
        self.made, self.made_as = None, None  # the node's StepConfig, and the passes it names
        self.held = ()  # every buffer of the module when this was made (base.Norm.step_config)

    def replayed(self) -> "ChannelConfig":
        """Activation checkpointing's recomputation: copies of the running statistics, no clock."""
        def clone(t):
            return None if t is None else t.clone()

        return ChannelConfig(center=self.center, groups=self.groups, momentum=self.momentum, eps=self.eps,
                             sync=self.sync, second_buf=clone(self.second_buf), mean_buf=clone(self.mean_buf),
                             steps=clone(self.steps), nu=self.nu, warmup=self.warmup, rate=self.rate,
                             w_offset=self.w_offset)

    def on(self, node, bound_as):
        """The node's StepConfig of this configuration on the passes ``bound_as`` (made once; a step reads
        ``made`` without a call)."""
        self.made = node.StepConfig(self.mean_buf, self.second_buf, self.steps, self.nu, GROUP_EPS, self.groups,
                                    self.center, self.momentum, self.eps, self.warmup, self.rate, self.w_offset,
                                    bound_as)
        self.made_as = bound_as
        return self.made


def channel_norm(x: Tensor, pad_mask, weight, bias, config: ChannelConfig, update: Update, mode: Mode,
                 given=None, replay: bool = False):
    """One training step of BN, PN-V or PN over x (T, B, C) with the
    module's ``config`` on the backend :func:`kernels.select` gives it: (y in
    x's dtype, the inv it normalised with). ``update`` and ``mode``: the
    running statistics' update and the backward of this step (PN's phase);
    ``given``: (mean or None, inv) the forward normalises with instead of the
    batch's (the causal mode's running statistics, a recomputation's first
    scale). ``replay``: activation checkpointing's recomputation, which gives
    the first forward's output again and updates copies of the running
    statistics.

    Two routes, the same passes in the same order. Eager, where nothing
    observes the call (``ops.observed``) and no workers synchronise: one C++
    autograd node (``csrc/steps.h``, ChannelStep) makes :class:`FusedChannelNorm`'s
    calls on the CPU kernels or the Triton path's passes (``csrc/gpu_passes.h``),
    with one call from Python each way and no Python in between (the host code
    between the kernels took longer than the kernels of a small layer). Graph:
    :class:`FusedChannelNorm`, each pass through its op (``ops.py``), which
    torch.compile, export, modes and --norm-sync's all-reduces see. Launches are
    counted or watched on either route by the launcher (``launcher.py``)."""
    k = select(x)
    xk = x if x.dtype in k.DTYPES else upcast(x)
    if replay:
        config = config.replayed()
    sync = config.sync if config.sync != "none" and sync_mod.active(config.sync) else "none"
    given_mean, given_inv = (None, None) if given is None else given
    tensors = (xk, pad_mask, weight, bias, config.mean_buf, config.second_buf, config.steps, config.nu, given_mean,
               given_inv)
    node = _eager(tensors) if sync == "none" and k.NAME != "plain" else None
    clock = config.clock if update in _WARM else -1
    if node is not None:  # one C++ autograd node (ChannelStep) around the backend's passes
        bound = _BOUND[k] if k in _BOUND else _bind(k, node)
        made = config.made if config.made_as == bound else config.on(node, bound)
        y, inv = node.channel_step(xk, pad_mask, weight, bias, made, update, mode, given_mean, given_inv)
        clocks.advance(clock, config.steps)  # as the finish_stats op does (ops.py)
        return (y if y.dtype == x.dtype else y.to(x.dtype)), inv
    x2 = rows(xk)
    mask = None if pad_mask is None else pad_mask.contiguous()
    step = Step(k.NAME, config.groups, config.center, update, mode, config.momentum, config.eps, config.warmup,
                config.rate, sync, clock, config.w_offset)
    # absent tensors as distinct empty ones (dynamo takes no input twice)
    y, inv = FusedChannelNorm.apply(x2, weight, bias, _none(x2, mask, torch.bool),
                                    *(_none(x2, t) for t in tensors[4:]), step)
    return _as(y.view(x2.shape), x), inv  # a view outside the function: in-place ops on y work


def _eager(values):
    """The compiled C++ module where a call with ``values`` takes the eager route: nothing observes it
    (``ops.observed``, which the module tests in one call) and it is not compiling (torch.compile's dynamo
    must see the ops); else None, the graph route."""
    if torch.compiler.is_compiling():
        return None
    node = compiled.NODE if compiled.NODE is not None else compiled.load()
    return node if node is not None and not node.observed(values) else None


#: backend module -> the passes its eager steps name in the C++ node: the CPU kernels' (-1), the Triton
#: path's (gpu.bind_node's)
_BOUND = {}


def _bind(k, node) -> int:
    _BOUND[k] = -1 if k.NAME == "cpu" else k.bind_node(node)
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
    def forward(ctx, x, weight, bias, mask, mean_buf, second_buf, steps, nu, given_mean, given_inv, s):
        """x: (T, B, C) rows (:func:`rows`); mask, the (B, T) padding mask or
        empty; mean_buf, second_buf: the running statistics (BN's mean or
        empty); steps: PN's step counter or empty; nu: PN's running nu or
        empty; given_mean, given_inv; s: the :class:`Step`."""
        if given_inv.numel():
            y, scale, part = _forward(s, x, mask, mean=given_mean, inv=given_inv, weight=weight, bias=bias,
                                      center=s.center)
            _, _, inv_batch, n, n_all = _statistics(s, part, mean_buf, second_buf, steps)
            # the given mean saved as it came (empty for none), as a recomputation (activation checkpointing)
            # must save what its first forward did
            mean, inv = given_mean, given_inv
        elif s.update.running_scale:
            y, scale, part = _forward(s, x, mask, inv=second_buf, inv_eps=s.eps, weight=weight, bias=bias)
            mean, inv, inv_batch, n, n_all = _statistics(s, part, mean_buf, second_buf, steps)
        else:
            _, _, part = _forward(s, x, mask, want_y=False, center=s.center)
            mean, inv, inv_batch, n, n_all = _statistics(s, part, mean_buf, second_buf, steps)
            y, scale, _ = _forward(s, x, mask, mean=mean, inv=inv, weight=weight, bias=bias, want_stats=False)
        ctx.save_for_backward(x, mask, scale, weight, mean, inv, inv_batch, n, n_all)
        ctx.step, ctx.nu = s, nu  # nu: a buffer the backward updates, not a saved value
        ctx.mark_non_differentiable(inv)
        ctx.set_materialize_grads(False)  # inv's gradient is never used: no zeros made for it
        return y, inv  # (N, C): the caller views it as x, a view autograd records

    @staticmethod
    def backward(ctx, grad_y, _):
        if grad_y is None:  # no gradient reached y (gradients are not materialised): nothing flows back
            return (None,) * 11
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
        return (grad_x.view_as(x), grad_w, grad_b) + (None,) * 8


def _none(like: Tensor, t, dtype=None) -> Tensor:
    return like.new_empty(0, dtype=dtype) if t is None else t


def _forward(s: Step, x, mask, *, mean=None, inv=None, inv_eps=-1.0, weight=None, bias=None, want_y=True,
             want_stats=True, center=False):
    """The contract's forward on the step's backend; absent tensors empty."""
    return P.forward(impl=s.backend, x=x, mask=mask, groups=s.groups, gs_eps=GROUP_EPS, mean=_none(x, mean),
                     inv=_none(x, inv), inv_eps=inv_eps, weight=_none(x, weight), w_offset=s.w_offset,
                     bias=_none(x, bias),
                     want_y=want_y, want_stats=want_stats, center=center)


def _backward(s: Step, x, mask, scale, grad_y, weight, mean, inv_fwd, *, inv_bwd=None, A=None, B=None,
              b_scale=1.0, correct_pads=False, want_gx=True, want_sums=True):
    """The contract's backward on the step's backend; absent tensors empty."""
    return P.backward(impl=s.backend, x=x, mask=mask, scale=scale, grad_y=grad_y, weight=weight,
                      w_offset=s.w_offset, mean=mean,
                      inv_fwd=inv_fwd, inv_bwd=_none(x, inv_bwd), A=_none(x, A), B=_none(x, B), b_scale=b_scale,
                      groups=s.groups, correct_pads=correct_pads, want_gx=want_gx, want_sums=want_sums)


def _backward_terms(s: Step, part, weight, n, n_all, nu, rows):
    """(grad_weight, grad_bias, A, B) and nu's update from the backward's part."""
    if s.sync != "none":
        return _synced_terms(s, part, weight, n, n_all, nu, exact=s.mode == Mode.EXACT)
    kind = Mode.PAPER if s.mode == Mode.FIXED else s.mode  # nu follows Algorithm 2
    return P.finish_backward(impl=s.backend, part=part, weight=weight, w_offset=s.w_offset, n=n, nu=nu,
                             rate=s.rate, kind=kind,
                             center=s.center, rows=rows)


def first_derivative_only(kinds: str, grad_y: Tensor):
    """The fused backwards compute no graph of their own: a backward asked for
    one (``create_graph=True`` through this norm) is refused, on every backend."""
    if torch.is_grad_enabled() and grad_y.requires_grad:
        verb = "have" if " and " in kinds else "has"
        raise RuntimeError(f"{kinds} {verb} no second derivative here (a backward with create_graph=True went "
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
    w = weight.double() + s.w_offset
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


_ROW_INDEX = {}  # a row kind's name -> its index in the compiled module (csrc/cpu_rows.h's kRowKinds)


def row_norm(kind, x: Tensor, params: tuple, eps=None, w_offset: float = 0.0) -> Tensor:
    """Per-row or per-entry ``kind`` (a contract.RowKind) over the rows of x (T, B, C) with its
    ``params``, its gain read as gain + ``w_offset`` (a unit-offset gain's 1 + gamma), on the backend that
    takes x, in a dtype that backend reads; y in x's dtype. The eager route: one C++ autograd node (RowStep) around the
    backend's passes; the graph route: :class:`FusedRowNorm`, each pass through its op."""
    k = select(x)
    xk = x if x.dtype in k.DTYPES else upcast(x)
    node = _eager((xk, *params)) if k.NAME != "plain" else None
    if node is not None:
        p = params + (None, None, None)
        bound = _BOUND[k] if k in _BOUND else _bind(k, node)
        index = _ROW_INDEX[kind.name] if kind.name in _ROW_INDEX else _ROW_INDEX.setdefault(
            kind.name, node.row_kind_index(kind.name))
        y = node.row_step(index, xk, p[0], p[1], p[2], p[3], 0.0 if eps is None else eps, w_offset, bound)
    else:
        xk = xk if xk.stride(-1) == 1 else xk.contiguous()  # as rows(): channels adjacent, rows anywhere
        y = FusedRowNorm.apply(xk, (kind, eps, k.NAME, w_offset), *params).view(xk.shape)  # (N, C), viewed outside
    return y if y.dtype == x.dtype else y.to(x.dtype)


class FusedRowNorm(torch.autograd.Function):
    """A per-row or per-entry kind (``how``: (its contract.RowKind, eps, the
    backend's name, the gain's offset)) in one pass each way, each through its op."""

    @staticmethod
    def forward(ctx, x, how, *params):
        kind, eps, backend, w_offset = how
        y, stat = P.row_forward(impl=backend, kind=kind.name, x=x, params=list(params), w_offset=w_offset,
                                eps=_eps(eps))
        ctx.save_for_backward(x, stat, *params)
        ctx.how = how
        return y  # (N, C), as FusedChannelNorm's

    @staticmethod
    def backward(ctx, grad_y):
        kind, eps, backend, w_offset = ctx.how
        x, stat, *params = ctx.saved_tensors
        if grad_y.requires_grad and torch.is_grad_enabled():  # a backward that builds a graph
            if kind.twice is None:
                first_derivative_only(kind.name, grad_y)
            grad_x, *grads = kind.twice(x, grad_y, *kind.shifted(params, w_offset))
            return (grad_x, None, *(g.to(p.dtype) for g, p in zip(grads, params)))
        grad_x, *grads = P.row_backward(impl=backend, kind=kind.name, x=x, stat=stat, grad_y=grad_y.contiguous(),
                                        params=params, w_offset=w_offset, eps=_eps(eps))
        return (grad_x.view_as(x), None, *grads)


def _eps(eps) -> float:
    """A kind's eps as the contract takes it (0 for one without)."""
    return 0.0 if eps is None else eps
