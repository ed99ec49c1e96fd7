from .. import patches

patches.install(patches.AT_IMPORT)

from .powernorm_transformer import PowerNormTransformerModel  # noqa: E402,F401 (registers the model)
from .powernorm_transformer_lm import PowerNormTransformerLanguageModel  # noqa: E402,F401 (registers the model)
from .powernorm_classifier import PowerNormClassifier  # noqa: E402,F401 (registers the model)
