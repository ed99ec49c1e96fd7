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

from ..norms import build_norm


#: the released code builds each side's final norm without a warmup argument,
#: so its PN gets NormSelect's default (fairseq/modules/norm_select.py there)
RELEASED_FINAL_WARMUP = 1000


def layer_scale(cfg, kind: str) -> bool:
    """Whether a norm of ``kind`` gets the paper's layer scale (Appendix A):
    ``--layer-scale`` for bn, pn-v and pn; when it is not given, on for pn
    (``--pn-group-scaling``, default on) and off for bn and pn-v."""
    if getattr(cfg, "layer_scale", None) is not None:
        return cfg.layer_scale
    return kind == "pn" and cfg.pn_group_scaling is not False


def norm_options(cfg, kind: str, heads: int, final: bool = False) -> dict:
    """The constructor options of a norm of ``kind`` from the model's flags;
    ``final``: the norm after a side's last layer."""
    if kind == "pn":
        reference = cfg.pn_backward == "reference"
        return dict(
            alpha_fwd=cfg.pn_alpha_fwd,
            alpha_bwd=cfg.pn_alpha_bwd,
            warmup_updates=RELEASED_FINAL_WARMUP if final and reference else cfg.pn_warmup_updates,
            eps=cfg.pn_eps,
            group_scaling=layer_scale(cfg, kind),
            groups=heads,
            backward=cfg.pn_backward,
            sync=cfg.norm_sync,
        )
    sync = cfg.norm_sync or "batch"
    if kind == "adanorm":
        return dict(scale=cfg.adanorm_scale)
    if kind == "detachnorm":
        return dict(detach=cfg.detachnorm_detach, std=cfg.layernorm_simple_std)
    if kind == "layernorm-simple":
        return dict(std=cfg.layernorm_simple_std)
    if kind == "groupnorm":
        return dict(groups=cfg.norm_groups or heads)
    # without --norm-momentum each class keeps its own default (bn-original: the released code's)
    momentum = {} if cfg.norm_momentum is None else dict(momentum=cfg.norm_momentum)
    if kind == "pn-v":
        return dict(eps=cfg.pn_eps, sync=sync, layer_scale=layer_scale(cfg, kind), groups=heads, **momentum)
    if kind == "bn":
        return dict(sync=sync, layer_scale=layer_scale(cfg, kind), groups=heads, **momentum)
    if kind == "bn-original":  # it never synchronised
        return momentum
    return {}


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
