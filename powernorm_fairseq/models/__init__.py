from .powernorm_transformer import PowerNormTransformerModel  # noqa: F401 (registers the model)
from .powernorm_transformer_lm import PowerNormTransformerLanguageModel  # noqa: F401 (registers the model)
