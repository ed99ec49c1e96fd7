import importlib.util

if importlib.util.find_spec("fairseq") is None:  # pip install . declares no fairseq (pyproject.toml says why)
    raise ImportError("powernorm_fairseq's models need fairseq, which `pip install .` does not bring (its "
                      "Python 3.11 fork declares torchaudio, which would pull another torch): run "
                      "`pip install --no-deps --no-build-isolation fairseq-fixed==0.12.3.1`, or scripts/setup.sh")

from .. import patches

patches.install(patches.AT_IMPORT)

from .powernorm_transformer import PowerNormTransformerModel  # noqa: E402,F401 (registers the model)
from .powernorm_transformer_lm import PowerNormTransformerLanguageModel  # noqa: E402,F401 (registers the model)
from .powernorm_classifier import PowerNormClassifier  # noqa: E402,F401 (registers the model)
