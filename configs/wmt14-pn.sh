# Table 1, WMT14 PN row (paper: 30.1 BLEU)
DATASET=wmt14
NORM=pn
