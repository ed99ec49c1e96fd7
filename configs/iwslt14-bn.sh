# Table 1, IWSLT14 BN row (paper: 34.4 BLEU): the authors' "batch" norm, which produced the paper's BN rows (bn-original; masked BN is --norm bn)
NORM=bn-original
# the layer scale before the norm, as in every setting of the paper (Appendix A)
EXTRA=(--layer-scale)
