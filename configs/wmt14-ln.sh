# Table 1, WMT14 LN row (paper: 29.5 BLEU)
DATASET=wmt14
NORM=ln
