# Language modeling, PTB, PN in every layer (paper: a Tensorized
# Transformer; here fairseq's transformer_lm, see README "Language modeling")
DATASET=ptb
NORM=pn
