# Table 1, IWSLT14 BN row (paper: 34.4 BLEU): masked BatchNorm in the encoder
NORM=bn
# the layer scale before the norm, as in every setting of the paper (Appendix A)
EXTRA=(--layer-scale)
