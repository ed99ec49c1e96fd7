# Table 1, WMT14 PN-V row (paper: 28.5 BLEU)
DATASET=wmt14
NORM=pn-v
