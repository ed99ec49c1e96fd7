# The field's norms since the paper on IWSLT14, Derf row (arXiv 2512.10938): Derf in the encoder, LN in the decoder, pre-norm
NORM=derf
