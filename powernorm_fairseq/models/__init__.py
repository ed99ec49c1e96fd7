from .powernorm_transformer import PowerNormTransformerModel  # noqa: F401 (registers the model)
