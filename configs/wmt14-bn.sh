# Table 1, WMT14 BN row (paper: 28.1 BLEU): the authors' "batch" norm, which produced the paper's BN rows (bn-original; masked BN is --norm bn)
DATASET=wmt14
NORM=bn-original
# the layer scale before the norm, as in every setting of the paper (Appendix A)
EXTRA=(--layer-scale)
