# Language modeling, WikiText-103, LayerNorm in every layer (paper: a Tensorized
# Transformer; here fairseq's transformer_lm, see README "Language modeling")
DATASET=wikitext103
NORM=ln
