"""``powernorm_transformer_lm``: fairseq's ``transformer_lm`` with every norm chosen by flag.

A language model is a decoder alone, so ``--norm-type`` sets all of its norms
(PN by default, as the paper's language-modeling rows normalise every layer
with the norm under test); ``--decoder-norm-self`` and ``--decoder-norm-ff``
override one kind of sublayer. The other norm flags are those of
``powernorm_transformer``.
"""

from unittest import mock

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture, transformer_lm
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
    transformer_lm_baevski_wiki103,
)

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


@register_model("powernorm_transformer_lm")
class PowerNormTransformerLanguageModel(PowerNormModelMixin, TransformerLanguageModel):
    """fairseq's ``TransformerLanguageModel`` with the norms of the PowerNorm paper."""

    NORM_FLAGS = {"decoder": "--norm-type"}

    @classmethod
    def add_args(cls, parser):
        gen_parser_from_dataclass(parser, TransformerLanguageModelConfig(), delete_default=True)
        add_norm_args(parser, lm=True)

    @classmethod
    def build_model(cls, args, task):
        # fairseq's build_model names its decoder class directly: build ours in its place
        with mock.patch.object(transformer_lm, "TransformerDecoder", PowerNormLMDecoder):
            return super().build_model(args, task)


def _lm_defaults(args, fairseq_arch):
    powernorm_defaults(args)
    args.decoder_norm_type = args.norm_type  # one side: --norm-type is every norm
    fairseq_arch(args)
    # fairseq's wiki103 architecture forces pre-norm; --norm-placement decides here
    args.decoder_normalize_before = args.norm_placement == "pre"


@register_model_architecture("powernorm_transformer_lm", "powernorm_transformer_lm")
def powernorm_transformer_lm(args):
    """fairseq's ``transformer_lm``: 6 layers, 512 embed, 2048 FFN, 8 heads."""
    _lm_defaults(args, base_lm_architecture)


@register_model_architecture("powernorm_transformer_lm", "powernorm_transformer_lm_wiki103")
def powernorm_transformer_lm_wiki103(args):
    """fairseq's ``transformer_lm_wiki103`` (Baevski & Auli, 2019): 16 layers,
    1024 embed, 4096 FFN, adaptive input and softmax, no final decoder norm."""
    _lm_defaults(args, transformer_lm_baevski_wiki103)
