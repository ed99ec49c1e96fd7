# Table 1, IWSLT14 PN row (paper: 35.9 BLEU): the defaults, PN encoder and LN decoder
NORM=pn
