# Transformers without Tears, PostNorm + LayerNorm on IWSLT14: the original Transformer placement
NORM=ln
PLACEMENT=post
