# Table 1, WMT14 BN row (paper: 28.1 BLEU)
DATASET=wmt14
NORM=bn
