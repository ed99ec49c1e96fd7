"""``powernorm_transformer_lm``: fairseq's ``transformer_lm`` with every norm chosen by flag.

A language model is a decoder alone, so ``--norm-type`` sets all of its norms
(PN by default, as the paper's language-modeling rows normalise every layer
with the norm under test); ``--decoder-norm-self`` and ``--decoder-norm-ff``
override one kind of sublayer. The other norm flags are those of
``powernorm_transformer``.
"""

import types

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
    transformer_lm_baevski_wiki103,
)

from ..norms.placement import final_norm
from .mixin import PowerNormModelMixin
from .options import add_norm_args, powernorm_defaults
from .powernorm_transformer import PowerNormTransformerDecoder


class PowerNormLMDecoder(PowerNormTransformerDecoder):
    """powernorm_transformer's decoder, built from the flat argument namespace
    that fairseq's language model hands to its ``TransformerDecoder``."""

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        self.args = args
        super().__init__(TransformerConfig.from_namespace(args), dictionary, embed_tokens,
                         no_encoder_attn, output_projection)


def _building(decoder_class):
    """fairseq's ``TransformerLanguageModel.build_model``, its code unchanged,
    with the name ``TransformerDecoder`` in it bound to ``decoder_class``:
    fairseq's method names its decoder class directly and has no hook for it
    (``TransformerModel.build_decoder`` has no counterpart in the language
    model). Nothing of fairseq's is modified, and the embeddings, adaptive
    input and checks stay fairseq's own."""
    build = TransformerLanguageModel.build_model.__func__
    names = {**build.__globals__, "TransformerDecoder": decoder_class}
    return types.FunctionType(build.__code__, names, build.__name__, build.__defaults__, build.__closure__)


class _WithOurDecoder(TransformerLanguageModel):
    build_model = classmethod(_building(PowerNormLMDecoder))


@register_model("powernorm_transformer_lm")
class PowerNormTransformerLanguageModel(PowerNormModelMixin, _WithOurDecoder):
    """fairseq's ``TransformerLanguageModel`` with the norms of the PowerNorm paper."""

    NORM_FLAGS = {"decoder": "--norm-type"}

    @classmethod
    def add_args(cls, parser):
        gen_parser_from_dataclass(parser, TransformerLanguageModelConfig(), delete_default=True)
        add_norm_args(parser, lm=True)


def _lm_defaults(args, fairseq_arch):
    powernorm_defaults(args)
    args.decoder_norm_type = args.norm_type  # one side: --norm-type is every norm
    fairseq_arch(args)
    # fairseq's wiki103 architecture forces pre-norm; --norm-placement decides here
    args.decoder_normalize_before = final_norm(args, "decoder")


@register_model_architecture("powernorm_transformer_lm", "powernorm_transformer_lm")
def powernorm_transformer_lm(args):
    """fairseq's ``transformer_lm``: 6 layers, 512 embed, 2048 FFN, 8 heads."""
    _lm_defaults(args, base_lm_architecture)


@register_model_architecture("powernorm_transformer_lm", "powernorm_transformer_lm_wiki103")
def powernorm_transformer_lm_wiki103(args):
    """fairseq's ``transformer_lm_wiki103`` (Baevski & Auli, 2019): 16 layers,
    1024 embed, 4096 FFN, adaptive input and softmax, no final decoder norm."""
    _lm_defaults(args, transformer_lm_baevski_wiki103)
