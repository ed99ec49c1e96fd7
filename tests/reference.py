"""Plain-PyTorch references of every norm's formula, written independently of
the library: real tokens are gathered with boolean indexing, each formula is
spelled out as in the paper or the issue that specifies it, and the PN
backward passes are computed by hand, step by step, from an upstream gradient.
"""

import torch


def real(x, pad):
    """(N, C) real tokens of x (T, B, C); pad (B, T) True at padding."""
    return x[~pad.t()]


def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def rms_norm(x, g, eps=1e-5):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def layer_norm_simple(x, eps=1e-5, detach=None, unbiased=False):
    """LN without gain and bias; ``detach`` in (None, "both", "mean", "var");
    ``unbiased``: divide by the unbiased std + eps (Xu et al.'s code)."""
    n = x.shape[-1]
    mu = x.sum(-1, keepdim=True) / n
    if unbiased:
        sigma = torch.sqrt(((x - mu) ** 2).sum(-1, keepdim=True) / (n - 1)) + eps
    else:
        sigma = torch.sqrt(((x - mu) ** 2).sum(-1, keepdim=True) / n + eps)
    if detach in ("both", "mean"):
        mu = mu.detach()
    if detach in ("both", "var"):
        sigma = sigma.detach()
    return (x - mu) / sigma


def ada_norm(x, C=1.0, k=0.1, eps=1e-5):
    """Xu et al.'s code: unbiased std, eps on the std, the (1 - k y) factor detached."""
    n = x.shape[-1]
    mu = x.sum(-1, keepdim=True) / n
    std = torch.sqrt(((x - mu) ** 2).sum(-1, keepdim=True) / (n - 1))
    y = (x - mu) / (std + eps)
    return C * (1 - k * y).detach() * y


def group_norm(x, groups, w, b, eps=1e-5):
    out = [layer_norm_simple(chunk, eps) for chunk in x.chunk(groups, dim=-1)]
    return torch.cat(out, dim=-1) * w + b


def dyt(x, alpha, w, b):
    """Zhu et al. (2025), Eq. 1, with tanh written out: (e^2z - 1) / (e^2z + 1)."""
    e = torch.exp(2 * alpha * x)
    return w * (e - 1) / (e + 1) + b


def derf(x, alpha, shift, w, b):
    """Derf (arXiv 2512.10938): w erf(alpha x + s) + b, erf written as the regularised lower incomplete
    gamma function, erf(z) = sign(z) P(1/2, z^2)."""
    z = alpha * x + shift
    return w * torch.sign(z) * torch.special.gammainc(torch.tensor(0.5, dtype=z.dtype), z * z) + b


def scale_norm(x, g, eps=1e-5):
    length = torch.sqrt((x * x).sum(-1, keepdim=True))
    return g * x / torch.maximum(length, torch.full_like(length, eps))


def batch_norm(x, pad, w, b, eps=1e-5):
    X = real(x, pad)
    mu = X.mean(0)
    var = ((X - mu) ** 2).mean(0)
    return (x - mu) / torch.sqrt(var + eps) * w + b, mu, var * X.shape[0] / (X.shape[0] - 1)


def rbn_penalty(x, pad, running_mean, running_var, momentum, penalty_mean, penalty_var):
    """Regularized BN's penalty (Wang, Wu and Huang 2022; ``loss_diff`` of their MaskBatchNorm3d), with its
    order: the running statistics first updated with this batch's mean and unbiased variance, then
    penalty_mean * sum (mu - mu_B)^2 + penalty_var * sum |var - var_B|; the new running statistics too."""
    X = real(x, pad)
    mu_b, var_b = X.mean(0), X.var(0, unbiased=True)
    mean = (1 - momentum) * running_mean + momentum * mu_b.detach()
    var = (1 - momentum) * running_var + momentum * var_b.detach()
    return penalty_mean * ((mean - mu_b) ** 2).sum() + penalty_var * (var - var_b).abs().sum(), mean, var


def original_batch_norm(x, pad, w, b, running_mean, running_var, training=True, momentum=0.05, eps=1e-5):
    """The authors' "batch" norm (MaskSyncBatchNorm), transcribed: divide each
    token by its RMS over channels, put the mean of the real tokens into every
    padded position, then torch's BatchNorm over all T*B positions, which also
    updates running_mean and running_var in place."""
    T, B, C = x.shape
    x = x / torch.sqrt((x ** 2).mean(dim=2, keepdim=True) + 1e-5)
    keep = ~pad.t()
    filled = x.clone()
    filled[~keep, :] = x[keep, :].mean(dim=0).unsqueeze(0).repeat(int((~keep).sum()), 1)
    rows = filled.contiguous().view(T * B, C)
    z = torch.nn.functional.batch_norm(rows, running_mean, running_var, w, b, training, momentum, eps)
    return z.view(T, B, C)


def pn_v(x, pad, w, b, eps=1e-5):
    psi2 = (real(x, pad) ** 2).mean(0)
    return x / torch.sqrt(psi2 + eps) * w + b, psi2


def group_scale(x, groups, eps=1e-5):
    out = []
    for chunk in x.chunk(groups, dim=-1):
        out.append(chunk / torch.sqrt((chunk ** 2).mean(-1, keepdim=True) + eps))
    return torch.cat(out, dim=-1)


class PaperPN:
    """Algorithm 2 with warmup as PN-V, one training step at a time."""

    def __init__(self, C, alpha_fwd=0.9, alpha_bwd=0.9, warmup=0, eps=1e-5):
        self.psi2 = torch.ones(C, dtype=torch.float64)
        self.nu = torch.zeros(C, dtype=torch.float64)
        self.a_f, self.a_b, self.warmup, self.eps, self.k = alpha_fwd, alpha_bwd, warmup, eps, 0

    def step(self, x, pad, gamma, beta, grad_y):
        """Output, dL/dx and dL/dgamma for upstream gradient grad_y."""
        self.k += 1
        keep = (~pad.t()).unsqueeze(-1).double()
        X = real(x, pad)
        psi_b2 = (X ** 2).mean(0)
        g = gamma * grad_y
        if self.k <= self.warmup:  # PN-V with its exact gradient, from autograd
            xr = x.detach().clone().requires_grad_(True)
            y, _ = pn_v(xr, pad, gamma, beta, self.eps)
            (grad_x,) = torch.autograd.grad(y, xr, grad_y)
            xh = x / torch.sqrt(psi_b2 + self.eps)
            self.psi2 = self.psi2 * (self.k - 1) / self.k + psi_b2 / self.k
        else:
            xh = x / torch.sqrt(self.psi2 + self.eps)
            y = gamma * xh + beta
            grad_x = (g - keep * self.nu * xh) / torch.sqrt(self.psi2 + self.eps)
            self.psi2 = self.a_f * self.psi2 + (1 - self.a_f) * psi_b2
        Xh, G = real(xh, pad), real(g, pad)
        Gamma, Lambda = (Xh ** 2).mean(0), (Xh * G).mean(0)  # Algorithm 2's names
        self.nu = self.nu * (1 - (1 - self.a_b) * Gamma) + (1 - self.a_b) * Lambda
        return y, grad_x, (grad_y * xh).sum((0, 1))


class ReferencePN:
    """What the authors' released code computes, transcribed from the issue."""

    def __init__(self, C, alpha_fwd=0.9, alpha_bwd=0.9, warmup=0, eps=1e-5):
        self.psi2 = torch.ones(C, dtype=torch.float64)
        self.nu = torch.zeros(C, dtype=torch.float64)
        self.a_f, self.a_b, self.W, self.eps, self.k = alpha_fwd, alpha_bwd, warmup, eps, 0

    def step(self, x, pad, gamma, beta, grad_y):
        self.k += 1
        k = self.k
        psi_b2 = (real(x, pad) ** 2).mean(0)
        z = x / torch.sqrt((psi_b2 if k <= self.W else self.psi2) + self.eps)
        if k < self.W:
            self.psi2 = self.psi2 * (k - 1) / k + psi_b2 / k
        self.psi2 = self.a_f * self.psi2 + (1 - self.a_f) * psi_b2
        y = gamma * z + beta
        g = gamma * grad_y
        g2 = g - (1 - self.a_b) * self.nu * z
        self.nu = self.nu + (g2 * z).mean((0, 1))
        return y, g2 / torch.sqrt(psi_b2 + self.eps), (grad_y * z).sum((0, 1))
