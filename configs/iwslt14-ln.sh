# Table 1, IWSLT14 LN row (paper: 35.5 BLEU): LayerNorm in the encoder too
NORM=ln
