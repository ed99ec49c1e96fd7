"""The plain backend: the kernel contract (``contract.py``) in PyTorch operations.

It runs on any device and dtype (half inputs computed in float32), reads
nothing back to the host, and is what ``POWERNORM_KERNELS=0`` runs: every
training step of BN, PN-V and PN takes the same route on every backend
(``functions.py``), so the backends can differ only in their arithmetic. The
sums are taken in float64 over all rows at once (one "program"); the math of
each entry point is written beside the C++ one (``csrc/cpu_channel.h``, ``csrc/cpu_rows.h``).
"""

import sys

import torch

from . import contract
from .contract import Mode, Update

NAME = "plain"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
failure = None


def available() -> bool:
    return True


def takes(x: torch.Tensor) -> bool:
    return True


TICKET_ROWS, ROW_TICKET = 0, 0  # the GPU kernels' arrival tickets (gpu.py); none here


def parts(x, groups, kernel, tall):
    """(rows, dtype) of the per-program statistics: one row, float64."""
    return 1, torch.float64


def _rows(x):
    """(N, the dimensions x's rows span). x is read where it lies: (N, C) rows,
    or (T, B, C) at any row strides, rows r = t * B + b; each result is a new
    (N, ...) tensor in that row order."""
    return x.numel() // x.size(-1), tuple(range(x.dim() - 1))


def _into(x):
    """A new (N, C) result in x's row order, and its view in x's shape (for ``out=``)."""
    out = x.new_empty(x.numel() // x.size(-1), x.size(-1))
    return out, out.view(x.shape)


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _keep(mask, x):
    """Float64 weights in x's leading shape, (..., 1): 1 at the real rows (r = t * B + b), 0 at padding."""
    shape = (*x.shape[:-1], 1)
    if mask.numel() == 0:
        return torch.ones(shape, dtype=torch.float64, device=x.device)
    return (~mask).t().reshape(shape).to(torch.float64)


def _gain(weight, w_offset, like):
    """The gain as the kernels read it, weight + w_offset (a unit-offset gain's 1 + gamma), in like's dtype."""
    return weight.to(like) + w_offset if w_offset else weight.to(like)


def _channels(t, C, like):
    return t.to(like) if t.numel() else torch.zeros(C, dtype=like.dtype, device=like.device)


def _scaled(x, groups, gs_eps, scale=None):
    """(xs, group scales (..., G) in x's leading shape, or empty): the released
    code's per-token RMS scaling of each group; ``scale``: the (N, G) ones to use."""
    xa = x.to(_acc(x))
    if groups <= 0:
        return xa, x.new_empty(0)
    xg = xa.unflatten(-1, (groups, -1))
    if scale is None or scale.numel() == 0:
        r = torch.rsqrt(xg.pow(2).mean(-1) + gs_eps)
    else:
        r = scale.view(*x.shape[:-1], groups)
    return (xg * r.unsqueeze(-1)).flatten(-2), r


def forward(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, w_offset, bias, want_y, want_stats, center):
    N, rows = _rows(x)
    C = x.size(-1)
    xs, scale = _scaled(x, groups, gs_eps)
    y, part = x.new_empty(0), x.new_empty(0, dtype=torch.float64)
    if want_y:
        iv = inv.to(xs.dtype) if inv_eps < 0 else running_scale(inv, inv_eps).to(xs.dtype)
        centred = xs - mean.to(xs) if mean.numel() else xs
        y, out = _into(x)
        torch.add(centred * (iv * _gain(weight, w_offset, xs)), bias.to(xs), out=out)
    if want_stats:
        keep = _keep(mask, x)
        xd = xs.double()
        count = keep.sum()
        if center:
            mu = (xd * keep).sum(rows) / count.clamp(min=1)
            second = (((xd - mu) * keep) ** 2).sum(rows)
        else:
            mu, second = xd.new_zeros(C), ((xd * keep) ** 2).sum(rows)
        part = torch.stack([count.expand(C), mu, second]).unsqueeze(0)
    return y, scale.reshape(N, groups) if groups > 0 else x.new_empty(0), part


def running_scale(second, eps):
    """1 / sqrt(second + eps) of a running second moment, computed in float64
    and rounded to its dtype: the scale ``finish_stats`` returns for it, bit for bit."""
    return torch.rsqrt(second.double() + eps).to(second.dtype)


def finish_stats(part, mean_buf, second_buf, steps, update, momentum, eps, warmup):
    p = part.double()
    count = p[:, 0]
    n = count[:, :1].sum(0)  # (1,)
    ns, real = n.clamp(min=1), n > 0
    mean = (count * p[:, 1]).sum(0) / ns
    update = Update(update)  # a ValueError names an unknown one
    bn = update == Update.BN
    if bn:  # Chan et al.'s pairwise formula: each part's M2 plus its mean's spread
        second = ((p[:, 2] + count * (p[:, 1] - mean) ** 2).sum(0) / ns).clamp(min=0)
    else:
        second = p[:, 2].sum(0) / ns
    old = second_buf.double()
    k = steps.double() + 1 if steps.numel() else torch.ones((), dtype=torch.float64, device=part.device)
    if bn:
        new = torch.where(n > 1, old + momentum * (second * n / (n - 1).clamp(min=1) - old), old)
    elif update in (Update.PN_V, Update.PN):  # Algorithm 2: psi_t^2 = alpha psi_{t-1}^2 + (1 - alpha) psi_B^2
        new = old + momentum * (second - old)
    elif update == Update.PN_WARM:  # cumulative mean
        new = old * ((k - 1) / k) + second / k
    else:  # the released PN: a cumulative mean before the warmup ends, an EMA on top
        new = torch.where(k < warmup, old * ((k - 1) / k) + second / k, old)
        new = new + momentum * (second - new)
    finite = torch.isfinite(second).all()
    if bn:
        finite = finite & torch.isfinite(mean).all()
    commit = real & finite
    sd = second_buf.dtype
    inv_batch = torch.where(real, torch.rsqrt(second + eps), torch.rsqrt(old + eps)).to(sd)
    inv = running_scale(second_buf, eps) if update.running_scale else inv_batch
    out_mean = torch.empty(0, dtype=sd, device=part.device)
    if bn:
        old_mean = mean_buf.double()
        out_mean = torch.where(real, mean, old_mean).to(sd)
        mean_buf.copy_(torch.where(commit, old_mean + momentum * (mean - old_mean), old_mean))
    second_buf.copy_(torch.where(commit, new, old))
    if steps.numel():
        steps.add_(real.to(steps.dtype).squeeze(0))
    return out_mean, inv, inv_batch, n


def backward(x, mask, scale, grad_y, weight, w_offset, mean, inv_fwd, inv_bwd, A, B, b_scale, groups, correct_pads,
             want_gx, want_sums):
    _, rows = _rows(x)
    C = x.size(-1)
    xs, r = _scaled(x, groups, 0.0, scale)
    centred = xs - mean.to(xs) if mean.numel() else xs
    xh = centred * inv_fwd.to(xs)
    gy = grad_y.view(x.shape).to(xs.dtype)
    keep = _keep(mask, x)
    gx, part = x.new_empty(0), x.new_empty(0, dtype=torch.float64)
    if want_gx:
        m = torch.ones_like(keep) if correct_pads else keep
        a, b = _channels(A, C, xs), _channels(B, C, xs) * b_scale
        d = gy * _gain(weight, w_offset, xs) - m.to(xs) * (a + b * xh)
        gx, out = _into(x)
        if groups > 0:  # back through a group's scaling r: r (d - xs mean_group(d xs))
            dg, sg = (d * inv_bwd.to(xs)).unflatten(-1, (groups, -1)), xs.unflatten(-1, (groups, -1))
            torch.mul(r.unsqueeze(-1), dg - sg * (dg * sg).mean(-1, keepdim=True), out=out.unflatten(-1, (groups, -1)))
        else:
            torch.mul(d, inv_bwd.to(xs), out=out)
    if want_sums:
        xd, gd = xh.double(), gy.double()
        gxh, xh2 = gd * xd, xd * xd
        sums = (gxh, gd, gxh * keep, xh2 * keep, xh2)
        part = torch.stack([t.sum(rows) for t in sums]).unsqueeze(0)
    return gx, part


def finish_backward(part, weight, w_offset, n, nu, rate, kind, center, rows):
    s = part.double().sum(0)
    w = weight.double() + w_offset
    n = n.double()
    ns = n.clamp(min=1)
    sd = nu.dtype if nu.numel() else (torch.float64 if weight.dtype == torch.float64 else torch.float32)
    kind = Mode(kind)
    exact = kind == Mode.EXACT
    def none():  # a fresh empty tensor each: an op's outputs must not alias
        return torch.empty(0, dtype=sd, device=part.device)

    A = (w * s[1] / ns).to(sd) if exact and center else none()
    B = (w * s[0] / ns).to(sd) if exact else none()
    if nu.numel():
        old = nu.double()
        if kind == Mode.REFERENCE:  # mean over every position of g' * xh, g' = g - (1 - a) nu xh
            new, ok = old + (w * s[0] - rate * old * s[4]) / rows, n > 0
        else:  # Algorithm 2: Lambda_t = mean(g xh), Gamma_t = mean(xh^2)
            lam, gam = w * s[2] / ns, s[3] / ns
            new = old * (1 - rate * gam) + rate * lam
            ok = (n > 0) & torch.isfinite(lam).all() & torch.isfinite(gam).all()
        nu.copy_(torch.where(ok, new, old))
    return s[0].to(weight.dtype), s[1].to(weight.dtype), A, B


def row_forward(kind, x, params, w_offset, eps):
    """A per-row or per-entry kind's forward: its descriptor's PyTorch ops (contract.RowKind)."""
    k = contract.ROW_KINDS[kind]
    return tuple(k.forward(x, *k.shifted(params, w_offset), eps))


def row_backward(kind, x, stat, grad_y, params, w_offset, eps):
    k = contract.ROW_KINDS[kind]
    grads = k.backward(x, stat, grad_y, *k.shifted(params, w_offset), eps)
    return [grads[0], *(g.to(p.dtype) for g, p in zip(grads[1:], params))]  # each in its parameter's dtype


contract.check(sys.modules[__name__], "plain")
