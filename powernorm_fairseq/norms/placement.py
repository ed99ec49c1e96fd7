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
  authors' code (majumderb/rezero, its ``resweight``) has it;
* ``output``: x + N'(f(x)), a norm on each sublayer's output and none on its
  input, and the final norm (OLMo 2's reordered norm: Team OLMo, 2024, "2 OLMo
  2 Furious", arXiv 2501.00656);
* ``mixln``: post for the first K layers of each side and pre for the rest,
  and the final norm (Li et al., 2024, "Mix-LN", arXiv 2412.13795;
  ``--mixln-post-layers K``, by default a quarter of the layers, rounded down,
  the paper's ratio).

Each side may instead list its layers' placements (``--encoder-layer-placements
post*2,pre*4``; among pre, post, sandwich and output) and kinds
(``--encoder-layer-norms bn*2,ln*4``). ``--norm-depth-scaling`` multiplies the
output of the norm before each sublayer of a pre or sandwich layer by
1/sqrt(l), l its layer's 1-based index on its side (Sun et al., 2025, "The
Curse of Depth in Large Language Models", arXiv 2502.05795, LayerNorm Scaling); the
other placements have no such norm, and a model without one is refused.

fairseq's layers call ``residual_connection(x, residual)`` once per sublayer
that runs, in order (self-attention, encoder attention, feed-forward); a
decoder layer skips its encoder attention when called without ``encoder_out``.
:class:`Placed` gives each call the output norm, residual scale or gate of the
sublayer it is, by name, not by counting calls.
"""

import torch
from torch import nn

PLACEMENTS = ("pre", "post", "sandwich", "deepnorm", "rezero", "output", "mixln")
#: what a layer of a per-layer list may be (deepnorm's constants and rezero's gates are the whole stack's)
LAYER_PLACEMENTS = ("pre", "post", "sandwich", "output")
REZERO_GATES = ("sublayer", "layer")
#: the placements with a final norm after the last layer (fairseq's ``normalize_before``)
NORMALIZE_BEFORE = {"pre": True, "post": False, "sandwich": True, "deepnorm": False, "rezero": False,
                    "output": True, "mixln": True}
#: the placements whose layers have a norm before each sublayer (what --norm-depth-scaling scales)
DEPTH_SCALED = ("pre", "sandwich")
#: Mix-LN's share of post-norm layers (Li et al., 2024)
MIXLN_RATIO = 0.25


def per_layer(allowed, flag):
    """The type of a per-layer list flag: ``a*2,b,c*3`` with each item one of
    ``allowed``, written back in one canonical spelling (runs merged), so that
    two spellings of one model compare equal in a checkpoint."""
    import argparse

    def parse(text):
        items = expand(text, allowed, flag, argparse.ArgumentTypeError)
        runs = []
        for item in items:
            if runs and runs[-1][0] == item:
                runs[-1][1] += 1
            else:
                runs.append([item, 1])
        return ",".join(item if n == 1 else f"{item}*{n}" for item, n in runs)

    return parse


def expand(text, allowed=None, flag="", error=ValueError):
    """The items of a per-layer list, one per layer."""
    items = []
    for part in str(text).split(","):
        item, star, count = part.strip().partition("*")
        if allowed is not None and item not in allowed:
            raise error(f"{flag} {text!r}: {item!r} is not one of {', '.join(allowed)} (write e.g. "
                        f"{allowed[0]}*2,{allowed[1]}*4)")
        if star and not (count.isdigit() and int(count) > 0):
            raise error(f"{flag} {text!r}: {part!r}: the count after * must be a whole number above 0")
        items += [item] * (int(count) if star else 1)
    return items


def side_placements(placement, listed, post_layers, layers):
    """The placement of each of a side's ``layers`` layers: its list
    (``--*-layer-placements``), Mix-LN's split, or ``--norm-placement`` for all."""
    if listed:
        return expand(listed)
    if placement == "mixln":
        post = int(layers * MIXLN_RATIO) if post_layers is None else post_layers
        return ["post"] * post + ["pre"] * (layers - post)
    return [placement] * layers


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

    #: fairseq's names of a layer's norms before each sublayer (in pre-norm)
    INPUT_NORMS = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")
    depth_scale = 1.0

    def place(self, placement: str, output_norms, gates: str = "sublayer", depth: int = 0):
        """``output_norms``: a callable giving each sublayer's output norm, in
        fairseq's order (sandwich, output); ``gates``: ReZero's, per sublayer or per
        layer; ``depth``: the layer's 1-based index on its side, for
        --norm-depth-scaling (0: none). DeepNorm's residual scale is 1 until
        :func:`deepnorm_` sets it, which knows the whole model."""
        self.placement, self.residual_scale = placement, 1.0
        self.normalize_before = NORMALIZE_BEFORE[placement]
        names = [s for s in self.SUBLAYERS if s != "cross" or getattr(self, "encoder_attn", None) is not None]
        inputs = [name for name in self.INPUT_NORMS if getattr(self, name, None) is not None]
        if placement in ("sandwich", "output"):
            self.output_norms = nn.ModuleList(output_norms(i) for i in range(len(names)))
        if placement == "output":  # no norm on a sublayer's input: fairseq's calls there return x
            from . import build_norm

            for name in inputs:
                setattr(self, name, build_norm("none", self.embed_dim))
        if depth and placement in DEPTH_SCALED:  # LayerNorm Scaling: the norm before each sublayer, times 1/sqrt(l)
            self.depth_scale = depth ** -0.5
            for name in inputs:
                getattr(self, name).register_forward_hook(_scaled(self.depth_scale))
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
        if self.placement in ("sandwich", "output"):
            return residual + self.output_norms[self._order[i]](x)
        if self.placement == "deepnorm":
            return residual * self.residual_scale + x
        if self.placement == "rezero":
            return residual + self.rezero_gates[self._order[i]] * x
        return residual + x

    def extra_repr(self) -> str:
        scaled = f", depth_scale={self.depth_scale:.4g}" if self.depth_scale != 1 else ""
        return f"placement={self.placement}{scaled}"


def _scaled(scale: float):
    def hook(_module, _args, y):
        return y * scale

    return hook


def check_placement(args, kinds):
    """One line for a combination that would not build what it names."""
    placement = args.norm_placement
    if placement == "rezero" and kinds - {"none"}:
        raise ValueError(f"--norm-placement rezero has no norms in its layers (a residual gate that starts at 0 "
                         f"instead): pass --norm-type none, not {', '.join(sorted(kinds - {'none'}))}")
    if placement in ("sandwich", "rezero", "output") and getattr(args, "scale_attn", False):
        raise ValueError(f"--scale-attn adds NormFormer's norm on the self-attention output, which "
                         f"--norm-placement {placement} " + ("leaves out (it has no norms)" if placement == "rezero"
                                                            else "already has"))
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


def check_layers(args, sides):
    """One line for a per-layer list or a Mix-LN split that does not fit the
    model's layers, and for --norm-depth-scaling where no norm precedes a sublayer."""
    placement, post = args.norm_placement, getattr(args, "mixln_post_layers", None)
    if post is not None and placement != "mixln":
        raise ValueError(f"--mixln-post-layers {post}: Mix-LN's split, and --norm-placement {placement} is none; "
                         "add --norm-placement mixln, or leave the flag out")
    scaled = False
    for side in sides:
        layers = getattr(args, f"{side}_layers", 0) or 0
        for what in ("norms", "placements"):
            listed = getattr(args, f"{side}_layer_{what}", None)
            if listed and len(expand(listed)) != layers:
                raise ValueError(f"--{side}-layer-{what} {listed} names {len(expand(listed))} layers: the {side} "
                                 f"has {layers} (--{side}-layers)")
        if getattr(args, f"{side}_layer_placements", None) and placement in ("deepnorm", "rezero", "mixln"):
            raise ValueError(f"--{side}-layer-placements with --norm-placement {placement}, which sets every layer "
                             f"itself: choose each layer among {', '.join(LAYER_PLACEMENTS)}, or leave the list out")
        if post is not None and layers and post >= layers:
            raise ValueError(f"--mixln-post-layers {post} leaves no pre-norm layer in the {side}, of {layers} layers "
                             f"(--{side}-layers): give K below {layers}, or --norm-placement post")
        placements = side_placements(placement, getattr(args, f"{side}_layer_placements", None), post, layers)
        scaled |= any(p in DEPTH_SCALED for p in placements)
    if getattr(args, "norm_depth_scaling", False) and not scaled:
        raise ValueError(f"--norm-depth-scaling scales the norm before each sublayer of a pre-norm layer, and "
                         f"--norm-placement {placement} puts none there: use pre, sandwich or mixln (or list "
                         "pre layers)")


def final_norm(args, side) -> bool:
    """Whether ``side`` has a norm after its last layer (fairseq's ``normalize_before``): its
    placement's, or, for a side whose layers are listed, its last layer's."""
    listed = getattr(args, f"{side}_layer_placements", None)
    if listed:
        return NORMALIZE_BEFORE[expand(listed)[-1]]
    return NORMALIZE_BEFORE[args.norm_placement]


def layer_plan(cfg, side, index):
    """(kind or None for the side's own, placement) of layer ``index`` (0-based) of ``side``."""
    layers = getattr(cfg, side).layers
    listed = getattr(cfg, f"{side}_layer_norms", None)
    kind = expand(listed)[index] if listed else None
    placement = side_placements(getattr(cfg, "norm_placement", "post"), getattr(cfg, f"{side}_layer_placements", None),
                                getattr(cfg, "mixln_post_layers", None), layers)[index]
    return kind, placement
