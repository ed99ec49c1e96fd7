# Transformers without Tears, PreNorm + LayerNorm on IWSLT14: LN everywhere, pre-norm
NORM=ln
