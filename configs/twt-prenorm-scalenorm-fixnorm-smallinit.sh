# Transformers without Tears, PreNorm + FixNorm + ScaleNorm + SmallInit: their best IWSLT row
NORM=scalenorm
DECODER_NORM=scalenorm
EXTRA=(--fixnorm --small-init)
