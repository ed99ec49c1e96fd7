# Transformers without Tears, PostNorm + FixNorm + ScaleNorm
NORM=scalenorm
DECODER_NORM=scalenorm
PLACEMENT=post
EXTRA=(--fixnorm)
