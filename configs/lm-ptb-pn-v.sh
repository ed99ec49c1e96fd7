# Language modeling, PTB, PN-V in every layer (paper: a Tensorized
# Transformer; here fairseq's transformer_lm, see README "Language modeling")
DATASET=ptb
NORM=pn-v
# the layer scale before the norm, as in every setting of the paper (Appendix A)
EXTRA=(--layer-scale)
