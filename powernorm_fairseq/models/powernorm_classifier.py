"""``powernorm_classifier``: an encoder-only transformer for fairseq's
``sentence_prediction`` task, with every norm chosen by flag.

The encoder is ``powernorm_transformer``'s, with the same norms, masks and
kernels; its depth, width and heads are fairseq's ``--encoder-layers``,
``--encoder-embed-dim``, ``--encoder-ffn-embed-dim`` and
``--encoder-attention-heads``. A sentence is the mean of its real tokens'
final states (padding left out), and a classification head, one linear
layer per head the task registers, maps it to the class logits. The
sentiment study of the reading list trains such a post-norm encoder with
SGD (``--norm-placement post``; docs/study.md).
"""

from fairseq.models import FairseqEncoderModel, register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig, TransformerModel
from fairseq.models.transformer.transformer_base import TransformerModelBase
from fairseq.models.transformer.transformer_legacy import base_architecture
from torch import nn

from ..common.errors import PowerNormConfigError
from .mixin import PowerNormModelMixin
from .options import add_norm_args, powernorm_defaults
from .powernorm_transformer import PowerNormTransformerEncoder


class _EncoderClassifier(FairseqEncoderModel):
    """A transformer encoder, mean pooling over the real tokens, and linear heads."""

    def __init__(self, args, encoder):
        super().__init__(encoder)
        self.args = args
        self.classification_heads = nn.ModuleDict()

    @classmethod
    def build_embedding(cls, cfg, dictionary, embed_dim, path=None):
        return TransformerModelBase.build_embedding.__func__(cls, cfg, dictionary, embed_dim, path)

    @classmethod
    def build_model(cls, args, task):
        if getattr(args, "fixnorm", False):
            raise PowerNormConfigError("--fixnorm ties the word embeddings to an output layer, "
                                       "and powernorm_classifier has none: drop --fixnorm")
        args.max_source_positions = getattr(args, "max_positions", None) or args.max_source_positions
        cfg = TransformerConfig.from_namespace(args)
        embed = cls.build_embedding(cfg, task.source_dictionary, cfg.encoder.embed_dim, cfg.encoder.embed_path)
        return cls(args, PowerNormTransformerEncoder(cfg, task.source_dictionary, embed))

    def register_classification_head(self, name, num_classes=None, inner_dim=None, **kwargs):
        if name in self.classification_heads and self.classification_heads[name].out_features != num_classes:
            have = self.classification_heads[name].out_features
            raise PowerNormConfigError(f"classification head {name} has {have} classes, not {num_classes}")
        self.classification_heads[name] = nn.Linear(self.args.encoder_embed_dim, num_classes)

    def forward(self, src_tokens, src_lengths=None, features_only=True, classification_head_name=None,
                **kwargs):
        """(logits of ``classification_head_name`` or the pooled sentence, extra)."""
        out = self.encoder(src_tokens, src_lengths=src_lengths)
        x = out["encoder_out"][0]  # T x B x C
        real = (~src_tokens.eq(self.encoder.padding_idx)).t().unsqueeze(-1).type_as(x)
        pooled = (x * real).sum(0) / real.sum(0).clamp(min=1)
        if classification_head_name is None:
            return pooled, {"encoder_out": out}
        return self.classification_heads[classification_head_name](pooled), {"encoder_out": out}

    def max_positions(self):
        return self.encoder.max_positions()


@register_model("powernorm_classifier")
class PowerNormClassifier(PowerNormModelMixin, _EncoderClassifier):
    """A sentence classifier whose encoder has the norms of the PowerNorm paper."""

    NORM_FLAGS = {"encoder": "--norm-type"}

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_norm_args(parser)


@register_model_architecture("powernorm_classifier", "powernorm_classifier")
def powernorm_classifier(args):
    """fairseq's transformer base encoder: 6 layers, 512 embed, 2048 FFN, 8 heads."""
    powernorm_defaults(args)
    base_architecture(args)

