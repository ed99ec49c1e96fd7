# Quickstart, LN row: the CPU-sized IWSLT14 small on the shipped corpus, LayerNorm in the encoder too
DATASET=quickstart
NORM=ln
