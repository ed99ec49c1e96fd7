"""``--norm-diagnostics``: the measurements behind the PowerNorm paper's
Figures 2-4, logged through fairseq's metrics during training.

Every ``interval`` updates, for every batch-statistic norm of a training model
(``bn``, ``rbn``, ``bn-original``, ``pn-v``, ``pn``), with s_B a statistic of the
batch's real tokens and s the running statistic as it stood before this batch
updated it:

* ``dist_mu``, ``dist_var`` (bn, rbn, bn-original), ``dist_psi2`` (pn-v, pn):
  (1/d) ||s_B - s||_2 over the d channels, the paper's dist (Section 3,
  Figures 2 and 4). With a layer scale (``--layer-scale``, pn's group
  scaling) the statistics are those of the scaled input the norm normalises;
  for bn-original those of its layer-scaled, pad-filled T x B positions.
* ``tid_mu``, ``tid_sigma`` (bn, rbn, bn-original), ``tid_psi`` (pn-v, pn): the
  training-inference discrepancy of Wang, Wu and Huang (2022, "Understanding
  the Failure of Batch Normalization for Transformers in NLP", arXiv
  2210.05153), as their code measures it: the channels' mean of |mu - mu_B| /
  sigma_B and of |sigma / sigma_B - 1| (psi for sigma without centring), each
  sigma_B = sqrt(var_B + eps), the norm's own eps. Here against the running
  statistics before this batch updated them: what inference would have used.
* ``grad_mu``, ``grad_var`` (bn, rbn, bn-original), ``grad_psi2`` (pn-v, pn): ||dL/ds||_2, the
  gradient of the back-propagated loss with respect to the statistic the
  forward pass divided by: the g_mu and g_sigma^2 of Eq. 3, the g_psi^2 of
  Eq. 6 (Figures 3 and 4). For pn outside warmup that statistic is the running
  psi^2, and g_psi^2 is the term Algorithm 2's nu stands in for. The loss is
  the one fairseq back-propagates: summed over target tokens, and under
  ``--fp16`` multiplied by the loss scale.

Keys are ``diag/<norm type>/<layer>/<metric>``, e.g. ``diag/pn/enc0.ffn/dist_psi2``,
averaged by fairseq over each log interval like every other metric. Nothing is
hooked into a model without diagnostics, so it trains bit for bit as before;
with diagnostics the hooks only read.
"""

from functools import partial

import torch
from fairseq.logging import metrics

from ..norms import NORMS, norm_type_of
from ..norms.stats import upcast

PRIORITY = 100  # after fairseq's own metrics in every log line
SUBLAYERS = {"self_attn_layer_norm": "attn", "encoder_attn_layer_norm": "cross", "final_layer_norm": "ffn"}


def short_name(name: str) -> str:
    """``encoder.layers.3.final_layer_norm`` -> ``enc3.ffn``; ``decoder.layer_norm`` -> ``dec.final``."""
    parts = name.split(".")
    side = {"encoder": "enc", "decoder": "dec"}.get(parts[0])
    if side and len(parts) == 4 and parts[1] == "layers" and parts[3] in SUBLAYERS:
        return f"{side}{parts[2]}.{SUBLAYERS[parts[3]]}"
    if side and parts[1:] == ["layer_norm"]:
        return f"{side}.final"
    return name


@torch.no_grad()
def batch_view(norm, x, pad_mask):
    """What the forward pass of ``norm`` is about to compute from ``x``.

    Returns ``(stats, xh_of)``: the batch and running statistics by metric
    name, and the input x-hat is made of, its mean (or None) and the
    1/sqrt(s + eps) it is divided by; each norm says (:meth:`Norm.diagnostics_view`).
    """
    return norm.diagnostics_view(x, pad_mask)


def discrepancy(stats, eps):
    """The training-inference discrepancy of each statistic (the module doc): {name: value}."""
    if "psi2" in stats:
        batch, running = stats["psi2"]
        return {"psi": ((running + eps).sqrt() / (batch + eps).sqrt() - 1).abs().mean().item()}
    (mean_b, mean_r), (var_b, var_r) = stats["mu"], stats["var"]
    sigma_b = (var_b + eps).sqrt()
    return {"mu": ((mean_r - mean_b).abs() / sigma_b).mean().item(),
            "sigma": ((var_r + eps).sqrt() / sigma_b - 1).abs().mean().item()}


def gradient_terms(grad_y, weight, xf, mean, inv):
    """||dL/ds|| for each statistic s from dL/dy (T, B, C).

    With g = dL/dy * gamma and xh = (x - mean) * inv over every position the
    forward normalised: dL/dvar = -1/2 inv^3 sum g (x - mean) = -1/2 inv^2 sum g xh
    (Eq. 3 and Eq. 6), and for BN dL/dmu = -inv sum g, the path through var
    contributing inv^2 sum g xh * mean(x - mu) = 0 over the real tokens.
    """
    g = upcast(grad_y) * weight.to(upcast(grad_y))
    xh = (xf - mean if mean is not None else xf) * inv
    d_second = -0.5 * inv * inv * (g * xh).sum(dim=(0, 1))
    if mean is None:
        return {"psi2": d_second.norm().item()}
    return {"mu": (-inv * g.sum(dim=(0, 1))).norm().item(), "var": d_second.norm().item()}


class NormDiagnostics:
    """Hooks that log statistics distances and gradient terms of a model's
    batch-statistic norms every ``interval`` updates (see the module doc)."""

    PROBED = tuple(cls for cls in NORMS.values() if cls.running_stats)

    def __init__(self, model, interval: int = 1):
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.interval, self.num_updates = interval, 0
        self.handles, self.pending = [], {}
        for name, module in model.named_modules():
            if type(module) in self.PROBED:
                prefix = f"diag/{norm_type_of(module)}/{short_name(name)}"
                self.handles += [
                    module.register_forward_pre_hook(partial(self._measure, prefix=prefix)),
                    module.register_forward_hook(self._watch_gradient),
                ]

    def set_num_updates(self, num_updates: int):
        self.num_updates = num_updates

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _measure(self, norm, args, prefix):
        """Before the forward: distances to the running statistics it starts from."""
        if not norm.training or self.num_updates % self.interval:
            return
        x = args[0]
        pad_mask = args[1] if len(args) > 1 and args[1] is not None else norm.pad_mask
        if pad_mask is not None and bool(pad_mask.all()):
            return  # an all-padding batch: the norm uses its running statistics
        stats, xh_of = batch_view(norm, x, pad_mask)
        for key, (batch, running) in stats.items():
            dist = (batch - running).norm().item() / batch.numel()  # the paper's (1/d) ||.||
            metrics.log_scalar(f"{prefix}/dist_{key}", dist, priority=PRIORITY)
        for key, value in discrepancy(stats, norm.eps).items():
            metrics.log_scalar(f"{prefix}/tid_{key}", value, priority=PRIORITY)
        self.pending[id(norm)] = (prefix, xh_of)

    def _watch_gradient(self, norm, args, output):
        """After the forward: log the gradient terms when dL/dy arrives."""
        if id(norm) not in self.pending:
            return
        prefix, xh_of = self.pending.pop(id(norm))
        if not output.requires_grad:
            return

        def log_gradients(grad_y):
            for key, value in gradient_terms(grad_y, norm.gain(upcast(grad_y)), *xh_of).items():
                metrics.log_scalar(f"{prefix}/grad_{key}", value, priority=PRIORITY)

        output.register_hook(log_gradients)
