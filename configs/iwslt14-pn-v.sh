# Table 1, IWSLT14 PN-V row (paper: 35.5 BLEU): batch quadratic mean, exact gradient
NORM=pn-v
