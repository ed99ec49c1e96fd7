# Language modeling, WikiText-103, PN-V in every layer (paper: a Tensorized
# Transformer; here fairseq's transformer_lm, see README "Language modeling")
DATASET=wikitext103
NORM=pn-v
# the layer scale before the norm, as in every setting of the paper (Appendix A)
EXTRA=(--layer-scale)
