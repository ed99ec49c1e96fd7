"""``powernorm_transformer``: fairseq's transformer with every norm chosen by flag.

The encoder's norms follow ``--norm-type`` and the decoder's
``--decoder-norm-type`` (LN by default, as in the PowerNorm paper, Section 5).
``--norm-placement``, ``--fixnorm`` and ``--small-init`` give the rows of
Nguyen & Salazar (2019), "Transformers without Tears".
"""

from contextlib import contextmanager

import torch.nn.functional as F
from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import (
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
    transformer_wmt_en_de,
)

from ..modules import (
    FixNormEmbedding,
    PowerNormDecoderLayer,
    PowerNormEncoderLayer,
    decoder_norm,
    encoder_norm,
)
from ..norms import padding_mask
from .mixin import PowerNormModelMixin
from .options import add_norm_args, powernorm_defaults


@register_model("powernorm_transformer")
class PowerNormTransformerModel(PowerNormModelMixin, TransformerModel):
    """fairseq's ``TransformerModel`` with the norms of the PowerNorm paper."""

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_norm_args(parser)

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return PowerNormTransformerEncoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return PowerNormTransformerDecoder(
            cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention
        )


@contextmanager
def layers_padding_mask(stack, key, tokens):
    """Every norm of ``stack``, an encoder or a decoder, masked by the padding
    mask that fairseq hands its first layer as ``key`` (None when the batch
    has no padding): fairseq's own mask, not a second one made from the
    tokens. A stack without layers makes it from ``tokens``."""
    if not stack.layers:
        with padding_mask(stack, tokens.eq(stack.padding_idx)):
            yield
        return

    def hand_on(layer, args, kwargs):
        if key not in kwargs:
            raise RuntimeError(f"fairseq no longer passes {key}= to its layers: the norms have no padding mask")
        for norm in norms:
            norm.pad_mask = kwargs[key]

    with padding_mask(stack) as norms:
        handle = stack.layers[0].register_forward_pre_hook(hand_on, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


class PowerNormTransformerEncoder(TransformerEncoderBase):
    """fairseq's encoder; its norms get the source padding mask."""

    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        if self.layer_norm is not None:
            self.layer_norm = encoder_norm(cfg, final=True)

    def build_encoder_layer(self, cfg):
        index = self.__dict__.get("layers_built", 0)  # fairseq builds the layers in order
        self.layers_built = index + 1
        layer = PowerNormEncoderLayer(cfg, return_fc=self.return_fc, index=index)
        return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap)

    def forward_scriptable(self, src_tokens, src_lengths=None, return_all_hiddens=False,
                           token_embeddings=None):
        with layers_padding_mask(self, "encoder_padding_mask", src_tokens):
            return super().forward_scriptable(
                src_tokens, src_lengths, return_all_hiddens, token_embeddings
            )


class PowerNormTransformerDecoder(TransformerDecoderBase):
    """fairseq's decoder; its norms get the target padding mask."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False,
                 output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn, output_projection)
        if self.layer_norm is not None:
            self.layer_norm = decoder_norm(cfg, final=True)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        index = self.__dict__.get("layers_built", 0)
        self.layers_built = index + 1
        layer = PowerNormDecoderLayer(cfg, no_encoder_attn, index=index)
        return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap)

    def extract_features_scriptable(self, prev_output_tokens, encoder_out,
                                    incremental_state=None, full_context_alignment=False,
                                    alignment_layer=None, alignment_heads=None):
        # incremental decoding feeds one position at a time
        tokens = prev_output_tokens if incremental_state is None else prev_output_tokens[:, -1:]
        with layers_padding_mask(self, "self_attn_padding_mask", tokens):
            return super().extract_features_scriptable(
                prev_output_tokens, encoder_out, incremental_state,
                full_context_alignment, alignment_layer, alignment_heads,
            )

    def output_layer(self, features):
        if self.share_input_output_embed and isinstance(self.embed_tokens, FixNormEmbedding):
            # the tied output projection is the same FixNorm'd table as the input
            return F.linear(features, self.embed_tokens.fixnorm_weight())
        return super().output_layer(features)


@register_model_architecture("powernorm_transformer", "powernorm_transformer")
def powernorm_transformer(args):
    powernorm_defaults(args)
    transformer_wmt_en_de(args)


@register_model_architecture("powernorm_transformer", "powernorm_transformer_iwslt_de_en")
def powernorm_transformer_iwslt_de_en(args):
    """The paper's IWSLT14 "small": 6+6 layers, 512 embed, 1024 FFN, 4 heads."""
    powernorm_defaults(args)
    transformer_iwslt_de_en(args)


@register_model_architecture("powernorm_transformer", "powernorm_transformer_wmt_en_de")
def powernorm_transformer_wmt_en_de(args):
    """Transformer base."""
    powernorm_defaults(args)
    transformer_wmt_en_de(args)


@register_model_architecture("powernorm_transformer", "powernorm_transformer_wmt_en_de_big")
def powernorm_transformer_wmt_en_de_big(args):
    """Transformer big (Vaswani et al., 2017)."""
    powernorm_defaults(args)
    transformer_vaswani_wmt_en_de_big(args)
