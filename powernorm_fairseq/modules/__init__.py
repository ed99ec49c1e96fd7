from .fixnorm import FixNormEmbedding
from .transformer_layer import (
    PowerNormDecoderLayer,
    PowerNormEncoderLayer,
    decoder_norm,
    encoder_norm,
)

__all__ = [
    "FixNormEmbedding",
    "PowerNormDecoderLayer",
    "PowerNormEncoderLayer",
    "decoder_norm",
    "encoder_norm",
]
