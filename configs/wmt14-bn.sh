# Table 1, WMT14 BN row (paper: 28.1 BLEU)
DATASET=wmt14
NORM=bn
# the layer scale before the norm, as in every setting of the paper (Appendix A)
EXTRA=(--layer-scale)
