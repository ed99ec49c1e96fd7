# Transformers without Tears, PreNorm + FixNorm + ScaleNorm: ScaleNorm in both stacks, FixNorm embeddings
NORM=scalenorm
DECODER_NORM=scalenorm
EXTRA=(--fixnorm)
