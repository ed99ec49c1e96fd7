"""fairseq's transformer layers with their norms chosen by flag.

The layers keep fairseq's attribute names (``self_attn_layer_norm``,
``final_layer_norm``, ...) whatever norm sits there, so an ``ln`` model has the
state dict of a stock fairseq transformer. fairseq calls these norms with ``x``
alone; the padding mask reaches them through :func:`norms.padding_mask`.
"""

from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

import inspect

from ..common.errors import PowerNormConfigError
from ..norms import GAIN_TYPES, NORMS, build_norm
from ..norms.placement import Placed, layer_plan
from ..norms.qk_norm import add_qk_norm_


def norm_options(cfg, kind: str, heads: int, final: bool = False) -> dict:
    """The constructor options of a norm of ``kind`` from the model's flags,
    as its class declares them (:meth:`Norm.options`); ``final``: the norm
    after a side's last layer."""
    if kind not in NORMS:
        raise ValueError(f"unknown norm type {kind!r}; choose one of {', '.join(NORMS)}")
    options = NORMS[kind].options(cfg, heads, final)
    if getattr(cfg, "norm_unit_offset", False) and kind in GAIN_TYPES:  # --norm-unit-offset: every gain
        options["unit_offset"] = True
    return options


def encoder_norm(cfg, kind=None, final=False):
    """A norm of the encoder: ``kind``, or ``--norm-type`` when None."""
    kind, heads = kind or cfg.norm_type, cfg.encoder.attention_heads
    return build_norm(kind, cfg.encoder.embed_dim, **norm_options(cfg, kind, heads, final))


def decoder_norm(cfg, kind=None, final=False, dim=None, flag=None):
    """A norm of the decoder (``dim``: its embedding size unless given):
    ``kind``, or ``--decoder-norm-type`` when None. Its tokens see only the
    earlier ones: a norm of batch statistics is told so (it warns while
    training, or runs causally under ``--norm-causal``)."""
    kind, heads = kind or cfg.decoder_norm_type, cfg.decoder.attention_heads
    options = norm_options(cfg, kind, heads, final)
    if getattr(cfg, "norm_causal", False) and "causal" in inspect.signature(NORMS[kind]).parameters:
        options["causal"] = True
    try:
        norm = build_norm(kind, dim or cfg.decoder.embed_dim, **options)
    except ValueError as err:
        if flag is None:
            raise
        raise PowerNormConfigError(f"{flag} with a {kind} decoder: {err}") from None
    norm.in_causal_decoder = True
    return norm


def with_qk_norm(cfg, attentions, heads):
    """``--qk-norm``: each attention's queries and keys normalised per head,
    or over their whole projections (``--qk-norm-scope``)."""
    kind, scope = getattr(cfg, "qk_norm", None), getattr(cfg, "qk_norm_scope", "head")
    for attention in attentions:
        if kind is not None and attention is not None:  # (none: the flag's explicit "no norm")
            add_qk_norm_(attention, kind, norm_options(cfg, kind, heads), scope)


class PowerNormEncoderLayer(Placed, TransformerEncoderLayerBase):
    """Encoder layer: attention norm ``--encoder-norm-self``, FFN norm
    ``--encoder-norm-ff``, each ``--norm-type`` unless given, placed as
    ``--norm-placement`` says (``placement.py``)."""

    def __init__(self, cfg, return_fc=False, index=0):
        super().__init__(cfg, return_fc=return_fc)
        kind, placement = layer_plan(cfg, "encoder", index)  # index: the layer's on its side, from 0
        kinds = [getattr(cfg, "encoder_norm_self", None) or kind, getattr(cfg, "encoder_norm_ff", None) or kind]
        self.self_attn_layer_norm = encoder_norm(cfg, kinds[0])
        self.final_layer_norm = encoder_norm(cfg, kinds[1])
        self.place(placement, lambda i: encoder_norm(cfg, kinds[i]), getattr(cfg, "rezero_gates", "sublayer"),
                   index + 1 if getattr(cfg, "norm_depth_scaling", False) else 0)
        with_qk_norm(cfg, [self.self_attn], cfg.encoder.attention_heads)


class PowerNormDecoderLayer(Placed, TransformerDecoderLayerBase):
    """Decoder layer: ``--decoder-norm-self``, ``--decoder-norm-cross`` and
    ``--decoder-norm-ff``, each ``--decoder-norm-type`` unless given; with
    NormFormer's flags, its norms of the same kinds; placed as ``--norm-placement`` says."""

    def __init__(self, cfg, no_encoder_attn=False, add_bias_kv=False, add_zero_attn=False, index=0):
        super().__init__(cfg, no_encoder_attn, add_bias_kv, add_zero_attn)
        kind, placement = layer_plan(cfg, "decoder", index)
        self_kind, cross, ff = (getattr(cfg, f"decoder_norm_{s}", None) or kind for s in ("self", "cross", "ff"))
        kinds = [self_kind, ff]  # each sublayer's, in fairseq's order
        self.self_attn_layer_norm = decoder_norm(cfg, self_kind)
        if self.encoder_attn_layer_norm is not None:
            self.encoder_attn_layer_norm = decoder_norm(cfg, cross)
            kinds.insert(1, cross)
        self.final_layer_norm = decoder_norm(cfg, ff)
        self.place(placement, lambda i: decoder_norm(cfg, kinds[i]), getattr(cfg, "rezero_gates", "sublayer"),
                   index + 1 if getattr(cfg, "norm_depth_scaling", False) else 0)
        with_qk_norm(cfg, [self.self_attn, self.encoder_attn], cfg.decoder.attention_heads)
        # NormFormer's extra norms (--scale-attn after self-attention, --scale-fc inside the FFN):
        # the kinds of the self-attention and FFN norms
        if self.attn_ln is not None:
            self.attn_ln = decoder_norm(cfg, self_kind, flag="--scale-attn")
        if self.ffn_layernorm is not None:
            self.ffn_layernorm = decoder_norm(cfg, ff, dim=cfg.decoder.ffn_embed_dim, flag="--scale-fc")
