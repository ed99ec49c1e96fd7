"""Where a transformer layer's norms sit (``--norm-placement``), for every norm kind.

With f a sublayer (attention or feed-forward), N its norm and x its input:

* ``pre``: x + f(N(x)), and a final norm after the last layer;
* ``post``: N(x + f(x)) (Vaswani et al., 2017);
* ``sandwich``: x + N'(f(N(x))), a second norm on each sublayer's output
  (Ding et al., 2021, "CogView"; Kim et al., 2025, "Peri-LN"), and the final norm;
* ``deepnorm``: N(alpha x + f(x)), with the weights of the feed-forward layers
  and of the attention's value and output projections drawn Xavier-normal with
  gain beta, the query and key projections with gain 1 (Wang et al., 2022,
  "DeepNet", Figure 2): :func:`deepnorm_constants`;
* ``rezero``: x + g f(x) with g a scalar that starts at 0, and no norm
  (Bachlechner et al., 2020, Eq. 5): one per sublayer (``--rezero-gates
  sublayer``), or one per layer shared by its sublayers (``layer``), as the
  authors' code (majumderb/rezero, its ``resweight``) has it.

fairseq's layers call ``residual_connection(x, residual)`` once per sublayer
that runs, in order (self-attention, encoder attention, feed-forward); a
decoder layer skips its encoder attention when called without ``encoder_out``.
:class:`Placed` gives each call the output norm, residual scale or gate of the
sublayer it is, by name, not by counting calls.
"""

import torch
from torch import nn

PLACEMENTS = ("pre", "post", "sandwich", "deepnorm", "rezero")
REZERO_GATES = ("sublayer", "layer")
#: the placements whose norms come before each sublayer (fairseq's ``normalize_before``, and a final norm)
NORMALIZE_BEFORE = {"pre": True, "post": False, "sandwich": True, "deepnorm": False, "rezero": False}


def deepnorm_constants(encoder_layers: int, decoder_layers: int) -> dict:
    """{side: (alpha, beta)} of DeepNet's Figure 2 for N encoder and M decoder
    layers (0 where a model has no such side): encoder-decoder, encoder-only
    (BERT) or decoder-only (GPT)."""
    N, M = encoder_layers, decoder_layers
    if N and M:
        return {"encoder": (0.81 * (N ** 4 * M) ** (1 / 16), 0.87 * (N ** 4 * M) ** (-1 / 16)),
                "decoder": ((3 * M) ** (1 / 4), (12 * M) ** (-1 / 4))}
    if N:
        return {"encoder": ((2 * N) ** (1 / 4), (8 * N) ** (-1 / 4))}
    return {"decoder": ((2 * M) ** (1 / 4), (8 * M) ** (-1 / 4))}


def deepnorm_init_(layer, beta: float):
    """DeepNet's initialisation of one layer (Figure 2): Xavier normal, gain
    beta for the feed-forward, value and output projections, gain 1 for the
    query and key projections."""
    attentions = [m for m in (layer.self_attn, getattr(layer, "encoder_attn", None)) if m is not None]
    with torch.no_grad():
        for weight, gain in [(layer.fc1.weight, beta), (layer.fc2.weight, beta)] + [
                (w, g) for a in attentions for w, g in ((a.q_proj.weight, 1.0), (a.k_proj.weight, 1.0),
                                                        (a.v_proj.weight, beta), (a.out_proj.weight, beta))]:
            nn.init.xavier_normal_(weight, gain=gain)


def deepnorm_(model):
    """DeepNorm's residual scales and initialisation on every layer of
    ``model``, with the constants of its kind: encoder-decoder, encoder-only
    or decoder-only (a side it lacks counts 0 layers)."""
    stacks = {side: getattr(model, side).layers for side in ("encoder", "decoder")
              if hasattr(getattr(model, side, None), "layers")}
    constants = deepnorm_constants(len(stacks.get("encoder", ())), len(stacks.get("decoder", ())))
    for side, layers in stacks.items():
        alpha, beta = constants[side]
        for layer in layers:
            layer.residual_scale = alpha
            deepnorm_init_(layer, beta)


class Placed:
    """A fairseq layer's residual connections as ``--norm-placement`` asks.
    A layer class lists it before fairseq's and calls :meth:`place` in its
    ``__init__``; fairseq's own code chooses pre or post by ``normalize_before``."""

    placement = "post"
    SUBLAYERS = ("self", "cross", "ff")  # fairseq's order; "cross" where the layer has encoder attention

    def place(self, placement: str, output_norms, gates: str = "sublayer"):
        """``output_norms``: a callable giving each sublayer's output norm, in
        fairseq's order (sandwich); ``gates``: ReZero's, per sublayer or per
        layer. DeepNorm's residual scale is 1 until :func:`deepnorm_` sets
        it, which knows the whole model."""
        self.placement, self.residual_scale = placement, 1.0
        names = [s for s in self.SUBLAYERS if s != "cross" or getattr(self, "encoder_attn", None) is not None]
        if placement == "sandwich":
            self.output_norms = nn.ModuleList(output_norms(i) for i in range(len(names)))
        if placement == "rezero":
            self.rezero_gates = nn.Parameter(torch.zeros(len(names) if gates == "sublayer" else 1))
        # each sublayer's output norm and gate, by name (state-dict keys output_norms.0, ...; one shared gate)
        index = {name: 0 if placement == "rezero" and gates == "layer" else i for i, name in enumerate(names)}
        # the indices of the sublayers a call runs, with and without the encoder attention
        self._orders = (index["self"], index["ff"]), tuple(index.values())

    def forward(self, *args, **kwargs):
        # fairseq's decoder layer skips its encoder attention without encoder_out
        cross = len(self._orders[1]) == 3 and (kwargs["encoder_out"] if "encoder_out" in kwargs else
                                              args[1] if len(args) > 1 else None) is not None
        object.__setattr__(self, "_order", self._orders[cross])
        object.__setattr__(self, "_sublayer", 0)
        return super().forward(*args, **kwargs)

    def residual_connection(self, x, residual):
        i = self._sublayer
        object.__setattr__(self, "_sublayer", i + 1)
        if self.placement == "sandwich":
            return residual + self.output_norms[self._order[i]](x)
        if self.placement == "deepnorm":
            return residual * self.residual_scale + x
        if self.placement == "rezero":
            return residual + self.rezero_gates[self._order[i]] * x
        return residual + x


def check_placement(args, kinds):
    """One line for a combination that would not build what it names."""
    placement = args.norm_placement
    if placement == "rezero" and kinds - {"none"}:
        raise ValueError(f"--norm-placement rezero has no norms in its layers (a residual gate that starts at 0 "
                         f"instead): pass --norm-type none, not {', '.join(sorted(kinds - {'none'}))}")
    if placement in ("sandwich", "rezero") and getattr(args, "scale_attn", False):
        raise ValueError(f"--scale-attn adds NormFormer's norm on the self-attention output, which "
                         f"--norm-placement {placement} " + ("already has" if placement == "sandwich"
                                                            else "leaves out (it has no norms)"))
    if getattr(args, "rezero_gates", None) == "layer" and placement != "rezero":
        raise ValueError(f"--rezero-gates layer: ReZero's gates, and --norm-placement {placement} has none; "
                         "add --norm-placement rezero, or leave the flag out")
    if placement == "rezero" and getattr(args, "scale_fc", False):
        raise ValueError("--scale-fc adds NormFormer's norm inside the feed-forward, and --norm-placement "
                         "rezero has no norms")
    if placement == "deepnorm" and (args.small_init or args.init == "smallinit"):
        given = "--small-init" if args.small_init else "--init smallinit"
        raise ValueError(f"{given} contradicts --norm-placement deepnorm, which initialises the same weights "
                         "itself (DeepNet, Figure 2); another --init sets the embeddings and heads beside it")
