# Table 1, IWSLT14 PN-V row (paper: 35.5 BLEU): batch quadratic mean, exact gradient
NORM=pn-v
# the layer scale before the norm, as in every setting of the paper (Appendix A)
EXTRA=(--layer-scale)
