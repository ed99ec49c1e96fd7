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

from ..norms import NORMS, build_norm


def norm_options(cfg, kind: str, heads: int, final: bool = False) -> dict:
    """The constructor options of a norm of ``kind`` from the model's flags,
    as its class declares them (:meth:`Norm.options`); ``final``: the norm
    after a side's last layer."""
    if kind not in NORMS:
        raise ValueError(f"unknown norm type {kind!r}; choose one of {', '.join(NORMS)}")
    return NORMS[kind].options(cfg, heads, final)


def encoder_norm(cfg, kind=None, final=False):
    """A norm of the encoder: ``kind``, or ``--norm-type`` when None."""
    kind, heads = kind or cfg.norm_type, cfg.encoder.attention_heads
    return build_norm(kind, cfg.encoder.embed_dim, **norm_options(cfg, kind, heads, final))


def decoder_norm(cfg, kind=None, final=False):
    """A norm of the decoder: ``kind``, or ``--decoder-norm-type`` when None."""
    kind, heads = kind or cfg.decoder_norm_type, cfg.decoder.attention_heads
    return build_norm(kind, cfg.decoder.embed_dim, **norm_options(cfg, kind, heads, final))


class PowerNormEncoderLayer(TransformerEncoderLayerBase):
    """Encoder layer: attention norm ``--encoder-norm-self``, FFN norm
    ``--encoder-norm-ff``, each ``--norm-type`` unless given."""

    def __init__(self, cfg, return_fc=False):
        super().__init__(cfg, return_fc=return_fc)
        self.self_attn_layer_norm = encoder_norm(cfg, getattr(cfg, "encoder_norm_self", None))
        self.final_layer_norm = encoder_norm(cfg, getattr(cfg, "encoder_norm_ff", None))


class PowerNormDecoderLayer(TransformerDecoderLayerBase):
    """Decoder layer: ``--decoder-norm-self``, ``--decoder-norm-cross`` and
    ``--decoder-norm-ff``, each ``--decoder-norm-type`` unless given."""

    def __init__(self, cfg, no_encoder_attn=False, add_bias_kv=False, add_zero_attn=False):
        super().__init__(cfg, no_encoder_attn, add_bias_kv, add_zero_attn)
        self.self_attn_layer_norm = decoder_norm(cfg, getattr(cfg, "decoder_norm_self", None))
        if self.encoder_attn_layer_norm is not None:
            self.encoder_attn_layer_norm = decoder_norm(cfg, getattr(cfg, "decoder_norm_cross", None))
        self.final_layer_norm = decoder_norm(cfg, getattr(cfg, "decoder_norm_ff", None))
