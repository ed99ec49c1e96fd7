# Table 1, WMT14 PN-V row (paper: 28.5 BLEU)
DATASET=wmt14
NORM=pn-v
# the layer scale before the norm, as in every setting of the paper (Appendix A)
EXTRA=(--layer-scale)
