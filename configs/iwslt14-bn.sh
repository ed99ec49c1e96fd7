# Table 1, IWSLT14 BN row (paper: 34.4 BLEU): masked BatchNorm in the encoder
NORM=bn
