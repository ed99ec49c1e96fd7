# Language modeling, WikiText-103, masked BatchNorm in every layer (paper: a Tensorized
# Transformer; here fairseq's transformer_lm, see README "Language modeling")
DATASET=wikitext103
NORM=bn
# the layer scale before the norm, as in every setting of the paper (Appendix A)
EXTRA=(--layer-scale)
